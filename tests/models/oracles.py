"""Shared pieces of the oracle tests: the relative error, and oracle (c), beta = 0 on one head made through
`hook_beta` and by hand inside the layer's kernel call (deltalab's own layers or a transformers layer)."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from nnsight import NNsight

import deltalab.models.attention
from deltalab.models.hf.families import GDN_KERNELS
from tests.models.hf_tiny import original_kernels


def fro(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error in the Frobenius norm."""
    return float((a.double() - b.double()).norm() / b.double().norm())


def beta_zero_through_hook(model: torch.nn.Module, ids: torch.Tensor, layer: int, head: int) -> torch.Tensor:
    """Logits with beta of value head `head` in `layer` set to 0 through nnsight's hook_beta."""
    nn = NNsight(model)
    with torch.no_grad(), nn.trace(ids):
        nn.layers[layer].attn.hook_beta.output[:, :, :, head] = 0.0
        out = nn.output.save()
    return out.logits


def beta_zero_by_hand(model: torch.nn.Module, ids: torch.Tensor, call: int, head: int,
                      monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(plain logits, logits with beta of `head` zeroed inside the `call`-th kernel call) of a deltalab model."""
    real = deltalab.models.attention.delta_product_forward
    calls = []

    def zero_head(q, k, v, beta, g=None, **kw):
        calls.append(1)
        if len(calls) == call + 1:
            beta = beta.clone()
            beta[..., head] = 0.0
        return real(q, k, v, beta, g, **kw)

    with torch.no_grad():
        base = model(ids).logits
        with monkeypatch.context() as m:
            m.setattr(deltalab.models.attention, "delta_product_forward", zero_head)
            by_hand = model(ids).logits
    return base, by_hand


def beta_zero_in_transformers(model: torch.nn.Module, module: ModuleType, ids: torch.Tensor, call: int, head: int,
                              names: tuple[str, str] = GDN_KERNELS) -> tuple[torch.Tensor, torch.Tensor]:
    """(plain logits, logits with beta of `head` zeroed inside the `call`-th chunk-kernel call) of an untouched
    transformers model running its own kernels (`names`: the family's chunk and recurrent kernel globals)."""
    def zero_head(i, kwargs):
        if i == call:
            kwargs["beta"] = kwargs["beta"].clone()
            kwargs["beta"][..., head] = 0.0

    with torch.no_grad():
        with original_kernels(module, names=names):
            base = model(ids).logits
        with original_kernels(module, zero_head, names=names):
            by_hand = model(ids).logits
    return base, by_hand
