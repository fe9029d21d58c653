"""Logit lens: the residual stream after every layer read through the model's final norm and unembedding.

For each layer (and the embeddings, layer -1), sequence and position: the top-k tokens and their probabilities,
and the probability, logit and rank (0 = top) of a target token: the actual next token by default, or one chosen
token. The last layer's lens is the model's own prediction. Works for every family deltalab loads
(probes.stream.layout_of).

    from deltalab.probes.lens import logit_lens
    ds = logit_lens(model, input_ids)            # xr.Dataset, dims (seq, layer, pos[, rank])

`deltalab probe lens --store S --checkpoint C` reads the store's `resid_post` (captured with `--hooks resid_post`),
or with `--run` runs the checkpoint on the store's tokens; `deltalab probe lens --checkpoint C --text "..."`
(or `--tokens 1,2,3`) reads typed input.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np
import xarray as xr

from deltalab.probes.base import ProbeError, ProbeResult, exit_main

NAME = "lens"
NEEDS_CHECKPOINT = True
SUMMARY_KEYS = ["layer", "target_prob_mean", "target_rank_median", "top1_accuracy", "entropy_mean"]
EMBED_LAYER = -1
"""The `layer` coordinate of the embeddings (the stream before layer 0)."""


def next_token_targets(input_ids: Any) -> Any:
    """Targets [B, T]: the next token at each position, -1 at the last (nothing to predict)."""
    import torch

    ids = torch.as_tensor(input_ids)
    out = torch.full_like(ids, -1)
    out[:, :-1] = ids[:, 1:]
    return out


def lens_arrays(readout: Any, resid: Any, targets: Any, top_k: int = 5) -> dict[str, np.ndarray]:
    """Lens of residuals resid [B, L, T, D] with targets [B, T] (-1: none): numpy arrays keyed by variable,
    [B, L, T] or [B, L, T, top_k]; one layer's logits in memory at a time."""
    import torch

    B, L, T, _ = resid.shape
    k = min(top_k, readout.vocab_size)
    tgt = torch.as_tensor(targets).to(readout.unembed.weight.device)
    has = tgt >= 0
    out = {"top_token": np.zeros((B, L, T, k), np.int32), "top_prob": np.zeros((B, L, T, k), np.float32),
           "target_prob": np.full((B, L, T), np.nan, np.float32),
           "target_logit": np.full((B, L, T), np.nan, np.float32),
           "target_rank": np.full((B, L, T), -1, np.int32), "entropy": np.zeros((B, L, T), np.float32)}
    for li in range(L):
        logits = readout.logits(resid[:, li]).float()  # [B, T, V]
        logp = logits.log_softmax(-1)
        p = logp.exp()
        top = p.topk(k, dim=-1)
        out["top_token"][:, li] = top.indices.cpu().numpy()
        out["top_prob"][:, li] = top.values.cpu().numpy()
        out["entropy"][:, li] = (-(p * logp).nan_to_num().sum(-1)).cpu().numpy()
        t = tgt.clamp(min=0)[..., None]
        tl = logits.gather(-1, t)
        rank = (logits > tl).sum(-1)
        out["target_prob"][:, li] = torch.where(has, p.gather(-1, t)[..., 0], torch.nan).cpu().numpy()
        out["target_logit"][:, li] = torch.where(has, tl[..., 0], torch.nan).cpu().numpy()
        out["target_rank"][:, li] = torch.where(has, rank, -1).cpu().numpy()
    return out


def to_dataset(arrays: dict[str, np.ndarray], targets: np.ndarray, layers: list[int], tokens: np.ndarray | None,
               positions: np.ndarray | None = None) -> xr.Dataset:
    """The lens arrays as a Dataset with named dims (seq, layer, pos, rank)."""
    B, L, T, k = arrays["top_token"].shape
    pos = np.arange(T) if positions is None else positions
    data: dict[str, Any] = {}
    for name, arr in arrays.items():
        dims = ("seq", "layer", "pos", "rank") if arr.ndim == 4 else ("seq", "layer", "pos")
        data[name] = (dims, arr)
    data["target"] = (("seq", "pos"), np.asarray(targets, np.int32))
    if tokens is not None:
        data["tokens"] = (("seq", "pos"), np.asarray(tokens, np.int32))
    ds = xr.Dataset(data, coords={"layer": np.asarray(layers, np.int64), "pos": pos, "rank": np.arange(k)})
    ds["top_prob"].attrs["description"] = "probability of the top-k tokens of the residual read as the final layer"
    ds["target_rank"].attrs["description"] = "tokens with a larger logit than the target (0 = top; -1: no target)"
    ds.attrs["embed_layer"] = EMBED_LAYER
    return ds


def check_target(readout: Any, target: int | None) -> None:
    if target is not None:
        readout.check_tokens([target], "--target")


def logit_lens(model: Any, input_ids: Any, *, target: int | Any | None = None, top_k: int = 5,
               embed: bool = True) -> xr.Dataset:
    """The logit lens of `model` on input_ids [B, T] (int64): dims (seq, layer, pos[, rank]).

    target: None (the next token), one token id for every position, or ids [B, T] (-1: none). embed adds the
    embeddings as layer -1. The last layer equals the model's own logits.
    """
    import torch

    from deltalab.probes.stream import ReadOut, capture_stream

    ids = torch.as_tensor(input_ids)
    if ids.dim() == 1:
        ids = ids[None]
    dev = next(model.parameters()).device
    ids = ids.to(dev)
    stream = capture_stream(model, ids)
    readout = ReadOut(stream.layout)
    if target is None:
        tgt = next_token_targets(ids)
    elif isinstance(target, int):
        check_target(readout, target)
        tgt = torch.full_like(ids, target)
    else:
        tgt = torch.as_tensor(target).to(dev)
        readout.check_tokens(tgt[tgt >= 0], "target")
    resid = stream.resid_post
    layers = list(range(stream.layout.num_layers))
    if embed:
        resid, layers = [stream.resid_pre[0], *resid], [EMBED_LAYER, *layers]
    arrays = lens_arrays(readout, torch.stack(resid, 1), tgt, top_k)
    return to_dataset(arrays, tgt.cpu().numpy(), layers, ids.cpu().numpy())


# --- records and the probe --------------------------------------------------------------------


def records(ds: xr.Dataset) -> list[dict[str, Any]]:
    """One record per layer: mean target probability, median rank, top-1 accuracy, mean entropy."""
    out = []
    has = ds["target"].values >= 0
    for li, layer in enumerate(ds["layer"].values):
        prob = ds["target_prob"].values[:, li][has]
        rank = ds["target_rank"].values[:, li][has]
        top1 = ds["top_token"].values[:, li, :, 0][has] == ds["target"].values[has]
        out.append({"layer": int(layer),
                    "target_prob_mean": float(np.nanmean(prob)) if prob.size else float("nan"),
                    "target_rank_median": float(np.median(rank)) if rank.size else float("nan"),
                    "top1_accuracy": float(top1.mean()) if top1.size else float("nan"),
                    "entropy_mean": float(ds["entropy"].values[:, li].mean())})
    return out


def store_targets(ds: xr.Dataset, tokens: np.ndarray, target: int | None) -> np.ndarray:
    """Targets of stored sequences: --target, else the store's labels (aligned with positions), else the next
    token."""
    from deltalab.kernels.constants import IGNORE_INDEX

    if target is not None:
        return np.full(tokens.shape, target, np.int64)
    if "labels" in ds:
        lab = np.asarray(ds["labels"].values, np.int64)
        return np.where(lab == IGNORE_INDEX, -1, lab)
    return np.asarray(next_token_targets(tokens))


def run_store(ds: xr.Dataset, model: Any, *, target: int | None = None, top_k: int = 5, run_model: bool = False,
              batch_size: int = 8, layers: list[int] | None = None) -> ProbeResult:
    """The lens of a store's sequences: its `resid_post` through the model's read-out, or (run_model) the model
    run on its tokens (`layers`: keep only those model layers)."""
    import torch

    from deltalab.probes.stream import ReadOut, layout_of

    readout = ReadOut(layout_of(model))
    check_target(readout, target)
    if "tokens" not in ds:
        raise ProbeError("probe lens needs variable tokens which the store lacks: re-capture with "
                         "`deltalab capture ... --hooks tokens,resid_post`")
    tokens = np.asarray(ds["tokens"].values, np.int64)
    targets = store_targets(ds, tokens, target)
    readout.check_tokens(torch.as_tensor(targets[targets >= 0]), "target")
    if run_model:
        parts = [logit_lens(model, torch.as_tensor(tokens[i:i + batch_size]), target=torch.as_tensor(
            targets[i:i + batch_size]), top_k=top_k) for i in range(0, len(tokens), batch_size)]
        out = xr.concat(parts, "seq")
        if layers is not None:  # --layers: the model ran them all; keep those asked for
            out = out.sel(layer=[x for x in out["layer"].values if int(x) in set(layers)])
    else:
        if "resid_post" not in ds:
            raise ProbeError("probe lens needs variable resid_post which the store lacks: re-capture with "
                             "`deltalab capture ... --hooks tokens,resid_post`, or pass --run to run the checkpoint "
                             "on the store's tokens")
        width = readout.unembed.in_features
        if ds.sizes["hidden"] != width:
            raise ProbeError(f"the store's residuals are {ds.sizes['hidden']} wide but the checkpoint's unembedding "
                             f"reads {width}: pass the checkpoint the store was captured from")
        stored = [int(x) for x in ds["layer"].values] if "layer" in ds.coords else list(range(ds.sizes["layer"]))
        parts = []
        w = readout.unembed.weight
        for i in range(0, len(tokens), batch_size):
            resid = torch.as_tensor(np.asarray(ds["resid_post"].isel(seq=slice(i, i + batch_size)).values),
                                    dtype=w.dtype, device=w.device)
            parts.append(lens_arrays(readout, resid, torch.as_tensor(targets[i:i + batch_size]), top_k))
        arrays = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        out = to_dataset(arrays, targets, stored, tokens)
    out.attrs.update({"top_k": top_k, "target_token": -1 if target is None else target,
                      "source": "model run" if run_model else "stored resid_post"})
    return ProbeResult(NAME, out, records(out), SUMMARY_KEYS)


TYPED_EPILOG = "Typed input (no store): deltalab probe {name} --checkpoint C --text TEXT (or --tokens 1,2,3)."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = TYPED_EPILOG.format(name=NAME)
    p.add_argument("--target", type=int, default=None, help="token id to follow (default: the actual next token)")
    p.add_argument("--top-k", type=int, default=5, help="top tokens kept per layer and position (default 5)")
    p.add_argument("--run", action="store_true", help="run the checkpoint on the store's tokens instead of reading "
                                                      "its stored resid_post")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward or read (default 8)")


def load_model(checkpoint: str, device: str) -> Any:
    from deltalab.models import load_checkpoint

    return load_checkpoint(checkpoint, device=device)


def from_args(ds: xr.Dataset, args: argparse.Namespace, sink: Any) -> ProbeResult:
    from deltalab.probes import data

    if args.top_k < 1:
        raise ProbeError(f"--top-k {args.top_k}: pass a positive number of tokens")
    if args.batch_size < 1:
        raise ProbeError(f"--batch-size {args.batch_size}: pass a positive number of sequences")
    device = data.pick_device(args.device)
    model = load_model(args.checkpoint, device)
    return run_store(ds, model, target=args.target, top_k=args.top_k, run_model=args.run,
                     batch_size=args.batch_size, layers=args.layers)


# --- typed input ------------------------------------------------------------------------------


def typed_records(ds: xr.Dataset, spell: Any) -> list[dict[str, Any]]:
    """One record per (layer, position) of one typed sequence: the token, its target, the lens' top token."""
    out = []
    tok, tgt = ds["tokens"].values[0], ds["target"].values[0]
    for li, layer in enumerate(ds["layer"].values):
        for t in range(ds.sizes["pos"]):
            top = int(ds["top_token"].values[0, li, t, 0])
            out.append({"layer": int(layer), "pos": t, "token": spell(tok[t]),
                        "target": spell(tgt[t]) if tgt[t] >= 0 else "", "top": spell(top),
                        "top_prob": float(ds["top_prob"].values[0, li, t, 0]),
                        "target_prob": float(ds["target_prob"].values[0, li, t]),
                        "target_rank": int(ds["target_rank"].values[0, li, t])})
    return out


def typed_parser(name: str, description: str) -> argparse.ArgumentParser:
    """The options of a typed-input run (no store): --checkpoint, --text/--tokens, --device, --json."""
    from deltalab.probes.typed import add_typed_arguments
    from deltalab.store.cliparse import OneLineParser

    p = OneLineParser(prog=f"deltalab probe {name}", description=description)
    p.add_argument("--checkpoint", required=True, help="checkpoint folder")
    add_typed_arguments(p)
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    p.add_argument("--json", action="store_true", help="print the records as a JSON list on stdout")
    return p


def typed_main(argv: list[str]) -> int:
    """`deltalab probe lens --checkpoint C --text TEXT|--tokens IDS [--target ID] [--top-k K] [--json]`."""
    import torch

    from deltalab.probes import data
    from deltalab.probes.base import print_summary
    from deltalab.probes.typed import decoder, encode

    p = typed_parser(NAME, (__doc__ or NAME).strip().splitlines()[0])
    p.add_argument("--target", type=int, default=None, help="token id to follow (default: the actual next token)")
    p.add_argument("--top-k", type=int, default=5, help="top tokens kept per layer and position (default 5)")
    try:
        args = p.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    try:
        if args.top_k < 1:
            raise ProbeError(f"--top-k {args.top_k}: pass a positive number of tokens")
        model = load_model(args.checkpoint, data.pick_device(args.device))
        from deltalab.probes.stream import layout_of

        vocab = layout_of(model).vocab_size
        ids = encode(args.checkpoint, args.text, args.tokens, vocab)
        ds = logit_lens(model, torch.tensor([ids]), target=args.target, top_k=args.top_k)
    except (ValueError, KeyError, OSError, RuntimeError) as err:
        print(f"error: {str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}",
              file=sys.stderr)
        return 2
    result = ProbeResult(NAME, ds, typed_records(ds, decoder(args.checkpoint, vocab)),
                         ["layer", "pos", "token", "target", "top", "top_prob", "target_prob", "target_rank"])
    print(result.to_json()) if args.json else print_summary(result, written=None, max_rows=200)
    return 0


def main(argv: list[str] | None = None) -> None:
    """`python -m deltalab.probes.lens --store STORE --checkpoint CKPT [--run] [--json]`, or typed input."""
    from deltalab.probes.typed import wants_typed

    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_typed(argv):
        sys.exit(typed_main(argv))
    exit_main(NAME, argv)


if __name__ == "__main__":
    main()
