import torch
import torch.nn.functional as F

from services.dense.weights import WeightLoader


class GatedMLP:
    """down(silu(gate(x)) * up(x)): dense layers and shared experts."""

    def __init__(self, w: WeightLoader, prefix: str, hidden: int, intermediate: int, bias: bool = False,
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
        gate, up, down = names
        self.gate = w.linear(f"{prefix}.{gate}", intermediate, hidden, bias)
        self.up = w.linear(f"{prefix}.{up}", intermediate, hidden, bias)
        self.down = w.linear(f"{prefix}.{down}", hidden, intermediate, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        return self.down(F.silu(self.gate(x)) * self.up(x))
