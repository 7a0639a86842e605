import torch
import torch.nn.functional as F

from services.dense.weights import WeightLoader


class GatedMLP:
    """down(silu(gate(x)) * up(x)): dense layers and shared experts; gate and up as one linear."""

    def __init__(self, w: WeightLoader, prefix: str, hidden: int, intermediate: int, bias: bool = False,
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
        gate, up, down = names
        self.intermediate = intermediate
        self.gate_up = w.linears([f"{prefix}.{gate}", f"{prefix}.{up}"], [intermediate, intermediate], hidden, bias)
        self.down = w.linear(f"{prefix}.{down}", hidden, intermediate, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        gate, up = self.gate_up(x).split(self.intermediate, dim=-1)
        return self.down(F.silu(gate) * up)
