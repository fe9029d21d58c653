"""Interventions through nnsight on the store's sequences: change in token accuracy and loss.

- `--set-beta L:H:S=VALUE`: overwrite one Householder step's beta (`hook_beta.output[..., S, H]`);
  VALUE 0 removes the step; H or S may be `*` for all;
- `--ablate-head L:H`: zero the head's recurrence output (`hook_o.output[:, :, H]`);
- `--project-keys L:H[:S]=K`: replace the keys by their projection on the top-K principal components
  (the `keys` probe's results in the store when present, else fitted now), renormalised to unit length.
- state surgery (`probes.surgery`, applied at `hook_o` from the token on): `--erase L:H@T[:S]` erases the
  association stored along token T's step-S key from H_T (H <- (I - k k^T) H); `--write L:H@T=SRC[:S]` writes
  token SRC's step-S key/value pair into H_T (H <- H + k v^T); `--scale-decay L:H[:C]@T=F` multiplies the
  head's forget factor (or dk channel C's) by F from token T on (F = 0: forget everything).
Every edit reports the change of accuracy and loss and the KL divergence of the next-token distribution
from the baseline's (mean over labelled positions, and per position).
Without any of these, a sweep runs: every step's beta set to 0, every head ablated, and every head's
keys projected on 3 components, one at a time. The baseline is the unmodified model on the same tokens.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xarray as xr

from deltalab.models import IGNORE_INDEX
from deltalab.probes import data
from deltalab.probes.base import ProbeError, ProbeResult, exit_main

NAME = "intervene"
NEEDS_CHECKPOINT = True
KINDS = {"baseline": 0, "set_beta": 1, "ablate_head": 2, "project_keys": 3, "erase": 4, "write": 5,
         "scale_decay": 6}
SURGERY = ("erase", "write", "scale_decay")
SUMMARY_KEYS = ["intervention", "layer", "head", "step", "position", "value", "accuracy", "delta_accuracy", "loss",
                "delta_loss", "kl"]
_HOOK_ORDER = ("hook_q", "hook_k", "hook_v", "hook_beta", "hook_g", "hook_o")


@dataclass(frozen=True)
class Edit:
    """One intervention: kind, layer (model index), head/step (None = all), value (beta or k components)."""

    kind: str
    layer: int
    head: int | None = None
    step: int | None = None
    value: float | None = None
    position: int | None = None  # state surgery: the token whose state is edited
    source: int | None = None  # write: the token whose key/value pair is written
    channel: int | None = None  # scale_decay: one dk channel

    @property
    def label(self) -> str:
        def f(x: int | None) -> str:
            return "*" if x is None else str(x)
        if self.kind == "erase":
            return f"erase {self.layer}:{self.head}@{self.position}:{f(self.step)}"
        if self.kind == "write":
            return f"write {self.layer}:{self.head}@{self.position}={self.source}:{f(self.step)}"
        if self.kind == "scale_decay":
            return f"scale_decay {self.layer}:{self.head}:{f(self.channel)}@{self.position}={self.value:g}"
        if self.kind == "ablate_head":
            return f"ablate_head {self.layer}:{f(self.head)}"
        return f"{self.kind} {self.layer}:{f(self.head)}:{f(self.step)}={self.value:g}"


_SPEC = re.compile(r"^\s*(\d+):(\d+|\*)(?::(\d+|\*))?\s*(?:=\s*([-+0-9.eE]+))?\s*$")


def parse_edit(kind: str, text: str) -> Edit:
    """'0:6:1=2.0' -> Edit; one-line ProbeError on a malformed spec."""
    m = _SPEC.match(text)
    need_value = kind != "ablate_head"
    if not m or (need_value and m.group(4) is None) or (not need_value and (m.group(3) or m.group(4))):
        form = {"set_beta": "LAYER:HEAD:STEP=VALUE", "ablate_head": "LAYER:HEAD",
                "project_keys": "LAYER:HEAD[:STEP]=K"}[kind]
        raise ProbeError(f"cannot read --{kind.replace('_', '-')} {text!r}: write {form} (HEAD/STEP may be *)")
    if kind == "set_beta" and m.group(3) is None:
        raise ProbeError(f"--set-beta {text!r} needs a step: LAYER:HEAD:STEP=VALUE (STEP may be *)")

    def idx(s: str | None) -> int | None:
        return None if s in (None, "*") else int(s)
    value = float(m.group(4)) if m.group(4) is not None else None
    if kind == "project_keys" and (value is None or value < 0 or value != int(value)):
        raise ProbeError(f"--project-keys {text!r}: K must be a whole number of components")
    return Edit(kind, int(m.group(1)), idx(m.group(2)), idx(m.group(3)), value)


_SURGERY_SPEC = {
    "erase": (re.compile(r"^\s*(\d+):(\d+)@(\d+)(?::(\d+))?\s*$"), "LAYER:HEAD@TOKEN[:STEP]"),
    "write": (re.compile(r"^\s*(\d+):(\d+)@(\d+)\s*=\s*(\d+)(?::(\d+))?\s*$"), "LAYER:HEAD@TOKEN=SOURCE[:STEP]"),
    "scale_decay": (re.compile(r"^\s*(\d+):(\d+)(?::(\d+))?@(\d+)\s*=\s*([-+0-9.eE]+)\s*$"),
                    "LAYER:HEAD[:CHANNEL]@TOKEN=FACTOR"),
}


def parse_surgery(kind: str, text: str) -> Edit:
    """'0:1@12:0' (erase), '0:1@12=5:0' (write), '0:1:3@12=0.5' (scale_decay) -> Edit; one-line ProbeError."""
    pattern, form = _SURGERY_SPEC[kind]
    m = pattern.match(text)
    if not m:
        raise ProbeError(f"cannot read --{kind.replace('_', '-')} {text!r}: write {form}")

    def opt(x: str | None) -> int | None:
        return None if x is None else int(x)
    if kind == "erase":
        return Edit(kind, int(m.group(1)), int(m.group(2)), opt(m.group(4)), position=int(m.group(3)))
    if kind == "write":
        return Edit(kind, int(m.group(1)), int(m.group(2)), opt(m.group(5)), position=int(m.group(3)),
                    source=int(m.group(4)))
    factor = float(m.group(5))
    if factor < 0:
        raise ProbeError(f"--scale-decay {text!r}: FACTOR must be >= 0")
    return Edit(kind, int(m.group(1)), int(m.group(2)), None, factor, position=int(m.group(4)),
                channel=opt(m.group(3)))


def state_edit(e: Edit):
    """The `probes.surgery.StateEdit` of a surgery Edit."""
    from deltalab.probes.surgery import StateEdit

    return StateEdit(e.kind, e.head, e.position, step=e.step, source=e.source, channel=e.channel,
                     factor=e.value if e.value is not None else 0.0)


def sweep(ds: xr.Dataset, n_components: int = 3) -> list[Edit]:
    """Default interventions: each step's beta -> 0, each head ablated, each head's keys on n_components PCs."""
    edits = []
    for layer in data.layer_values(ds):
        for h in _model_heads(ds):  # the model's head numbers (a store captured with --heads has some)
            edits += [Edit("set_beta", int(layer), h, s, 0.0) for s in range(ds.sizes["step"])]
            edits.append(Edit("ablate_head", int(layer), h))
            edits.append(Edit("project_keys", int(layer), h, None, float(n_components)))
    return edits


def _model_heads(ds: xr.Dataset) -> list[int]:
    """The model's number of each head the store holds (`heads` attr of a `capture --heads` store; else all)."""
    heads = ds.attrs.get("heads")
    return [int(h) for h in heads] if heads is not None else list(range(ds.sizes["head"]))


def _key_bases(ds: xr.Dataset, store_path: str | None, edits: list[Edit], budget: int) -> dict[tuple, tuple]:
    """(layer, head, step|None) -> (mean [dk], components [K, dk]) for the projection edits."""
    wanted = [e for e in edits if e.kind == "project_keys"]
    if not wanted:
        return {}
    pca = None
    if store_path is not None:
        from deltalab.probes import results

        try:
            pca = results.read_results(store_path, "keys")
        except ProbeError:
            pca = None
    layers = sorted({e.layer for e in wanted})
    if pca is None or not set(layers) <= {int(x) for x in pca["layer"].values}:
        from deltalab.probes import keys

        pca = keys.run(data.select(ds, layers=layers), budget=budget).dataset
    out = {}
    model_heads = _model_heads(ds)
    for e in wanted:
        sel = pca.sel(layer=e.layer)
        heads = model_heads if e.head is None else [e.head]
        for h in heads:
            if h not in model_heads:
                raise ProbeError(f"{e.label}: the store holds heads {','.join(map(str, model_heads))} (captured with "
                                 f"--heads), so head {h} has no keys to project on; pick one of those")
            i = model_heads.index(h)  # its position in the store and in the keys results
            k = int(e.value or 0)
            if e.step is None:
                out[(e.layer, h, None)] = (sel["mean_joint"].values[i], sel["components_joint"].values[i, :k])
            else:
                out[(e.layer, h, e.step)] = (sel["mean"].values[e.step, i], sel["components"].values[e.step, i, :k])
    return out


def _apply(nn_model: Any, edits: list[Edit], bases: dict[tuple, tuple], gated: bool = False,
           key_head_of: Sequence[int] | None = None, stepless: bool = False) -> None:
    """Inside an nnsight trace: apply the edits in execution order (layer, then q -> k -> v -> beta -> g -> o),
    reading each hook point at most once; state surgery reads q..g and rewrites o (`probes.surgery`).

    Grouped heads (`key_head_of`, value head -> key head): hook_q/hook_k hold key heads, so projecting the keys
    of value head h projects its key head (which every value head of the group reads), and state surgery
    gives each value head its key head's q and k. RWKV-7 (`stepless`): hook_beta [B,T,H,dk] and hook_k [B,T,H,dk]
    have no step axis; a set beta fills every key channel, and projected keys keep their length (RWKV-7's written
    key is not normalised)."""
    import torch

    hook_of = {"set_beta": "hook_beta", "ablate_head": "hook_o", "project_keys": "hook_k"}
    for layer in sorted({e.layer for e in edits}):
        group = [e for e in edits if e.layer == layer]
        surgery = [e for e in group if e.kind in SURGERY]
        need = {hook_of[e.kind] for e in group if e.kind not in SURGERY}
        if surgery:
            need |= {"hook_q", "hook_k", "hook_v", "hook_beta", "hook_o"} | ({"hook_g"} if gated else set())
        attn = nn_model.layers[layer].attn
        seen: dict[str, Any] = {}
        for hook in _HOOK_ORDER:
            if hook not in need:
                continue
            out = seen[hook] = getattr(attn, hook).output
            for e in (e for e in group if e.kind not in SURGERY and hook_of[e.kind] == hook):
                h = slice(None) if e.head is None else e.head
                s = slice(None) if e.step is None else e.step
                if e.kind == "set_beta" and stepless:
                    out[:, :, h] = e.value
                elif e.kind == "set_beta":
                    out[..., s, h] = e.value
                elif e.kind == "ablate_head":
                    out[:, :, h] = 0
                else:
                    if key_head_of is None:
                        pairs = [(hh, hh) for hh in (range(out.shape[3]) if e.head is None else [e.head])]
                    else:  # (key head in hook_k, a value head reading it: the stored keys' basis)
                        khs = range(out.shape[3]) if e.head is None else [key_head_of[e.head]]
                        pairs = [(kh, list(key_head_of).index(kh)) for kh in khs]
                    for hh, vh in pairs:
                        mean, comps = bases[(layer, vh, e.step)]
                        mean_t = torch.as_tensor(mean, dtype=out.dtype, device=out.device)
                        comps_t = torch.as_tensor(comps, dtype=out.dtype, device=out.device)
                        keys = out[:, :, hh] if stepless else out[:, :, s, hh]
                        proj = mean_t + ((keys - mean_t) @ comps_t.T) @ comps_t
                        if stepless:
                            out[:, :, hh] = proj
                            continue
                        proj = proj / proj.norm(dim=-1, keepdim=True).clamp_min(1e-6)
                        out[:, :, s, hh] = proj
            if hook == "hook_o" and surgery:
                from deltalab.probes.surgery import edited_output

                new = out
                q, k = seen["hook_q"], seen["hook_k"]
                if key_head_of is not None:
                    q, k = q[:, :, list(key_head_of)], k[:, :, :, list(key_head_of)]
                for e in surgery:
                    new = edited_output(q, k, seen["hook_v"], seen["hook_beta"], seen.get("hook_g"), new,
                                        state_edit(e))
                out[:] = new


def evaluate(model: Any, tokens: np.ndarray, labels: np.ndarray, edits: list[Edit], bases: dict[tuple, tuple], *,
             batch_size: int = 16, device: str = "cpu", nn_model: Any = None,
             kl: dict[str, np.ndarray] | None = None) -> tuple[float, float, np.ndarray, np.ndarray]:
    """(accuracy, loss, correct-by-position counts, labelled-by-position counts) with `edits` applied.

    nn_model: the nnsight wrapper of `model` (made here when not given). kl: a dict that receives "sum_by_pos"
    (summed over sequences) of KL(baseline || edited) of the next-token distribution at labelled positions."""
    import torch
    import torch.nn.functional as F

    if edits and nn_model is None:
        from nnsight import NNsight

        nn_model = NNsight(model)
    T = tokens.shape[1]
    right, count, loss_sum = np.zeros(T), np.zeros(T), 0.0
    cfg = getattr(model, "config", None)
    gated = bool(getattr(cfg, "use_forget_gate", False))
    key_head_of = list(cfg.key_head_of) if getattr(cfg, "grouped", False) else None
    stepless = getattr(cfg, "model_type", None) == "rwkv7"
    if kl is not None:
        kl["sum_by_pos"] = np.zeros(T)
    with torch.no_grad():
        for lo in range(0, len(tokens), batch_size):
            ids = torch.as_tensor(tokens[lo:lo + batch_size], dtype=torch.long, device=device)
            lab = torch.as_tensor(labels[lo:lo + batch_size], dtype=torch.long, device=device)
            if edits:
                with nn_model.trace(ids):
                    _apply(nn_model, edits, bases, gated, key_head_of, stepless)
                    logits_proxy = nn_model.output.logits.save()
                logits = logits_proxy
            else:
                logits = model(ids).logits
            logits = logits.float()
            valid = lab != IGNORE_INDEX
            if kl is not None:
                ref = F.log_softmax(model(ids).logits.float(), -1)
                div = (ref.exp() * (ref - F.log_softmax(logits, -1))).sum(-1) * valid
                kl["sum_by_pos"] += div.sum(0).cpu().numpy()
            loss = F.cross_entropy(logits.flatten(0, 1), lab.clamp_min(0).flatten(), reduction="none").view(lab.shape)
            loss_sum += float(loss[valid].sum())
            hit = (logits.argmax(-1) == lab) & valid
            right += hit.sum(0).cpu().numpy()
            count += valid.sum(0).cpu().numpy()
    n = max(count.sum(), 1)
    return float(right.sum() / n), loss_sum / n, right, count


def run(ds: xr.Dataset, model: Any, *, edits: list[Edit] | None = None, store_path: str | None = None,
        max_seqs: int = 64, batch_size: int = 16, n_components: int = 3, budget: int = 1 << 30,
        device: str = "cpu") -> ProbeResult:
    """Apply each edit (one at a time) to `model` on the first `max_seqs` sequences of `ds`.

    Args:
        ds: a store Dataset with `tokens` and `labels` [seq, pos], captured from `model`'s checkpoint.
        model: the loaded checkpoint (models.load_checkpoint).
        edits: the interventions (None: the sweep of the module docstring); store_path: the store, for the keys
            probe's stored components.
        max_seqs: sequences run; batch_size: sequences a forward; n_components: the sweep's key projection rank.
        budget: bytes of store data read into memory at once (blocks of sequences).
        device: where the model runs.

    Returns:
        ProbeResult: `dataset` (xarray, named dims) and one JSON record per intervention (the first is the baseline).
        The dataset holds accuracy, loss, delta_accuracy, delta_loss, kl [intervention] and accuracy_by_pos, kl_by_pos
        [intervention, pos], with the edit's kind, layer, head, step, value, position, source and channel as coordinates
        along `intervention`.
    """
    from tqdm.auto import tqdm

    data.require(ds, ["tokens", "labels"], NAME)
    cfg = model.config
    sub = ds.isel(seq=slice(0, max_seqs))
    tokens, labels = np.asarray(sub["tokens"].values), np.asarray(sub["labels"].values)
    if tokens.max() >= cfg.vocab_size:
        raise ProbeError(f"store tokens reach {tokens.max()} but the checkpoint's vocabulary has {cfg.vocab_size}: "
                         "pass the checkpoint the store was captured from")
    edits = sweep(ds, n_components) if not edits else edits
    if getattr(cfg, "model_type", None) == "rwkv7":
        bad = [e.label for e in edits if e.kind in SURGERY]
        if bad:
            raise ProbeError(f"{bad[0]}: state surgery replays the Householder delta rule, not RWKV-7's "
                             "diagonal-plus-rank-one transitions; use --set-beta, --ablate-head or --project-keys")
    delta_layers = list(getattr(cfg, "delta_layers", range(cfg.num_hidden_layers)))
    for e in edits:
        if not 0 <= e.layer < cfg.num_hidden_layers:
            raise ProbeError(f"{e.label}: layer {e.layer} out of range (model has {cfg.num_hidden_layers})")
        if e.layer not in delta_layers:
            raise ProbeError(f"{e.label}: layer {e.layer} is a softmax-attention layer; the delta-rule layers are "
                             f"{','.join(map(str, delta_layers))}")
        if e.head is not None and not 0 <= e.head < cfg.num_value_heads:
            raise ProbeError(f"{e.label}: head {e.head} out of range (model has {cfg.num_value_heads} value heads)")
        if e.step is not None and not 0 <= e.step < cfg.num_householder:
            raise ProbeError(f"{e.label}: step {e.step} out of range (model has {cfg.num_householder})")
        for name, val in (("token", e.position), ("source token", e.source)):
            if val is not None and not 0 <= val < tokens.shape[1]:
                raise ProbeError(f"{e.label}: {name} {val} out of range (sequences have {tokens.shape[1]} tokens)")
        if e.channel is not None and not 0 <= e.channel < cfg.head_k_dim:
            raise ProbeError(f"{e.label}: channel {e.channel} out of range (keys have {cfg.head_k_dim} channels)")
    from nnsight import NNsight

    bases = _key_bases(ds, store_path, edits, budget)
    nn_model = NNsight(model)
    base_acc, base_loss, base_right, count = evaluate(model, tokens, labels, [], bases, batch_size=batch_size,
                                                      device=device)
    rows = [(Edit("baseline", -1), base_acc, base_loss, base_right, np.zeros(len(count)))]
    for e in tqdm(edits, desc="interventions", leave=False, disable=len(edits) < 4):
        stats: dict[str, np.ndarray] = {}
        acc, loss, right, _ = evaluate(model, tokens, labels, [e], bases, batch_size=batch_size, device=device,
                                       nn_model=nn_model, kl=stats)
        rows.append((e, acc, loss, right, stats["sum_by_pos"]))
    T = tokens.shape[1]

    def opt(x: int | None) -> int:
        return -1 if x is None else int(x)

    out = xr.Dataset(
        {
            "accuracy": ("intervention", [r[1] for r in rows]),
            "loss": ("intervention", [r[2] for r in rows]),
            "delta_accuracy": ("intervention", [r[1] - base_acc for r in rows]),
            "delta_loss": ("intervention", [r[2] - base_loss for r in rows]),
            "kl": ("intervention", [float(r[4].sum() / max(count.sum(), 1)) for r in rows],
                   {"description": "mean KL(baseline || edited) of the next-token distribution, labelled positions"}),
            "kl_by_pos": (("intervention", "pos"), np.stack([np.where(count > 0, r[4] / np.maximum(count, 1), np.nan)
                                                             for r in rows])),
            "accuracy_by_pos": (("intervention", "pos"),
                                np.stack([np.where(count > 0, r[3] / np.maximum(count, 1), np.nan) for r in rows])),
        },
        coords={
            "kind": ("intervention", [KINDS[r[0].kind] for r in rows]),
            "layer": ("intervention", [r[0].layer for r in rows]),
            "head": ("intervention", [opt(r[0].head) for r in rows]),
            "step": ("intervention", [opt(r[0].step) for r in rows]),
            "value": ("intervention", [np.nan if r[0].value is None else r[0].value for r in rows]),
            "position": ("intervention", [opt(r[0].position) for r in rows]),
            "source": ("intervention", [opt(r[0].source) for r in rows]),
            "channel": ("intervention", [opt(r[0].channel) for r in rows]),
            "pos": np.arange(T),
        },
        attrs={"kinds": KINDS, "labels": [r[0].label if r[0].kind != "baseline" else "baseline" for r in rows],
               "n_seq": int(len(tokens)), "all_index": -1},
    )
    recs = [{"intervention": r[0].kind, "layer": None if r[0].kind == "baseline" else r[0].layer,
             "head": r[0].head, "step": r[0].step, "value": r[0].value, "accuracy": r[1], "loss": r[2],
             "delta_accuracy": r[1] - base_acc, "delta_loss": r[2] - base_loss,
             "kl": float(r[4].sum() / max(count.sum(), 1)), "position": r[0].position, "source": r[0].source,
             "channel": r[0].channel} for r in rows]
    return ProbeResult(NAME, out, recs, SUMMARY_KEYS)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set-beta", action="append", default=[], metavar="L:H:S=VALUE",
                   help="overwrite a step's beta (repeatable; H/S may be *)")
    p.add_argument("--ablate-head", action="append", default=[], metavar="L:H", help="zero a head's output")
    p.add_argument("--project-keys", action="append", default=[], metavar="L:H[:S]=K",
                   help="project keys on their top-K principal components (no S: joint basis of all steps)")
    p.add_argument("--erase", action="append", default=[], metavar="L:H@T[:S]",
                   help="erase the association along token T's step-S key from the state after token T")
    p.add_argument("--write", action="append", default=[], metavar="L:H@T=SRC[:S]",
                   help="write token SRC's step-S key/value pair into the state after token T")
    p.add_argument("--scale-decay", action="append", default=[], metavar="L:H[:C]@T=F",
                   help="multiply the head's (or dk channel C's) forget factor by F from token T on")
    p.add_argument("--components", type=int, default=3, help="components kept by the sweep's key projections")
    p.add_argument("--batch-size", type=int, default=16)


def from_args(ds: xr.Dataset, args: argparse.Namespace, sink: Any) -> ProbeResult:
    from deltalab.models import load_checkpoint

    edits = ([parse_edit("set_beta", s) for s in args.set_beta]
             + [parse_edit("ablate_head", s) for s in args.ablate_head]
             + [parse_edit("project_keys", s) for s in args.project_keys]
             + [parse_surgery(kind, s) for kind in SURGERY for s in getattr(args, kind)])
    device = data.pick_device(args.device)
    model = load_checkpoint(args.checkpoint, device=device)
    if ds.attrs.get("model_config") and "num_heads" in ds.attrs["model_config"]:
        want = ds.attrs["model_config"]
        for key in ("num_heads", "num_householder", "head_dim", "num_hidden_layers"):
            if key in want and getattr(model.config, key, want[key]) != want[key]:
                raise ProbeError(f"checkpoint {args.checkpoint} has {key}={getattr(model.config, key)} but the store "
                                 f"was captured with {want[key]}: pass the matching checkpoint")
    return run(ds, model, edits=edits, store_path=args.store, max_seqs=args.max_seqs or 64, batch_size=args.batch_size,
               n_components=args.components, budget=args.memory_budget, device=device)


def main(argv: list[str] | None = None) -> None:
    """`python -m deltalab.probes.intervene --store STORE --checkpoint CKPT [--set-beta 0:6:1=0] [--json]`."""
    exit_main(NAME, argv)


if __name__ == "__main__":
    main()
