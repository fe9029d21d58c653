"""`deltalab capture` (hook points -> zarr store), `deltalab store info` (what a store holds) and `deltalab store
verify` (is every chunk intact)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from deltalab.app.errors import fail
from deltalab.store.schema import human_bytes

store_app = typer.Typer(help="Inspect capture stores.", no_args_is_help=True)

DATA_HELP = ("Task (S4:length=128,samples=512,seed=0), word-problem CSV (csv:PATH or PATH.csv) or text "
             "(text:PATH[:length=256,tokenizer=auto|bytes|tokenizer.json]).")


def capture(
    checkpoint: Path = typer.Argument(..., help="Checkpoint folder (config.json + model.safetensors)."),
    data: str = typer.Option(..., "--data", "-d", help=DATA_HELP),
    out: Path = typer.Option(..., "--out", "-o",
                             help="Store folder (zarr v3); rerun to resume, a new --data appends."),
    hooks: str | None = typer.Option(None, "--hooks", "--vars",
                                     help="Comma-separated: tokens,labels,loss,q,k,v,beta,g,state (default) "
                                          "and o,resid_pre,resid_mid,resid_post."),
    layers: str | None = typer.Option(None, "--layers", help="Comma-separated layer indices (default: all)."),
    heads: str | None = typer.Option(None, "--heads",
                                     help="Heads to keep of every per-head variable, e.g. 0,3-5 (value heads; "
                                          "grouped models: key:0,1 names key heads). Default: all."),
    batch_size: int | None = typer.Option(None, "--batch-size",
                                          help="Sequences per batch = store chunk along seq "
                                               "(default 8, or the store's)."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda[:N]."),
    dtype: str = typer.Option("float32", "--dtype", help="Activation storage dtype: float16 or float32."),
    model_dtype: str = typer.Option("float32", "--model-dtype",
                                    help="dtype the model runs in: float32, bfloat16 or float16."),
    device_map: str | None = typer.Option(None, "--device-map",
                                          help="auto (fill the GPUs in order) or balanced (split evenly): spread a "
                                               "transformers model over the GPUs (accelerate)."),
    state_every: int = typer.Option(1, "--state-every",
                                    help="Keep every N-th chunk-boundary state (chunks of N x 64 tokens)."),
    reduce: str | None = typer.Option(None, "--reduce",
                                      help="Compute ranks,spectra,attention during capture into the store's "
                                           "results (as `deltalab probe erank/spectra/attention`); the states "
                                           "are then not stored unless --keep states."),
    keep: str | None = typer.Option(None, "--keep", help="With --reduce: states (store them too)."),
    rank_every: int | None = typer.Option(None, "--rank-every",
                                          help="With --reduce ranks: rank the state after every N-th token "
                                               "(default on CUDA: the power of two that ranks at most one state "
                                               "per two tokens, e.g. 2048 for 768 delta-rule heads, so capture "
                                               "keeps pace with the forward; 1 on the CPU)."),
    spectra_precision: str = typer.Option("float64", "--spectra-precision",
                                          help="With --reduce spectra: solve per-channel gates' eigenvalues in "
                                               "float64 or float32 (about 7x faster on a GPU, within ~20 eps32 of "
                                               "the spectral scale)."),
    allow_nonfinite: bool = typer.Option(False, "--allow-nonfinite",
                                         help="Capture a checkpoint whose weights hold NaN/Inf (refused otherwise); "
                                              "the store records which tensors in `nonfinite_tensors`."),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Run CHECKPOINT over --data under nnsight and write its hook points into the zarr store --out."""
    from deltalab.models import CheckpointError
    from deltalab.models.devices import check_device
    from deltalab.probes.reduce import CaptureReductions, parse_reductions, stored_hooks
    from deltalab.store import StoreError
    from deltalab.store import capture as run_capture
    from deltalab.store.errors import corrupt_chunk_line, reraise_unless_input_error
    from deltalab.store.plan import parse_list
    from deltalab.store.schema import DEFAULT_HOOKS
    from deltalab.store.verify import seq_spans

    command_line = ["deltalab", *sys.argv[1:]]
    if out.exists() and not out.is_dir():
        fail(f"--out {out} is a file, not a store folder: pass a new folder (or an existing store) to write into")
    try:
        device = check_device(device, allow_auto=False)
        names = parse_reductions(reduce)
        if spectra_precision != "float64" and "spectra" not in names:
            raise ValueError("--spectra-precision only applies with --reduce spectra: add it, or drop the flag")
        hook_list = stored_hooks(parse_list(hooks) or list(DEFAULT_HOOKS), names, keep)
        every = 1 if rank_every is None and not device.startswith("cuda") else rank_every  # None on CUDA: auto
        reductions = CaptureReductions(names, device=device, command_line=command_line, rank_every=every,
                                       spectra_precision=spectra_precision) if names else None
        summary = run_capture(checkpoint, data, out, hooks=hook_list, layers=layers, heads=heads,
                              batch_size=batch_size,
                              device=device, dtype=dtype, progress=progress, model_dtype=model_dtype,
                              device_map=device_map, state_every=state_every, reductions=reductions,
                              command_line=command_line, allow_nonfinite=allow_nonfinite)
    except (StoreError, CheckpointError, ValueError) as err:
        fail((corrupt_chunk_line(err, out) if type(err) is ValueError else None) or str(err))
    except RuntimeError as err:  # zstd's, on a chunk of an older store (no crc32c) that does not decode
        reraise_unless_input_error(err)
        fail(corrupt_chunk_line(err, out))
    if as_json:
        typer.echo(json.dumps(summary))
    elif summary["rank"] == 0:
        repaired = summary.get("repaired") or []
        typer.echo(f"{summary['store']}: wrote {summary['written']} sequence(s)"
                   + (f" (repaired damaged sequence(s) {seq_spans(repaired)})" if repaired else "")
                   + ", skipped "
                   f"{summary['skipped']} already complete; "
                   f"{summary['complete']}/{summary['sequences']} complete "
                   f"({summary['seconds']:.1f} s)")
        if summary["reduced"]:
            typer.echo(f"reduced during capture: {', '.join(summary['reduced'])} -> "
                       + ", ".join(f"{summary['store']}/results/{p}" for p in summary["reduced_from_store"]))


@store_app.command("info")
def info(
    store_path: Path = typer.Argument(..., metavar="STORE",
                                      help="Store folder written by `deltalab capture`."),
    as_json: bool = typer.Option(False, "--json", help="Print everything as JSON."),
) -> None:
    """Variables, sizes, completeness and provenance of a capture store."""
    from deltalab import store
    from deltalab.store.display import inert_tree

    try:
        summary = store.info(store_path)
    except store.StoreError as err:
        fail(str(err))
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
        return
    summary = inert_tree(summary)  # the store's strings are data: escape sequences print as text
    prov = summary["provenance"]
    cfg = prov.get("model_config", {})
    typer.echo(f"{summary['path']}  (deltalab store format {summary['format']}, "
               f"{human_bytes(summary['stored_bytes'])} on disk)")
    typer.echo(f"sequences: {summary['complete']}/{summary['sequences']} complete")
    for seg in summary["segments"]:
        typer.echo(f"  {seg['data_spec']}  seq [{seg['start']}, {seg['start'] + seg['count']})  "
                   f"{seg['complete']}/{seg['count']} complete")
    typer.echo(f"model: {cfg.get('model_type')} layers={cfg.get('num_hidden_layers')} "
               f"heads={cfg.get('num_heads')} n_h={cfg.get('num_householder', 1)} "
               f"vocab={cfg.get('vocab_size')}  "
               f"checkpoint {prov.get('checkpoint_digest', '?')[:23]}...")
    typer.echo(f"captured: layers {prov.get('layers')}, "
               + (f"heads {prov['heads']}, " if "heads" in prov else "")
               + f"hooks {','.join(prov.get('hooks', []))}, "
               f"dtype {prov.get('dtype')}, batch {prov.get('batch_size')}"
               + (f", train_length {prov['train_length']}" if "train_length" in prov else ""))
    typer.echo(f"created {prov.get('created')} by deltalab {prov.get('deltalab_version')}: "
               f"{' '.join(prov.get('command_line', []))}")
    typer.echo("sizes: " + " ".join(f"{k}={v}" for k, v in summary["sizes"].items()))
    typer.echo("variables:")
    width = max(len(n) for n in summary["variables"])
    for name, v in summary["variables"].items():
        dims = ",".join(f"{d}" for d in v["dims"])
        tag = "" if v["captured"] else "  (added)"
        typer.echo(f"  {name:<{width}}  {v['dtype']:<8} [{dims}] {tuple(v['shape'])}  "
                   f"{human_bytes(v['stored_bytes'])} stored{tag}")
    if summary["results"]:
        typer.echo("results: " + ", ".join(summary["results"]))


@store_app.command("verify")
def verify(
    store_path: Path = typer.Argument(..., metavar="STORE", help="Store folder written by `deltalab capture`."),
    results: bool = typer.Option(True, "--results/--no-results", help="Check the probes' results/ too."),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Check every chunk of STORE against its checksum; name the damaged sequences and the command that repairs
    them. Exit 0 when clean, 1 when damage is found, 2 when STORE cannot be read as a store."""
    from deltalab import store
    from deltalab.store.schema import CHECKSUM_FORMAT
    from deltalab.store.verify import seq_spans
    from deltalab.store.verify import verify as run_verify

    try:
        attrs = store.check_store(store_path)
        report = run_verify(store_path, results=results, progress=progress)
    except store.StoreError as err:
        fail(str(err))
    seqs = report.damaged_sequences()
    if as_json:
        typer.echo(json.dumps({
            "store": str(store_path), "format": report.format, "checked_chunks": report.checked,
            "clean": report.clean, "damaged_sequences": seqs,
            "damage": [{"array": d.array, "key": d.key, "seq": list(d.seq) if d.seq else None, "reason": d.reason}
                       for d in report.damage],
            "unchecked": report.unchecked, "repair": report.repairs(attrs)}, indent=2))
    else:
        typer.echo(f"{store_path}: {report.checked} chunk(s) checked, "
                   + ("no damage" if report.clean else f"{len(report.damage)} damaged"))
        for d in report.damage:
            typer.echo(f"  damaged: {d.describe()}")
        if not report.clean:
            typer.echo(f"damaged sequence(s): {seq_spans(seqs)}")
            for command in report.repairs(attrs) or ["recapture into a new --out"]:
                typer.echo(f"repair: {command}")
        if report.unchecked:
            note = f"store format {report.format} (before {CHECKSUM_FORMAT}): " if report.format < CHECKSUM_FORMAT \
                else ""
            typer.echo(f"{note}{', '.join(report.unchecked)} carry no checksums: their files' sizes and decoding "
                       "were checked, their values cannot be (recapture into a new --out to get checksums)")
    raise typer.Exit(0 if report.clean else 1)
