"""Direct logit attribution: a logit (or a logit difference) split over everything that wrote into the residual
stream, down to heads, and for delta-rule heads down to the source tokens they read.

The final residual is the embeddings plus every sublayer's write (probes.stream). With the final norm's scale
frozen at the run's own value (TransformerLens's convention) the logit of token v at position t is linear in
that residual: logit = sum over writers of (write . u_t) + constant, u_t the unembedding row of v pulled back
through the frozen norm, the constant the norm's and unembedding's biases. `remainder` = the model's logit minus
that sum: rounding (checked by the tests to 1e-5 relative in float32).

A mixer's write is out_proj(z) = sum over heads h of W_o[:, h] z_h (+ bias): per-head terms are exact. Where
the write passes a norm shared by all heads (OLMo-Hybrid's post-norms) its scale is frozen too, and
`check_heads=True` reports each head's linearisation error: the head's attribution minus the real change of the
layer's write when the head is zeroed (its recurrence output hook_o for delta-rule heads, so RWKV-7's bonus and
GroupNorm bias, which zeroing the read-out leaves, show there), read through the same frozen final norm.

`source_attribution` splits one delta-rule layer's head contributions at one position over source (token,
sub-step) pairs through the exact attention map (kernels.attention): with the head's output norm and gate frozen
at the run's values, z_h is linear in the recurrence output o_h = sum_u alpha_{t,u} v_u (+ initial-state term),
so contribution_h = sum_u alpha_{t,u} (v_u . e_h) + constant (RWKV-7: the bonus and GroupNorm bias), exactly.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np
import xarray as xr

from deltalab.probes.base import ProbeError, ProbeResult, exit_main

NAME = "attribution"
NEEDS_CHECKPOINT = True
WRITES = False
SUMMARY_KEYS = ["component", "layer", "head", "kind", "mean", "mean_abs", "linearisation_error_max"]


class _Stop(Exception):  # noqa: N818 - control flow, not an error: ends a forward once the write is seen
    pass


def _targets(ids: Any, target: Any, readout: Any) -> Any:
    import torch

    from deltalab.probes.lens import next_token_targets

    if target is None:
        return next_token_targets(ids).to(ids.device)
    if isinstance(target, int):
        readout.check_tokens([target], "--target")
        return torch.full_like(ids, target)
    tgt = torch.as_tensor(target).to(ids.device)
    readout.check_tokens(tgt[tgt >= 0], "target")
    return tgt


def _head_split(sub: Any, run: Any, u: Any) -> tuple[Any, Any]:
    """(per-head contributions [B, T, H], read direction at the out_proj output [B, T, D]) of a mixer."""
    import torch

    from deltalab.probes.stream import FrozenNorm

    u_out = FrozenNorm(sub.post_norm, run.output).pull_back(u) if sub.post_norm is not None else u
    W = sub.out_proj.weight.double()  # [D, H * d]
    H = sub.num_heads
    a = torch.einsum("btd,de->bte", u_out, W.to(u_out.device)).view(*u_out.shape[:2], H, -1)  # [B, T, H, d]
    z = run.z.double().view(*run.z.shape[:2], H, -1)
    return (a * z).sum(-1), u_out



def _ablated_write(model: Any, ids: Any, sub: Any, head: int) -> Any:
    """The sublayer's write [B, T, D] in a forward with head `head` zeroed (delta-rule heads at hook_o, others in
    out_proj's input); the forward stops there."""
    got: dict[str, Any] = {}
    handles = []
    if sub.hooks is not None and hasattr(sub.hooks, "hook_o"):
        def zero_o(_m, _a, out):
            out = out.clone()
            out[:, :, head] = 0
            return out
        handles.append(sub.hooks.hook_o.register_forward_hook(zero_o))
    else:
        def zero_z(_m, args):
            z = args[0].clone()
            d = z.shape[-1] // sub.num_heads
            z[..., head * d:(head + 1) * d] = 0
            return (z, *args[1:])
        handles.append(sub.out_proj.register_forward_pre_hook(zero_z))

    def stop(_m, _a, out):
        got["write"] = out[0] if isinstance(out, tuple | list) else out
        raise _Stop

    handles.append((sub.post_norm or sub.module).register_forward_hook(stop))
    try:
        model(ids)
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()
    return got["write"]


def direct_logit_attribution(model: Any, input_ids: Any, *, target: int | Any | None = None,
                             minus: int | Any | None = None, check_heads: bool = False) -> xr.Dataset:
    """Direct logit attribution of input_ids [B, T] (int64): dims (seq, pos, component) and (seq, pos, unit).

    target: None (each position's next token; the last position has none: NaN), one id, or ids [B, T];
    minus: a token (or ids [B, T]) whose logit is subtracted (a logit difference). Components: `embed` and every
    sublayer `L{i}.{mixer|mlp}` (coords component_layer, component_kind); units: every (layer, head) of every
    mixer (unit_layer, unit_head, unit_kind). `constant` holds the biases; contributions + constant + remainder
    = logit. check_heads adds `linearisation_error` per unit (one partial forward per head).
    """
    import torch

    from deltalab.probes.stream import FrozenNorm, ReadOut, capture_stream

    ids = torch.as_tensor(input_ids)
    ids = (ids[None] if ids.dim() == 1 else ids).to(next(model.parameters()).device)
    with torch.no_grad():
        stream = capture_stream(model, ids)
        readout = ReadOut(stream.layout)
        tgt = _targets(ids, target, readout)
        mns = None if minus is None else _targets(ids, minus, readout)
        has = (tgt >= 0) if mns is None else (tgt >= 0) & (mns >= 0)
        frozen = FrozenNorm(stream.layout.final_norm, stream.final)
        d, c0 = readout.directions(tgt, mns)
        u = frozen.pull_back(d)  # [B, T, D]
        constant = (d * frozen.bias).sum(-1) + c0
        logits = stream.logits.double()
        logit = logits.gather(-1, tgt.clamp(min=0)[..., None])[..., 0]
        if mns is not None:
            logit = logit - logits.gather(-1, mns.clamp(min=0)[..., None])[..., 0]
        names, c_layer, c_kind, contrib = ["embed"], [-1], ["embed"], [(stream.resid_pre[0].double() * u).sum(-1)]
        u_layer, u_head, u_kind, heads, lin = [], [], [], [], []
        for sub, run in zip(stream.layout.sublayers, stream.runs):
            names.append(f"L{sub.layer}.{sub.name}")
            c_layer.append(sub.layer)
            c_kind.append(sub.kind)
            contrib.append((run.write.double() * u).sum(-1))
            if sub.out_proj is None or run.z is None:
                continue
            per_head, _ = _head_split(sub, run, u)
            for h in range(sub.num_heads):
                u_layer.append(sub.layer)
                u_head.append(h)
                u_kind.append(sub.kind)
                heads.append(per_head[..., h])
                if check_heads:
                    real = ((run.write.double() - _ablated_write(model, ids, sub, h).double()) * u).sum(-1)
                    lin.append(per_head[..., h] - real)
    nan = torch.tensor(float("nan"), dtype=torch.float64)

    def arr(x: Any) -> np.ndarray:
        return torch.where(has[..., None] if x.dim() == 3 else has, x.cpu(), nan).numpy()

    C = torch.stack(contrib, -1).cpu()
    total = C.sum(-1) + constant.cpu()
    ds = xr.Dataset(
        {"logit": (("seq", "pos"), arr(logit.cpu())),
         "contribution": (("seq", "pos", "component"), arr(C)),
         "constant": (("seq", "pos"), arr(constant.cpu())),
         "remainder": (("seq", "pos"), arr(logit.cpu() - total)),
         "target": (("seq", "pos"), tgt.cpu().numpy().astype(np.int32)),
         "tokens": (("seq", "pos"), ids.cpu().numpy().astype(np.int32))},
        coords={"pos": np.arange(ids.shape[1]), "component": names,
                "component_layer": ("component", np.asarray(c_layer)), "component_kind": ("component", c_kind)})
    if mns is not None:
        ds["minus"] = (("seq", "pos"), mns.cpu().numpy().astype(np.int32))
    if heads:
        ds = ds.assign_coords(unit=np.arange(len(heads)), unit_layer=("unit", np.asarray(u_layer)),
                              unit_head=("unit", np.asarray(u_head)), unit_kind=("unit", u_kind))
        ds["head_contribution"] = (("seq", "pos", "unit"), arr(torch.stack(heads, -1).cpu()))
        if check_heads:
            ds["linearisation_error"] = (("seq", "pos", "unit"), arr(torch.stack(lin, -1).cpu()))
    ds["contribution"].attrs["description"] = "write . u: the writer's share of the logit, final norm scale frozen"
    ds["remainder"].attrs["description"] = "logit - contributions - constant (rounding)"
    return ds


def _attention_map(sub: Any, delta: dict[str, Any], b: int, t: int) -> tuple[Any, Any]:
    """(alpha [H, t + 1, n_h], values [t + 1, n_h, H, dv]) of sequence b's query t, float64 (exact map)."""
    from deltalab.kernels.attention.chunk import delta_attention
    from deltalab.kernels.attention.dplr_chunk import dplr_attention

    def x(name: str) -> Any:
        return None if name not in delta else delta[name][b:b + 1, : t + 1].double()

    if sub.rwkv:
        kap = x("kappa")
        m = dplr_attention(x("q"), x("k"), x("v"), -kap, kap * x("beta"), x("g"), scale=1.0, window=(t, t + 1))
        return m.weights[0, 0], x("v")[0][:, None]
    if sub.hooks is not None and hasattr(sub.hooks, "head_k_dim"):
        scale = sub.hooks.head_k_dim ** -0.5
    else:
        scale = None
    m = delta_attention(x("q"), x("k"), x("v"), x("beta"), x("g"), scale=scale, window=(t, t + 1))
    return m.weights[0, 0], x("v")[0]


def _value_map(sub: Any, run: Any, seq: int, position: int) -> Any:
    """coef [H, dv]: the head's output path from its recurrence output o to out_proj's input z, frozen at the run's
    values at (seq, position): z = coef * o (Gated DeltaNet / KDA / DeltaProduct: the RMSNorm scale, weight and
    output gate, read as z / o per channel), or RWKV-7's z = coef * (o - mean o) + bonus + bias (coef = gate *
    GroupNorm weight / sigma)."""
    import torch

    H = sub.num_heads
    z = run.z[seq, position].double().view(H, -1)
    o = run.delta["o"][seq, position].double()  # [H, dv]
    if sub.rwkv:
        gn = sub.module.g_norm
        gate = run.gate[seq, position].double().view(H, -1)
        sigma = (o.var(-1, unbiased=False, keepdim=True) + gn.eps).sqrt()
        return gate * gn.weight.double().view(H, -1) / sigma
    return torch.where(o != 0, z / torch.where(o != 0, o, torch.ones_like(o)), torch.zeros_like(o))


def _delta_sublayer(stream: Any, layer: int) -> tuple[Any, Any]:
    subs = [(s, r) for s, r in zip(stream.layout.sublayers, stream.runs) if s.layer == layer and s.name == "mixer"]
    if not subs or subs[0][0].kind != "delta_rule":
        have = sorted({s.layer for s in stream.layout.sublayers if s.kind == "delta_rule"})
        raise ProbeError(f"layer {layer} has no delta-rule mixer: pick one of {have}")
    return subs[0]


def value_readout(model: Any, input_ids: Any, layer: int, source: int, *, position: int | None = None,
                  seq: int = 0, top_k: int = 10) -> xr.Dataset:
    """The write side: what token `source`'s value v_{s,j}, written into each head's state of delta-rule layer
    `layer`, says about the vocabulary when read back with unit weight at `position` (default: the source itself),
    through the head's output path and the final norm frozen there: dims (head, step, vocab) and (head, step, rank).

    `logits[head, step, vocab]`; `top_token` / `top_logit` the tokens it promotes most, `bottom_*` those it
    suppresses most. A source's contribution to a logit at `position` (source_attribution) is its attention weight
    times this read-out of the target.
    """
    import torch

    from deltalab.probes.stream import FrozenNorm, capture_stream

    ids = torch.as_tensor(input_ids)
    ids = (ids[None] if ids.dim() == 1 else ids).to(next(model.parameters()).device)
    B, T = ids.shape
    position = source if position is None else position
    if not 0 <= seq < B:
        raise ProbeError(f"--seq {seq}: pick a sequence in 0..{B - 1}")
    if not 0 <= source <= position < T:
        raise ProbeError(f"source {source} and position {position}: pick 0 <= source <= position < {T}")
    with torch.no_grad():
        stream = capture_stream(model, ids, delta_inputs=True)
        sub, run = _delta_sublayer(stream, layer)
        H = sub.num_heads
        coef = _value_map(sub, run, seq, position)  # [H, dv]
        v = run.delta["v"][seq, source].double()
        v = v[None] if sub.rwkv else v  # [n_h, H, dv]
        if sub.rwkv:
            v = v - v.mean(-1, keepdim=True)
        x = v * coef  # out_proj input of each head, [n_h, H, dv]
        W = sub.out_proj.weight.double().view(-1, H, coef.shape[-1])  # [D, H, dv]
        r = torch.einsum("dhv,jhv->jhd", W.to(x.device), x)  # [n_h, H, D]
        if sub.post_norm is not None:
            r = FrozenNorm(sub.post_norm, run.output[seq, position]).apply(r)
        frozen = FrozenNorm(stream.layout.final_norm, stream.final[seq, position])
        logits = torch.einsum("jhd,vd->hjv", frozen.apply(r), stream.layout.unembed.weight.double().to(r.device))
        k = min(top_k, logits.shape[-1])
        top, bottom = logits.topk(k, dim=-1), (-logits).topk(k, dim=-1)
    return xr.Dataset(
        {"logits": (("head", "step", "vocab"), logits.float().cpu().numpy()),
         "top_token": (("head", "step", "rank"), top.indices.cpu().numpy().astype(np.int32)),
         "top_logit": (("head", "step", "rank"), top.values.float().cpu().numpy()),
         "bottom_token": (("head", "step", "rank"), bottom.indices.cpu().numpy().astype(np.int32)),
         "bottom_logit": (("head", "step", "rank"), (-bottom.values).float().cpu().numpy())},
        coords={"head": np.arange(H), "step": np.arange(logits.shape[1]), "rank": np.arange(k)},
        attrs={"layer": layer, "source": source, "position": position, "seq": seq,
               "token": int(ids[seq, source])})


def source_attribution(model: Any, input_ids: Any, layer: int, position: int, *, target: int | None = None,
                       minus: int | None = None, seq: int = 0) -> xr.Dataset:
    """Each head of delta-rule layer `layer`: its direct contribution to the logit at `position` of sequence
    `seq`, split over source (token, sub-step) pairs: dims (head, source, step).

    `contribution[head, source, step]` = alpha_{t,(s,j)} (v_{s,j} . e_h); `constant[head]` what does not pass the
    state (RWKV-7: the bonus and GroupNorm bias); `head_contribution[head]` the head's direct logit attribution
    (direct_logit_attribution's); `error[head]` = sum over sources + constant - head_contribution (rounding).
    """
    import torch

    from deltalab.probes.stream import FrozenNorm, ReadOut, capture_stream

    ids = torch.as_tensor(input_ids)
    ids = (ids[None] if ids.dim() == 1 else ids).to(next(model.parameters()).device)
    B, T = ids.shape
    if not 0 <= seq < B:
        raise ProbeError(f"--seq {seq}: pick a sequence in 0..{B - 1}")
    if not 0 <= position < T:
        raise ProbeError(f"--position {position}: pick a position in 0..{T - 1}")
    with torch.no_grad():
        stream = capture_stream(model, ids, delta_inputs=True)
        sub, run = _delta_sublayer(stream, layer)
        readout = ReadOut(stream.layout)
        tgt = _targets(ids, target, readout)[seq, position]
        if int(tgt) < 0:
            raise ProbeError(f"position {position} is the last: it has no next token; pass --target ID")
        mns = None if minus is None else _targets(ids, minus, readout)[seq, position]
        frozen = FrozenNorm(stream.layout.final_norm, stream.final[seq:seq + 1, position:position + 1])
        d, _ = readout.directions(tgt[None, None], None if mns is None else mns[None, None])
        u = frozen.pull_back(d)  # [1, 1, D]
        r1 = type(run)(run.output[seq:seq + 1, position:position + 1], run.write[seq:seq + 1, position:position + 1],
                       run.z[seq:seq + 1, position:position + 1])
        per_head, u_out = _head_split(sub, r1, u)
        H = sub.num_heads
        W = sub.out_proj.weight.double().to(u_out.device)
        a = (u_out[0, 0] @ W).view(H, -1)  # [H, dv]: the read direction at each head's out_proj input
        z = run.z[seq, position].double().view(H, -1)
        o = run.delta["o"][seq, position].double()  # [H, dv]
        coef = _value_map(sub, run, seq, position)
        e = a * coef
        if sub.rwkv:
            e = e - e.mean(-1, keepdim=True)
        constant = (a * z).sum(-1) - (e * o).sum(-1)
        alpha, v = _attention_map(sub, run.delta, seq, position)  # [H, t+1, n_h], [t+1, n_h, H, dv]
        contrib = alpha * torch.einsum("sjhv,hv->hsj", v, e.to(v.device))
        err = contrib.sum((1, 2)) + constant - per_head[0, 0]
    return xr.Dataset(
        {"contribution": (("head", "source", "step"), contrib.cpu().numpy()),
         "weight": (("head", "source", "step"), alpha.cpu().numpy()),
         "constant": (("head",), constant.cpu().numpy()),
         "head_contribution": (("head",), per_head[0, 0].cpu().numpy()),
         "error": (("head",), err.cpu().numpy())},
        coords={"head": np.arange(H), "source": np.arange(position + 1), "step": np.arange(alpha.shape[-1])},
        attrs={"layer": layer, "position": position, "seq": seq, "target": int(tgt),
               "minus": -1 if mns is None else int(mns), "token": int(ids[seq, position])})


# --- records and the probe --------------------------------------------------------------------


def records(ds: xr.Dataset, position: int | None = None) -> list[dict[str, Any]]:
    """One record per component and per head: mean contribution (and |.|) over the positions with a target."""
    sel = ds if position is None else ds.isel(pos=[position])
    out = []
    for i, name in enumerate(sel["component"].values):
        x = sel["contribution"].values[..., i]
        out.append({"component": str(name), "layer": int(sel["component_layer"].values[i]), "head": None,
                    "kind": str(sel["component_kind"].values[i]), "mean": float(np.nanmean(x)),
                    "mean_abs": float(np.nanmean(np.abs(x)))})
    if "head_contribution" in sel:
        for i in range(sel.sizes["unit"]):
            x = sel["head_contribution"].values[..., i]
            layer, head = int(sel["unit_layer"].values[i]), int(sel["unit_head"].values[i])
            rec = {"component": f"L{layer}.H{head}", "layer": layer, "head": head,
                   "kind": str(sel["unit_kind"].values[i]), "mean": float(np.nanmean(x)),
                   "mean_abs": float(np.nanmean(np.abs(x)))}
            if "linearisation_error" in sel:
                rec["linearisation_error_max"] = float(np.nanmax(np.abs(sel["linearisation_error"].values[..., i])))
            out.append(rec)
    out.append({"component": "remainder", "layer": None, "head": None, "kind": "rounding",
                "mean": float(np.nanmean(sel["remainder"].values)),
                "mean_abs": float(np.nanmean(np.abs(sel["remainder"].values)))})
    return out


def source_records(src: xr.Dataset, top: int = 8) -> list[dict[str, Any]]:
    """Per head, its `top` sources by |contribution|."""
    out = []
    for h in range(src.sizes["head"]):
        c = src["contribution"].values[h]
        order = np.argsort(-np.abs(c), axis=None)[:top]
        for rank, flat in enumerate(order):
            s, j = np.unravel_index(flat, c.shape)
            out.append({"head": h, "rank": rank, "source": int(s), "step": int(j), "contribution": float(c[s, j]),
                        "weight": float(src["weight"].values[h, s, j]),
                        "head_contribution": float(src["head_contribution"].values[h])})
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    from deltalab.probes.lens import TYPED_EPILOG

    p.epilog = TYPED_EPILOG.format(name=NAME)
    p.add_argument("--target", type=int, default=None, help="token id whose logit is split (default: next token)")
    p.add_argument("--minus", type=int, default=None, help="token id whose logit is subtracted (a logit difference)")
    p.add_argument("--position", type=int, default=None, help="one position (default: every one with a target)")
    p.add_argument("--seq", type=int, default=0, help="stored sequence to read (default 0)")
    p.add_argument("--sources", type=int, default=None, metavar="LAYER",
                   help="split that delta-rule layer's heads over source tokens at --position")
    p.add_argument("--values", type=int, default=None, metavar="LAYER",
                   help="the write side: what --source's value in each head of that delta-rule layer says about the "
                        "vocabulary (read at --position, default the source)")
    p.add_argument("--source", type=int, default=None, help="the source token of --values")
    p.add_argument("--check-heads", action="store_true",
                   help="zero each head for real and report the linearisation error (one forward per head)")


def value_records(val: xr.Dataset, spell: Any = str) -> list[dict[str, Any]]:
    """Per head and step, the tokens the source's value promotes and suppresses most."""
    out = []
    for h in range(val.sizes["head"]):
        for j in range(val.sizes["step"]):
            out.append({"head": h, "step": j,
                        "promotes": " ".join(spell(int(x)) for x in val["top_token"].values[h, j]),
                        "top_logit": float(val["top_logit"].values[h, j, 0]),
                        "suppresses": " ".join(spell(int(x)) for x in val["bottom_token"].values[h, j]),
                        "bottom_logit": float(val["bottom_logit"].values[h, j, 0])})
    return out


def _run(model: Any, ids: Any, args: argparse.Namespace) -> ProbeResult:
    if args.values is not None:
        if args.source is None:
            raise ProbeError("--values LAYER needs --source S (the token whose value is read)")
        val = value_readout(model, ids, args.values, args.source, position=args.position)
        return ProbeResult(NAME, val, value_records(val),
                           ["head", "step", "promotes", "top_logit", "suppresses", "bottom_logit"])
    if args.sources is not None:
        if args.position is None:
            raise ProbeError("--sources LAYER needs --position T (the prediction to split)")
        src = source_attribution(model, ids, args.sources, args.position, target=args.target, minus=args.minus)
        return ProbeResult(NAME, src, source_records(src),
                           ["head", "rank", "source", "step", "contribution", "weight", "head_contribution"])
    if args.position is not None and not 0 <= args.position < ids.shape[-1]:
        raise ProbeError(f"--position {args.position}: pick a position in 0..{ids.shape[-1] - 1}")
    ds = direct_logit_attribution(model, ids, target=args.target, minus=args.minus, check_heads=args.check_heads)
    return ProbeResult(NAME, ds, records(ds, args.position), SUMMARY_KEYS)


def from_args(ds: xr.Dataset, args: argparse.Namespace, sink: Any) -> ProbeResult:
    import torch

    from deltalab.probes import data
    from deltalab.probes.lens import load_model

    if "tokens" not in ds:
        data.require(ds, ["tokens"], NAME)
    if not 0 <= args.seq < ds.sizes["seq"]:
        raise ProbeError(f"--seq {args.seq}: the store has sequences 0..{ds.sizes['seq'] - 1}")
    model = load_model(args.checkpoint, data.pick_device(args.device))
    ids = torch.as_tensor(np.asarray(ds["tokens"].isel(seq=[args.seq]).values, np.int64))
    return _run(model, ids, args)


def typed_main(argv: list[str]) -> int:
    """`deltalab probe attribution --checkpoint C --text TEXT|--tokens IDS [--target ID] [--sources L --position T]`."""
    import torch

    from deltalab.probes import data
    from deltalab.probes.base import print_summary
    from deltalab.probes.lens import load_model, typed_parser
    from deltalab.probes.stream import layout_of
    from deltalab.probes.typed import encode

    p = typed_parser(NAME, (__doc__ or NAME).strip().splitlines()[0])
    add_arguments(p)
    try:
        args = p.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    try:
        model = load_model(args.checkpoint, data.pick_device(args.device))
        ids = encode(args.checkpoint, args.text, args.tokens, layout_of(model).vocab_size)
        result = _run(model, torch.tensor([ids]), args)
    except (ValueError, KeyError, OSError, RuntimeError) as err:
        print(f"error: {str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}",
              file=sys.stderr)
        return 2
    print(result.to_json()) if args.json else print_summary(result, written=None, max_rows=200)
    return 0


def main(argv: list[str] | None = None) -> None:
    """`python -m deltalab.probes.attribution --store S --checkpoint C [--position T] [--json]`, or typed input."""
    from deltalab.probes.typed import wants_typed

    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_typed(argv):
        sys.exit(typed_main(argv))
    exit_main(NAME, argv)


if __name__ == "__main__":
    main()
