"""Testing helpers for the delta-rule kernels (as `xarray.testing` is for xarray): random inputs in the kernels'
layout, the relative error a fast path is judged by, and the tolerance of each dtype against a float64 reference.

    from deltalab.kernels import testing
    x = testing.delta_inputs(2, 100, 2, 4, 16, 8, n_h=2, gate="scalar", seed=0, unit_keys=True)
    o, final, _ = chunk_delta_product(*x.to(dtype=torch.float32)[:5], initial_state=x.initial_state.float())
    ref, _, _ = naive_delta_product(*x[:5], initial_state=x.initial_state)
    assert testing.rel_err(o, ref) < testing.tolerance(torch.float32)

Shapes follow docs/architecture.md: q [B, T, Hk, dk], k [B, T, n_h, Hk, dk], v [B, T, n_h, Hv, dv],
beta [B, T, n_h, Hv], g [B, T, Hv] (scalar gate) or [B, T, Hv, dk] (per-channel gate) or None, initial state
[N, Hv, dk, dv]. The draws are in a fixed order (q, k, v, beta, g, initial state), so a seed names one input set.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-4,
    torch.float16: 8e-3,
    torch.bfloat16: 3e-2,
}
"""Largest relative error (`rel_err`, max norm) of a forward in each input dtype against the float64 loop, at the
tests' shapes (T up to a few thousand tokens, log decays in (-1, 0])."""

GateSampler = Callable[[torch.Generator | None], torch.Tensor]
"""Draws a custom log-decay tensor g from the generator (None: torch's global one), in g's place in the order."""


def tolerance(dtype: torch.dtype) -> float:
    """`TOLERANCES[dtype]`; ValueError naming the dtypes known for any other."""
    try:
        return TOLERANCES[dtype]
    except KeyError:
        known = ", ".join(str(d).removeprefix("torch.") for d in TOLERANCES)
        raise ValueError(f"no tolerance for {dtype}: use one of {known}") from None


def rel_err(actual: torch.Tensor, expected: torch.Tensor, *, norm: str = "max", floor: float = 1e-30) -> float:
    """Relative error of `actual` against `expected` (same shape, any dtype or device), in float64.

    norm "max": max |a - e| / max |e| (the kernels' tests); "fro": ||a - e||_F / ||e||_F (whole maps);
    "pointwise": max over elements of |a - e| / max(|e|, floor) (metrics that must hold everywhere).
    The denominator is at least `floor`, so an all-zero `expected` gives 0 for an equal `actual`.
    """
    a = actual.detach().double()
    e = expected.detach().double().to(a.device)
    if a.shape != e.shape:
        raise ValueError(f"rel_err: actual has shape {tuple(a.shape)}, expected {tuple(e.shape)}")
    diff = a - e
    if norm == "max":
        return (diff.abs().max() / e.abs().max().clamp_min(floor)).item()
    if norm == "fro":
        return (diff.norm() / e.norm().clamp_min(floor)).item()
    if norm == "pointwise":
        return (diff.abs() / e.abs().clamp_min(floor)).max().item()
    raise ValueError(f"rel_err: norm {norm!r} is not one of max, fro, pointwise")


class DeltaInputs(NamedTuple):
    """One set of delta-rule inputs (shapes in the module docstring); `x[:5]` are the positional arguments."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    beta: torch.Tensor
    g: torch.Tensor | None
    initial_state: torch.Tensor | None

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> DeltaInputs:
        """The same inputs cast to `dtype` and/or moved to `device` (None entries stay None)."""
        return DeltaInputs(*(None if x is None else x.to(device=device, dtype=dtype) for x in self))


def _generator(seed: int | None) -> torch.Generator | None:
    return None if seed is None else torch.Generator(device="cpu").manual_seed(seed)


def _log_decays(gate: str | bool | GateSampler | None, shape: tuple[int, int, int], K: int, decay: float,
                gen: torch.Generator | None, dtype: torch.dtype) -> torch.Tensor | None:
    if gate is None or gate is False:
        return None
    if callable(gate):
        return gate(gen)
    if gate is True or gate == "scalar":
        return -torch.rand(*shape, generator=gen, dtype=dtype) * decay
    if gate == "channel":
        return -torch.rand(*shape, K, generator=gen, dtype=dtype) * decay
    raise ValueError(f"gate {gate!r} is not one of None, 'scalar', 'channel' or a sampler")


def delta_inputs(B: int, T: int, Hk: int, Hv: int, K: int, V: int, n_h: int = 1,
                 gate: str | bool | GateSampler | None = None, *, seed: int | None = None,
                 dtype: torch.dtype = torch.float64, device: torch.device | str = "cpu", unit_keys: bool = False,
                 beta_max: float = 2.0, decay: float = 1.0, initial_state: bool = True, n_seq: int | None = None,
                 state_scale: float = 1.0) -> DeltaInputs:
    """Random delta-rule inputs, drawn on the CPU in `dtype` (then moved to `device`) in the order q, k, v, beta,
    g, initial state.

    B, T: batch rows and tokens; Hk key heads (q, k), Hv value heads (v, beta, g, state; a multiple of Hk); K = dk,
    V = dv; n_h Householder sub-steps a token. gate: None (no gate), "scalar" (or True: g [B, T, Hv]), "channel"
    (g [B, T, Hv, K]), with log decays uniform in (-decay, 0]; or a GateSampler for other distributions.
    seed: a fresh generator of that seed (None: torch's global generator). unit_keys: k normalised to unit length
    (beta = 2 is then an exact reflection); beta uniform in [0, beta_max). initial_state: a state [n_seq or B, Hv,
    K, V] of standard normals times state_scale (n_seq: packed sequences), else None.
    """
    gen = _generator(seed)
    q = torch.randn(B, T, Hk, K, generator=gen, dtype=dtype)
    k = torch.randn(B, T, n_h, Hk, K, generator=gen, dtype=dtype)
    if unit_keys:
        k = torch.nn.functional.normalize(k, dim=-1)
    v = torch.randn(B, T, n_h, Hv, V, generator=gen, dtype=dtype)
    beta = torch.rand(B, T, n_h, Hv, generator=gen, dtype=dtype) * beta_max
    g = _log_decays(gate, (B, T, Hv), K, decay, gen, dtype)
    s0 = torch.randn(n_seq or B, Hv, K, V, generator=gen, dtype=dtype) * state_scale if initial_state else None
    return DeltaInputs(q, k, v, beta, g, s0).to(device=device)


def transition_inputs(B: int, T: int, n_h: int, H: int, K: int, gate: str | bool | None = None, *,
                      seed: int | None = None, dtype: torch.dtype = torch.float64, unit_keys: bool = True,
                      decay: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(k [B, T, n_h, H, K], beta [B, T, n_h, H] in [0, 2), g or None): what a token's transition is made of (the
    spectra and ranks kernels read no q or v), drawn in the order k, beta, g; `gate`, `decay` and `seed` as in
    `delta_inputs`."""
    gen = _generator(seed)
    k = torch.randn(B, T, n_h, H, K, generator=gen, dtype=dtype)
    if unit_keys:
        k = k / k.norm(dim=-1, keepdim=True)
    beta = torch.rand(B, T, n_h, H, generator=gen, dtype=dtype) * 2
    return k, beta, _log_decays(gate, (B, T, H), K, decay, gen, dtype)


def dplr_inputs(B: int, T: int, H: int, K: int, V: int, *, seed: int, decay: bool = True, init: bool = False,
                dtype: torch.dtype = torch.float64, log_w_min: float = -5.0) -> tuple[torch.Tensor | None, ...]:
    """RWKV-7-shaped inputs of the generalised delta rule H <- (diag(e^g) + b a^T) H + k v^T: (q, k, v, a, b, g,
    initial state), with a = -kappa, b = kappa * a_rwkv, kappa unit-norm and a_rwkv in (0, 1).

    q, k, a, b, g [B, T, H, K] (k scaled by K^-1/2), v [B, T, H, V]; g uniform in (log_w_min, 0] (None without
    `decay`); initial state [B, H, K, V] (None without `init`). Drawn in float64 from a generator of `seed`, then
    cast to `dtype`.
    """
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    kappa = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1)
    a_rwkv = torch.rand(B, T, H, K, generator=gen, dtype=torch.float64)
    g = torch.rand(B, T, H, K, generator=gen, dtype=torch.float64) * log_w_min if decay else None
    s0 = rnd(B, H, K, V) if init else None
    xs = (rnd(B, T, H, K), rnd(B, T, H, K) / K**0.5, rnd(B, T, H, V), -kappa, kappa * a_rwkv, g, s0)
    return tuple(None if x is None else x.to(dtype) for x in xs)


def cu_seqlens(lengths: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """[N + 1] int32 rising token offsets of packed sequences of `lengths` (fla's and transformers' cu_seqlens)."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
