"""Throughput of the erank and spectra probes on a store: tokens and token-heads per second (nothing written).

Times the per-token part of each probe (state rebuild + SVD for erank; the n_h x n_h eigenproblem for
spectra), reading the store chunk by chunk as the probes do, on the chosen device (CUDA kernels
where present). `--repeat` takes the best of several runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import xarray as xr

from deltalab.probes import data
from deltalab.probes.base import ProbeResult, run_module

NAME = "bench"
WRITES = False
SUMMARY_KEYS = ["probe", "device", "tokens", "seconds", "tokens_per_s", "token_heads_per_s"]


def run(ds: xr.Dataset, *, probes: tuple[str, ...] = ("erank", "spectra"), repeat: int = 1, window: int = 4,
        budget: int = 1 << 30, device: str = "cpu") -> ProbeResult:
    """Time each probe's per-token computation over the whole of `ds`."""
    from deltalab.probes import erank, spectra

    builders = {"erank": lambda: erank.per_token(ds, budget=budget, device=device),
                "spectra": lambda: spectra.per_token(ds, window=window, budget=budget, device=device)}
    tokens = ds.sizes["seq"] * ds.sizes["pos"] * ds.sizes["layer"]
    heads = ds.sizes["head"]
    recs: list[dict[str, Any]] = []
    for name in probes:
        best = float("inf")
        for _ in range(max(1, repeat)):
            lazy = builders[name]()
            t0 = time.perf_counter()
            lazy.compute()
            best = min(best, time.perf_counter() - t0)
        recs.append({"probe": name, "device": device, "tokens": tokens, "heads": heads, "seconds": best,
                     "tokens_per_s": tokens / best, "token_heads_per_s": tokens * heads / best,
                     "n_seq": ds.sizes["seq"], "pos": ds.sizes["pos"], "layers": ds.sizes["layer"],
                     "n_h": ds.sizes["step"], "dk": ds.sizes["dk"], "dv": ds.sizes["dv"]})
    out = xr.Dataset({"tokens_per_s": ("probe", [r["tokens_per_s"] for r in recs]),
                      "seconds": ("probe", [r["seconds"] for r in recs])},
                     attrs={"probes": list(probes), "device": device})
    return ProbeResult(NAME, out, recs, SUMMARY_KEYS)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--probes", default="erank,spectra", help="comma list of erank, spectra")
    p.add_argument("--repeat", type=int, default=1, help="best of N runs")
    p.add_argument("--window", type=int, default=4, help="spectra window (as the probe)")


def from_args(ds: xr.Dataset, args: argparse.Namespace, sink: Any) -> ProbeResult:
    from deltalab.probes.base import ProbeError

    chosen = tuple(x.strip() for x in args.probes.split(",") if x.strip())
    bad = [x for x in chosen if x not in ("erank", "spectra")]
    if bad:
        raise ProbeError(f"--probes {','.join(bad)}: the benchmark times erank and spectra")
    return run(ds, probes=chosen, repeat=args.repeat, window=args.window, budget=args.memory_budget,
               device=data.pick_device(args.device))


def main(argv: list[str] | None = None) -> None:
    """`python -m benchmarks.probes --store STORE [--json]`."""
    sys.exit(run_module(NAME, argv, module=sys.modules[__name__]))


if __name__ == "__main__":
    main()
