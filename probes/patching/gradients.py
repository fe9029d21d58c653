"""Exact gradients of a metric with respect to every recurrent state, and attribution patching.

State gradients: the state S_t of a head (after token t's writes) feeds o_t and, through the recurrence, every
later output. Adding a perturbation E_t to each S_t changes the outputs by the homogeneous recurrence
D_t = A_t D_{t-1} + E_t, delta_o_t = scale D_t^T q_t (A_t: the token's decay and Householder steps, the same
transition as the layer's), which is zero at E = 0. Adding that zero term to the layer's output (`hook_o`) leaves
the forward unchanged bit for bit, and one backward pass gives dMetric/dS_t = dMetric/dE_t for every token of
every head at once: the adjoint recurrence, computed by autograd, not by finite differences.

Attribution patching (the gradient approximation of activation patching): one forward and backward of the base
run gives dMetric/da for every hook output a, and the effect of patching a from the source run is estimated as
(a_source - a_base) . dMetric/da, summed over the cell (a head, a position); states the same way with the exact
state gradients. Estimates are normalised as actual patching is (0 = corrupted, 1 = clean).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import xarray as xr
from torch import nn

from deltalab.probes.patching.hooks import (
    RESID_HOOKS,
    head_axis,
    hook_module,
    hook_name,
    hooks_installed,
    is_delta_layer,
)
from deltalab.probes.patching.metrics import Metric, normalise
from deltalab.probes.patching.runs import STATE_INPUTS, Run, layer_scale
from deltalab.probes.patching.sweeps import _check_layers, _Experiment, _n_heads, prepare


def perturbation_outputs(q, k, beta, g, scale: float, E: torch.Tensor) -> torch.Tensor:
    """The change of a delta-rule layer's outputs when E[:, t] is added to the state after token t.

    q [B,T,Hk,dk], k [B,T,n_h,Hk,dk], beta [B,T,n_h,Hv], g [B,T,Hv] / [B,T,Hv,dk] / None, E [B,T,Hv,dk,dv]
    -> [B, T, Hv, dv] in E's dtype. Linear in E, differentiable (a token loop: the adjoint runs backward)."""
    B, T, Hv = E.shape[:3]
    group = Hv // q.shape[2]
    q = q.to(E.dtype).repeat_interleave(group, dim=2)
    k = k.to(E.dtype).repeat_interleave(group, dim=3)
    beta = beta.to(E.dtype)
    D = torch.zeros_like(E[:, 0])
    out = []
    for t in range(T):
        if g is not None:
            decay = g[:, t].to(E.dtype).exp()
            D = D * (decay[..., None, None] if decay.dim() == 2 else decay[..., None])
        for j in range(k.shape[2]):
            k_tj = k[:, t, j]
            D = D - beta[:, t, j, :, None, None] * k_tj[..., :, None] * torch.einsum("bhkv,bhk->bhv", D, k_tj)[
                ..., None, :]
        D = D + E[:, t]
        out.append(scale * torch.einsum("bhkv,bhk->bhv", D, q[:, t]))
    return torch.stack(out, 1)


def _gradient_pass(model: nn.Module, ids: torch.Tensor, score: Callable[[torch.Tensor], torch.Tensor],
                   hooks: Sequence[tuple[str, int]], state_layers: Sequence[int]
                   ) -> tuple[float, dict[tuple[str, int], torch.Tensor], dict[int, torch.Tensor]]:
    """(metric, dMetric/d(hook output) [T, ...] per hook, dMetric/dS_t [T, Hv, dk, dv] per layer) of one run."""
    zeros: dict[tuple[str, int], torch.Tensor] = {}
    perts: dict[int, torch.Tensor] = {}
    seen: dict[int, dict[str, torch.Tensor]] = {layer: {} for layer in state_layers}
    fns: dict[tuple[str, int], Callable[[torch.Tensor], torch.Tensor]] = {}

    def leaf(key: tuple[str, int]) -> Callable[[torch.Tensor], torch.Tensor]:
        def fn(out: torch.Tensor) -> torch.Tensor:
            zeros[key] = torch.zeros_like(out, requires_grad=True)
            return out + zeros[key]
        return fn

    def keep(layer: int, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        def fn(out: torch.Tensor) -> torch.Tensor:
            seen[layer][name] = out
            return out
        return fn

    def perturbed(layer: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def fn(o: torch.Tensor) -> torch.Tensor:
            s = seen[layer]
            dtype = torch.float64 if o.dtype == torch.float64 else torch.float32
            B, T, Hv, dv = o.shape
            E = perts[layer] = torch.zeros(B, T, Hv, s["q"].shape[-1], dv, dtype=dtype, device=o.device,
                                           requires_grad=True)
            return o + perturbation_outputs(s["q"], s["k"], s["beta"], s.get("g"), layer_scale(model, layer),
                                            E).to(o.dtype)
        return fn

    for layer in state_layers:
        for name in STATE_INPUTS:
            if hook_module(model, name, layer) is not None:
                fns[name, layer] = keep(layer, name)
        fns["o", layer] = perturbed(layer)
    for key in hooks:
        fns[key] = leaf(key) if key not in fns else (lambda out, a=fns[key], b=leaf(key): b(a(out)))
    with torch.enable_grad(), hooks_installed(model, fns):
        value = score(model(ids[None]).logits)
        keys = list(zeros)
        grads = torch.autograd.grad(value.sum(), [zeros[k] for k in keys] + [perts[i] for i in state_layers],
                                    allow_unused=True)
    act = {k: (torch.zeros_like(zeros[k]) if g is None else g)[0].detach() for k, g in zip(keys, grads)}
    states = {i: (torch.zeros_like(perts[i]) if g is None else g)[0].detach()
              for i, g in zip(state_layers, grads[len(keys):])}
    return float(value.detach().sum()), act, states


def state_gradients(model: nn.Module, ids: Any, metric: Metric | str, *, clean: Any = None,
                    layers: Sequence[int] | None = None) -> xr.Dataset:
    """dMetric/dS_t for every token t and value head of the delta-rule `layers` (default all) in the run of ids [T].

    clean: the reference sequence of `loss` and `kl` (default ids itself). Returns `grad` over
    (layer, token, head, key, value) and the run's metric in attrs."""
    metric = Metric.parse(metric) if isinstance(metric, str) else metric
    clean_ids, ids_t = prepare(model, ids if clean is None else clean, ids, metric, "denoise")
    reference = Run.record(model, clean_ids)
    if layers is None:
        layers = [i for i in range(len(model.layers)) if is_delta_layer(model, i)]
    layers = _check_layers(model, layers)
    value, _, grads = _gradient_pass(model, ids_t, lambda x: metric(x, reference.ids, reference.logits), [], layers)
    arr = np.stack([grads[i].double().cpu().numpy() for i in layers])
    return xr.Dataset({"grad": (("layer", "token", "head", "key", "value"), arr,
                                {"description": f"d({metric.label})/dS_t, S_t the state after token t"})},
                      coords={"layer": layers, "token": np.arange(len(ids_t))},
                      attrs={"metric": metric.label, "metric_value": value})


def attribution_patching(model: nn.Module, clean: Any, corrupted: Any, metric: Metric | str, *,
                         hooks: Sequence[str] = ("resid_pre",), layers: Sequence[int] | None = None,
                         per_head: bool = True, per_position: bool = True, states: bool = True,
                         direction: str = "denoise") -> xr.Dataset:
    """Estimate every activation patch (and state patch) at once: one forward and backward of the base run.

    The same cells and normalisation as `activation_patching` (`attribution` over hook, layer, head, position)
    and `state_patching`'s full patches (`state_attribution` over layer, head, token)."""
    metric = Metric.parse(metric) if isinstance(metric, str) else metric
    exp = _Experiment(model, clean, corrupted, metric, direction)
    T = len(exp.clean.ids)
    hooks = [hook_name(h) for h in hooks]
    layers = _check_layers(model, layers)
    keys = [(h, layer) for h in hooks for layer in layers if hook_module(model, h, layer) is not None]
    state_layers = [i for i in layers if is_delta_layer(model, i)] if states else []
    base_value, act, grads = _gradient_pass(model, exp.base.ids, exp.score, keys, state_layers)
    n_heads = max([_n_heads(model, h, layer) for h in hooks for layer in layers if h not in RESID_HOOKS] or [0])
    head_coord = [-1] + (list(range(n_heads)) if per_head else [])
    pos_coord = list(range(T)) if per_position else [-1]
    est = np.full((len(hooks), len(layers), len(head_coord), len(pos_coord)), np.nan)
    for hook, layer in keys:
        delta = (exp.source.cache[hook, layer][0] - exp.base.cache[hook, layer][0]).to(act[hook, layer].dtype)
        prod = (delta * act[hook, layer]).double()  # [T, ...]
        axis = head_axis(model, hook, layer)
        per_pos_all = prod.flatten(1).sum(1)  # [T]
        cells = {-1: per_pos_all}
        if per_head and axis is not None:
            by_head = prod.movedim(axis - 1, 1).flatten(2).sum(2)  # [T, H]
            cells.update({h: by_head[:, h] for h in range(by_head.shape[1])})
        for h, v in cells.items():
            v = v.cpu().numpy()
            est[hooks.index(hook), layers.index(layer), head_coord.index(h)] = v if per_position else v.sum()
    est_metric = base_value + est
    dims = ("hook", "layer", "head", "position")
    data = {"attribution": (dims, normalise(est_metric, exp.clean_metric, exp.corrupted_metric),
                            {"description": "estimated normalised metric of each patch (0 = corrupted, 1 = clean)"}),
            "attribution_metric": (dims, est_metric)}
    coords: dict[str, Any] = {"hook": hooks, "layer": layers, "head": head_coord, "position": pos_coord}
    if state_layers:
        hv = max(model.layers[i].attn.num_v_heads for i in state_layers)
        s_est = np.full((len(state_layers), hv, T), np.nan)
        for n, layer in enumerate(state_layers):
            delta = exp.source.states(layer) - exp.base.states(layer)  # [T, Hv, dk, dv]
            s = (delta.to(grads[layer].dtype) * grads[layer]).double().sum((-1, -2))  # [T, Hv]
            s_est[n, : s.shape[1]] = s.T.cpu().numpy()
        data["state_attribution"] = (("state_layer", "state_head", "token"),
                                     normalise(base_value + s_est, exp.clean_metric, exp.corrupted_metric),
                                     {"description": "estimated normalised metric of each full state patch"})
        coords.update(state_layer=state_layers, state_head=list(range(hv)), token=list(range(T)))
    return xr.Dataset(data, coords=coords, attrs={**exp.attrs(), "experiment": "attribution patching",
                                                  "all_index": -1, "base_metric": base_value})
