import torch
import torch.nn.functional as F

from services.dense.layers.native_ops import tandem_native as _native


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, scaled in the input's dtype (as the reference models do).

    float32 on the CPU takes one native call: torch's own is a chain of small ops, about 30 us of a
    decode step each time (25 norms a step on a 6-layer qwen3)."""
    dtype = x.dtype
    if dtype == torch.float32 and weight.dtype == torch.float32:
        if _native is not None and x.device.type == "cpu" and not x.requires_grad:
            rows = x.detach().contiguous().view(-1, x.shape[-1])
            out = torch.empty_like(rows)
            _native.rms_norm(rows.numpy(), weight.detach().contiguous().numpy(), eps, out.numpy())
            return out.view(x.shape)
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)
