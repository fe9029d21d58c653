"""Small building blocks with fla's parameter names: RMS norms, short convolution, gated MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, computed in float32 and cast back."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class GatedRMSNorm(RMSNorm):
    """fla's FusedRMSNormGated: rmsnorm(x) * weight * act(gate), act = swish or sigmoid."""

    def __init__(self, size: int, eps: float, activation: str = "swish") -> None:
        super().__init__(size, eps)
        self.activation = activation

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        gate32 = gate.float()
        act = torch.sigmoid(gate32) if self.activation == "sigmoid" else F.silu(gate32)
        return (super().forward(x).float() * act).to(x.dtype)


class ShortConvolution(nn.Conv1d):
    """Depthwise causal conv over time (fla's ShortConvolution), optional SiLU. x: [B, T, D]."""

    def __init__(self, size: int, kernel_size: int, bias: bool = False, activation: str | None = "silu") -> None:
        super().__init__(size, size, kernel_size, groups=size, padding=kernel_size - 1, bias=bias)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        y = super().forward(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
        return F.silu(y) if self.activation else y

    def step(self, x: torch.Tensor, previous: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The same convolution continued from a decoding cache: x [B, T, D] after `previous` [B, W - 1, D] (the
        last inputs seen; None: zeros, the start of a sequence) -> (y [B, T, D], the last W - 1 inputs now)."""
        width = self.kernel_size[0] - 1
        if previous is None:
            previous = x.new_zeros(x.shape[0], width, x.shape[2])
        xx = torch.cat([previous.to(x.dtype), x], 1)
        y = F.conv1d(xx.transpose(1, 2), self.weight, self.bias, groups=self.groups).transpose(1, 2)
        return (F.silu(y) if self.activation else y), xx[:, xx.shape[1] - width :]


class GatedMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
