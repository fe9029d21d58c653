"""What every probe shares: the result type, the error type, the argument parser and the script runner.

A probe module defines NAME, `run(ds, ...) -> ProbeResult`, `add_arguments(parser)` and
`from_args(ds, args, sink) -> ProbeResult`; `run_module(NAME, argv)` runs it as a script, for both
`python -m deltalab.probes.NAME` (its `main()` is `exit_main(NAME)`) and `deltalab probe NAME`.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import xarray as xr

from deltalab.models.run_files import clean_json, deltalab_version
from deltalab.probes.core import ProbeError as ProbeError  # re-exported: probes import both from here
from deltalab.probes.core import ProbeResult as ProbeResult
from deltalab.store.cliparse import OneLineParser

# --- argument parsing ---------------------------------------------------------------------

_SIZE = re.compile(r"^\s*([0-9.]+)\s*([kKmMgGtT]?)i?[bB]?\s*$")


def parse_size(text: str) -> int:
    """'512MB', '2GiB', '1e9' -> bytes."""
    m = _SIZE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"cannot read size {text!r}: write e.g. 512MB or 2GB")
    scale = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def parse_int_list(text: str) -> list[int]:
    """'0,2,4-6' -> [0, 2, 4, 5, 6]."""
    out: list[int] = []
    try:
        for part in str(text).split(","):
            part = part.strip()
            if not part:
                continue
            if "-" in part:
                lo, hi = part.split("-", 1)
                out.extend(range(int(lo), int(hi) + 1))
            else:
                out.append(int(part))
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: write integers like 0,2,4-6") from None
    return out


def make_parser(name: str, description: str, *, checkpoint: bool = False) -> argparse.ArgumentParser:
    """The options every probe takes; the probe adds its own with `add_arguments`."""
    p = OneLineParser(prog=f"deltalab probe {name}", description=description)
    p.add_argument("--store", required=True, help="store folder written by `deltalab capture`")
    p.add_argument("--checkpoint", required=checkpoint, default=None,
                   help="checkpoint folder" + (" (required)" if checkpoint else
                                               " (optional: its run files give the training length)"))
    p.add_argument("--json", action="store_true", help="print the records as a JSON list on stdout")
    p.add_argument("--layers", type=parse_int_list, default=None, help="layers to analyse, e.g. 0,2-3 (default all)")
    p.add_argument("--max-seqs", type=int, default=None, help="use only the first N complete sequences")
    p.add_argument("--memory-budget", type=parse_size, default=parse_size("1GB"),
                   help="bytes of store data held at once (default 1GB); larger stores are streamed")
    p.add_argument("--device", default="auto", type=_device, help="auto (cuda if available), cpu or cuda")
    p.add_argument("--no-write", action="store_true", help="compute and print, do not write into the store")
    p.add_argument("--name", default=None, help=f"results group name (default {name}): STORE/results/NAME")
    p.add_argument("--scheduler", default="threads",
                   help="where dask runs the blocks: threads (default, this process), local (a dask.distributed "
                        "cluster of worker processes on this machine) or a scheduler address (tcp://HOST:8786)")
    return p


def _device(text: str) -> str:
    """argparse type of --device: models.devices.check_device, its message as argparse's one line."""
    from deltalab.models.devices import check_device

    try:
        return check_device(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a device deltalab runs on: use auto, cpu, cuda, "
                                         "cuda:N or mps") from None


@contextmanager
def scheduler(spec: str) -> Iterator[None]:
    """Run the probe's dask graph on `spec`: the threaded scheduler, a local dask.distributed cluster, or the
    cluster at an address (its workers must see the store's path). ValueError (one line) when it cannot connect."""
    if spec == "threads":
        yield
        return
    try:
        from distributed import Client
    except ImportError:  # pragma: no cover - distributed is a dependency
        raise ValueError("--scheduler needs the `distributed` package: pip install distributed") from None
    try:
        client = Client(dashboard_address=None) if spec == "local" else Client(spec, timeout="10s")
    except (OSError, TimeoutError, ValueError) as err:
        why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"--scheduler {spec}: cannot reach a dask scheduler there ({why}); start one "
                         "(`dask scheduler` and `dask worker ADDRESS`) or use --scheduler threads") from None
    with client:
        yield


# --- running a probe as a script ----------------------------------------------------------

ProbeFn = Callable[[xr.Dataset, argparse.Namespace, Any], ProbeResult]


def error_line(err: BaseException, store: str | Path) -> str:
    """One line for a probe's failure (a corrupt chunk: `store.errors.corrupt_chunk_line`)."""
    from deltalab.store.errors import corrupt_chunk_line

    if _disk_full(err):
        return (f"the disk holding {store} is full (no space left for the results): free space there, or pass "
                "--no-write to print the records without storing them; the earlier results are kept")
    return corrupt_chunk_line(err, store) or (str(err).strip().splitlines()[0] if str(err).strip()
                                                else type(err).__name__)


def _disk_full(err: BaseException | None) -> bool:
    """Whether `err` (or an exception it was raised from) is 'no space left on device'."""
    import errno

    seen = 0
    while err is not None and seen < 8:
        if (isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)) or "[Errno 28]" in str(err):
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


def cli_main(name: str, description: str, add_arguments: Callable[[argparse.ArgumentParser], None],
             from_args: ProbeFn, argv: Sequence[str] | None = None, *, checkpoint: bool = False,
             writes: bool = True) -> int:
    """Parse argv, open the store, run the probe, write results with provenance, print records.

    Bad input prints one line on stderr and exits 2; nothing already in the store is touched.
    """
    parser = make_parser(name, description, checkpoint=checkpoint)
    add_arguments(parser)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    sink = None
    try:
        from deltalab.probes import data, results

        ds = data.open_store(args.store)
        ds = data.select(ds, layers=args.layers, max_seqs=args.max_seqs)
        heads = data.head_numbers(ds)  # capture --heads: probes see positions, results get the model's numbers
        ds = data.positional_heads(ds)
        out_name = args.name or name
        if writes and not args.no_write:  # staged: a failed run leaves the earlier results as they were
            sink = results.ResultSink(args.store, out_name, provenance(name, args, ds, argv), heads=heads, staged=True)
        with scheduler(args.scheduler):
            result = from_args(ds, args, sink)
            result.dataset, result.records = data.relabel_heads(result.dataset, result.records, heads)
            if sink is not None:
                sink.finish(result)
    except (ValueError, KeyError, OSError, RuntimeError) as err:  # bad input, failed write (disk full), corrupt chunk
        if sink is not None:
            sink.abort()
        from deltalab.store.errors import reraise_unless_input_error

        reraise_unless_input_error(err)
        from deltalab.store.display import inert

        print(f"error: {inert(error_line(err, args.store))}", file=sys.stderr)
        return 2
    except BaseException:  # any other failure (or Ctrl-C): drop the partial group, keep the earlier results
        if sink is not None:
            sink.abort()
        raise
    if args.json:
        print(result.to_json())
    else:
        print_summary(result, written=f"{args.store}/results/{out_name}" if sink is not None else None)
    return 0


def run_module(name: str, argv: Sequence[str] | None = None, module: ModuleType | None = None) -> int:
    """Run probe module `probes.<name>` (or `module`) as a script; returns the exit code (shared by both entry points).

    The module provides NAME, a docstring, add_arguments and from_args; optional NEEDS_CHECKPOINT
    (bool) and WRITES (bool, default True: results go into the store).
    """
    import importlib

    module = module or importlib.import_module(f"deltalab.probes.{name}")
    description = (module.__doc__ or name).strip().splitlines()[0]
    try:
        return cli_main(module.NAME, description, module.add_arguments, module.from_args, argv,
                        checkpoint=getattr(module, "NEEDS_CHECKPOINT", False), writes=getattr(module, "WRITES", True))
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    except BrokenPipeError:  # `... --json | head`: the reader left, not an error of ours
        sys.stderr.close()
        return 0


def exit_main(name: str, argv: Sequence[str] | None = None) -> None:
    """`python -m deltalab.probes.<name>`: `run_module` then `sys.exit` with its code."""
    sys.exit(run_module(name, argv))


def provenance(name: str, args: argparse.Namespace, ds: xr.Dataset, argv: Sequence[str] | None) -> dict[str, Any]:
    """Attributes written with every result: probe, parameters, versions, source-store identity."""
    from datetime import datetime, timezone

    params = {k: v for k, v in vars(args).items() if k not in ("json",)}
    source = {k: ds.attrs.get(k) for k in ("checkpoint_digest", "data_spec", "deltalab_format", "model_config",
                                            "train_length") if k in ds.attrs}
    return clean_json({
        "probe": name,
        "params": params,
        "deltalab_version": deltalab_version(),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command_line": ["deltalab", "probe", name, *(sys.argv[1:] if argv is None else argv)],
        "source": source,
        "n_seq": int(ds.sizes.get("seq", 0)),
        "layers": [int(x) for x in ds["layer"].values] if "layer" in ds.coords else None,
    })


def print_summary(result: ProbeResult, written: str | None, max_rows: int = 40) -> None:
    """A compact table of the records for people (the --json output is for programs)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    records = result.records
    if not records:
        console.print(f"[bold]{result.name}[/]: no records")
    else:
        scalar_keys = result.summary_keys or [k for k, v in records[0].items()
                                              if not isinstance(v, (list, dict))][:10]
        table = Table(title=f"probe {result.name} ({len(records)} records)")
        for k in scalar_keys:
            table.add_column(_fmt(k))
        for rec in records[:max_rows]:
            table.add_row(*[_fmt(rec.get(k)) for k in scalar_keys])
        console.print(table)
        if len(records) > max_rows:
            console.print(f"... {len(records) - max_rows} more (use --json for all)")
    if written:
        from deltalab.store.display import inert

        console.print(f"results written to {escape(inert(written))}")


def _fmt(v: Any) -> str:
    """A record's value as table text: rich markup and control characters from stored strings made inert."""
    from rich.markup import escape

    from deltalab.store.display import inert

    if isinstance(v, float | np.floating):
        return f"{v:.4g}"
    return "" if v is None else escape(inert(v))
