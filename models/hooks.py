"""The one hook point: an identity module whose output nnsight reads and overwrites."""

from __future__ import annotations

import torch
from torch import nn


class HookPoint(nn.Module):
    """Identity. Named by its place in the model (e.g. `layers.0.attn.hook_beta`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x
