import torch
import torch.nn.functional as F

from services.dense.layers.native_ops import tandem_native as _native


def _native_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (_native is not None and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.device.type == "cpu" and not x.requires_grad)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, scaled in the input's dtype (as the reference models do).

    float32 on the CPU takes one native call: torch's own is a chain of small ops, about 30 us of a
    decode step each time (25 norms a step on a 6-layer qwen3)."""
    dtype = x.dtype
    if dtype == torch.float32 and weight.dtype == torch.float32:
        if _native_applies(x, weight):
            rows = x.contiguous().view(-1, x.shape[-1])
            out = torch.empty_like(rows)
            _native.rms_norm(rows.numpy(), weight.numpy(), eps, out.numpy())
            return out.view(x.shape)
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream h [T, D] plus a block's output delta (None: nothing to add), and its norm:
    (h + delta, rms_norm(h + delta)), as vLLM's fused add-norm. float32 on the CPU adds into h in
    place and norms in the same native call (the same bits as the add and rms_norm apart)."""
    if delta is None:
        return h, rms_norm(h, weight, eps)
    if _native_applies(h, weight) and delta.dtype == torch.float32 and h.is_contiguous():
        out = torch.empty_like(h)
        _native.add_rms_norm(h.numpy(), delta.contiguous().numpy(), weight.numpy(), eps, out.numpy())
        return h, out
    h = h + delta
    return h, rms_norm(h, weight, eps)
