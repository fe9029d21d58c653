"""`deltalab patch CHECKPOINT --clean ... --corrupted ... --metric logit-diff:A,B`: a causal patching experiment.

Activation patching (every hook x layer x head x position), state patching (every layer x head x token, the
recurrence running on from the patched state) or attribution patching (all cells estimated from one forward and
backward), on two sequences: text through the checkpoint's tokenizer (UTF-8 bytes without one), token ids
(`--ids`), or two sequences of a capture store (`--store S --clean-seq N --corrupted-seq M`). The result is an
xarray Dataset (`probes.patching`), written to `--out FILE.nc` and/or into the store as `results/patching-KIND`;
the top cells are printed (or every cell as JSON records with `--json`). Bad input: one line, exit 2, nothing
written.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import typer

from deltalab.app.errors import fail

EXPERIMENTS = ("activation", "state", "attribution")


def _int_list(text: str | None, flag: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(s) for s in re.split(r"[\s,]+", text.strip()) if s]
    except ValueError:
        fail(f"{flag} {text!r}: write integers separated by commas, e.g. {flag} 0,3,5")


def _tokens(text: str | None, as_ids: bool, checkpoint: Path, name: str, store_ids: Any) -> Any:
    """The token ids of --clean / --corrupted (text, ids, or the store's sequence)."""
    import numpy as np

    if store_ids is not None:
        return store_ids
    if text is None:
        fail(f"give --{name} (text, or token ids with --ids), or --store with --{name}-seq")
    if as_ids:
        ids = _int_list(text, f"--{name}")
        if not ids:
            fail(f"--{name} is empty: give token ids separated by spaces or commas")
        return np.asarray(ids, np.int64)
    from deltalab.app.dash.own_input import encode_text
    from deltalab.app.dash.textgrid import tokenizer_file

    return encode_text(text, tokenizer_file(checkpoint))


def _store_sequence(store: Path, seq: int, flag: str) -> Any:
    import numpy as np

    from deltalab.probes.core import ProbeError
    from deltalab.probes.data import open_store

    try:
        ds = open_store(store)
    except ProbeError as err:
        fail(str(err))
    n = ds.sizes["seq"]
    if not 0 <= seq < n:
        fail(f"{flag} {seq} is out of range: the store has sequences 0..{n - 1}")
    tokens = np.asarray(ds["tokens"].isel(seq=seq).values, np.int64)
    if "pad" in ds:
        tokens = tokens[~np.asarray(ds["pad"].isel(seq=seq).values, bool)]
    return tokens


def _check_out(out: Path | None) -> None:
    if out is None:
        return
    if out.suffix != ".nc":
        fail(f"--out {out}: the result is written as netCDF, so name a FILE.nc")
    if not out.parent.exists():
        fail(f"--out {out}: folder {out.parent} does not exist; create it or pick another path")


def _check_store_checkpoint(store: Path, checkpoint: Path) -> None:
    from deltalab.probes.core import ProbeError
    from deltalab.probes.data import open_store
    from deltalab.store.plan import checkpoint_digest

    try:
        attrs = open_store(store).attrs
    except ProbeError as err:
        fail(str(err))
    have = attrs.get("checkpoint_digest")
    if have and have != checkpoint_digest(checkpoint):
        fail(f"store {store} was captured from another checkpoint than {checkpoint}: pass the store's checkpoint "
             "or capture this one")


def _records(ds: Any, var: str, top: int | None) -> list[dict[str, Any]]:
    """Cells of `var` as records, largest |value| first (NaN cells left out)."""
    frame = ds[var].to_dataframe().dropna().reset_index()
    frame = frame.reindex(frame[var].abs().sort_values(ascending=False).index)
    rows = frame.to_dict("records")
    return rows if top is None else rows[:top]


def patch(
    checkpoint: Path = typer.Argument(..., help="Checkpoint folder (config.json + model.safetensors)."),
    clean: str = typer.Option(None, "--clean", help="The clean input: text, or token ids with --ids."),
    corrupted: str = typer.Option(None, "--corrupted", help="The corrupted input (same number of tokens)."),
    metric: str = typer.Option(..., "--metric", help="logit-diff:A,B | logprob:A | loss | kl (A, B: token ids)."),
    experiment: str = typer.Option("activation", "--experiment", "-e", help="activation | state | attribution."),
    hooks: str = typer.Option("resid_pre,o", "--hooks", help="Hook points (activation, attribution): "
                              "resid_pre,resid_mid,resid_post,q,k,v,beta,g,o."),
    layers: str = typer.Option(None, "--layers", help="Layers, e.g. 0,2 (default all)."),
    heads: str = typer.Option(None, "--heads", help="State patching: value heads (default all)."),
    parts: str = typer.Option("full", "--parts", help="State patching: parts of the state, e.g. full,rank:1,top:2 "
                              "(the best rank-r approximation; the top r key directions)."),
    positions: str = typer.Option(None, "--positions", help="Positions (tokens) to patch (default all)."),
    metric_positions: str = typer.Option(None, "--metric-positions",
                                         help="Positions the metric averages over (default: the last; negative from "
                                              "the end)."),
    per_head: bool = typer.Option(True, "--per-head/--all-heads", help="Head hooks one head at a time, or all."),
    per_position: bool = typer.Option(True, "--per-position/--all-positions", help="One position at a time, or all."),
    direction: str = typer.Option("denoise", "--direction", help="denoise (clean into corrupted) or noise."),
    as_ids: bool = typer.Option(False, "--ids", help="--clean/--corrupted are token ids, not text."),
    store: Path = typer.Option(None, "--store", help="A capture store of CHECKPOINT: its sequences as inputs "
                               "(--clean-seq/--corrupted-seq) and where the result is written."),
    clean_seq: int = typer.Option(None, "--clean-seq", help="The store's sequence used as the clean input."),
    corrupted_seq: int = typer.Option(None, "--corrupted-seq", help="The store's sequence used as the corrupted one."),
    out: Path = typer.Option(None, "--out", help="Write the result Dataset to FILE.nc."),
    batch_size: int = typer.Option(32, "--batch-size", help="Patched runs per forward."),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda, cuda:1 ..."),
    top: int = typer.Option(15, "--top", help="Cells printed (largest effect first)."),
    as_json: bool = typer.Option(False, "--json", help="Print every cell as JSON records."),
) -> None:
    """Patch one run into another and measure how much of the behaviour comes back (0 = corrupted, 1 = clean)."""
    if experiment not in EXPERIMENTS:
        fail(f"--experiment {experiment!r}: use one of {', '.join(EXPERIMENTS)}")
    if batch_size < 1:
        fail(f"--batch-size {batch_size}: give at least 1")
    _check_out(out)
    if (clean_seq is not None or corrupted_seq is not None) and store is None:
        fail("--clean-seq/--corrupted-seq read a capture store: pass --store STORE")
    if store is not None:
        _check_store_checkpoint(store, checkpoint)
    import torch

    from deltalab.models import CheckpointError, load_checkpoint
    from deltalab.probes.patching import (
        Metric,
        PatchingError,
        activation_patching,
        attribution_patching,
        state_patching,
    )

    try:
        model = load_checkpoint(checkpoint, device=device)
    except CheckpointError as err:
        fail(str(err))
    clean_ids = _tokens(clean, as_ids, checkpoint, "clean",
                        None if clean_seq is None else _store_sequence(store, clean_seq, "--clean-seq"))
    corrupted_ids = _tokens(corrupted, as_ids, checkpoint, "corrupted",
                            None if corrupted_seq is None else _store_sequence(store, corrupted_seq, "--corrupted-seq"))
    try:
        m = Metric.parse(metric, _int_list(metric_positions, "--metric-positions"))
        layer_list, pos_list = _int_list(layers, "--layers"), _int_list(positions, "--positions")
        hook_list = [h for h in hooks.split(",") if h.strip()]
        with torch.no_grad():
            if experiment == "activation":
                ds = activation_patching(model, clean_ids, corrupted_ids, m, hooks=hook_list, layers=layer_list,
                                         per_head=per_head, per_position=per_position, positions=pos_list,
                                         direction=direction, batch_size=batch_size)
            elif experiment == "state":
                ds = state_patching(model, clean_ids, corrupted_ids, m, layers=layer_list,
                                    heads=_int_list(heads, "--heads"), tokens=pos_list, direction=direction,
                                    batch_size=batch_size, parts=_parts(parts, model))
        if experiment == "attribution":
            ds = attribution_patching(model, clean_ids, corrupted_ids, m, hooks=hook_list, layers=layer_list,
                                      per_head=per_head, per_position=per_position, direction=direction)
    except PatchingError as err:
        fail(str(err))
    ds.attrs.update(checkpoint=str(checkpoint), clean_ids=[int(x) for x in clean_ids],
                    corrupted_ids=[int(x) for x in corrupted_ids])
    var = "attribution" if experiment == "attribution" else "patched"
    if out is not None:
        _write_netcdf(ds, out)
    if store is not None:
        from deltalab.probes.results import write_results

        write_results(store, f"patching-{experiment}", ds, _provenance(experiment, checkpoint))
    if as_json:
        typer.echo(json.dumps({"attrs": _json_attrs(ds.attrs), "cells": _records(ds, var, None)},
                              default=lambda x: x.item() if hasattr(x, "item") else str(x)))
        return
    typer.echo(f"{ds.attrs['experiment']} ({direction}), {m.label}: clean {ds.attrs['clean_metric']:.4g}, "
               f"corrupted {ds.attrs['corrupted_metric']:.4g}; normalised 0 = corrupted, 1 = clean")
    for row in _records(ds, var, top):
        cell = ", ".join(f"{k} {v}" for k, v in row.items() if k not in (var, "metric", "attribution_metric"))
        typer.echo(f"  {row[var]:8.4f}  {cell}")
    for where in ([str(out)] if out else []) + ([f"{store}/results/patching-{experiment}"] if store else []):
        typer.echo(f"written: {where}")


def _parts(text: str, model: Any) -> list[Any]:
    """'full,rank:1,top:2' -> StateParts; one line naming the form otherwise."""
    from deltalab.probes.patching import StatePart

    out = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        kind, _, r = item.partition(":")
        if kind == "full" and not r:
            out.append(StatePart())
            continue
        if kind not in ("rank", "top") or not r.isdigit() or int(r) < 1:
            fail(f"--parts {item!r}: write full, rank:R or top:R with R >= 1 (e.g. --parts full,rank:1)")
        out.append(StatePart(kind, int(r)))
    if not out:
        fail("--parts is empty: write full, rank:R or top:R")
    return out


def _provenance(experiment: str, checkpoint: Path) -> dict[str, Any]:
    """The attributes a store result carries: what wrote it, when, with which command line."""
    import sys
    from datetime import datetime, timezone

    from deltalab.models.run_files import deltalab_version

    return {"probe": f"patching-{experiment}", "complete": True, "deltalab_version": deltalab_version(),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command_line": ["deltalab", "patch", *sys.argv[2:]] if sys.argv[1:2] == ["patch"] else
            ["deltalab", "patch", str(checkpoint)]}


def _json_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    from deltalab.models.run_files import clean_json

    return clean_json(dict(attrs))


def _write_netcdf(ds: Any, out: Path) -> None:
    """netCDF (scipy's writer): integer coordinates as int32, attributes as JSON where netCDF has no type."""
    import numpy as np

    ds = ds.copy()
    for name, coord in ds.coords.items():
        if np.issubdtype(coord.dtype, np.integer):
            ds = ds.assign_coords({name: coord.astype(np.int32)})
    ds.attrs = {k: (v if isinstance(v, (str, int, float)) else json.dumps(_json_attrs({k: v})[k]))
                for k, v in ds.attrs.items()}
    tmp = out.with_name(out.name + ".partial")
    ds.to_netcdf(tmp)
    tmp.replace(out)
