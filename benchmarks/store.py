"""Capture benchmark: `python -m benchmarks.store [--device cpu|cuda] [--json-out bench.json]`.

Measures, in one run:
- capture throughput (default hooks, nnsight, store writes) vs the plain forward at the same batch size;
- the store's write rate vs a raw `dd` write of the same number of bytes (both to the page cache of
  the same folder, and with fdatasync);
- memory as the number of captured sequences grows 10x: each capture runs in a fresh process, and the
  RSS it adds above the process's warmed-up baseline is sampled while it runs.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _model(args: argparse.Namespace) -> Any:
    import torch

    from deltalab.models import DeltaProductForCausalLM, ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig(model_type="gated_deltaproduct", vocab_size=24, hidden_size=args.hidden,
                      num_hidden_layers=args.layers, num_heads=args.heads, head_dim=args.hidden // args.heads,
                      expand_v=1.0, num_householder=2, use_forget_gate=True, use_output_gate=False,
                      use_short_conv=False, allow_neg_eigval=True)
    return DeltaProductForCausalLM(cfg).to(args.device).eval()


def _spec(args: argparse.Namespace, samples: int) -> str:
    return f"S4:length={args.length},samples={samples},seed=0"


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_throughput(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Tokens/s of the plain forward and of a full capture (default hooks), same batches."""
    import numpy as np
    import torch

    from deltalab.models import save_checkpoint
    from deltalab.store import capture, info, schema
    from deltalab.store.data import load_data
    from deltalab.store.runner import HookedRunner

    model = _model(args)
    ckpt = save_checkpoint(model.cpu(), work / "ckpt")
    model.to(args.device)
    data = load_data(_spec(args, args.samples))
    x = torch.from_numpy(data.tokens.astype(np.int64)).to(args.device)
    with torch.no_grad():  # warm up kernels and imports
        model(x[: args.batch_size])
    capture(ckpt, _spec(args, args.batch_size), work / "warm.zarr", batch_size=args.batch_size,
            device=args.device, dtype=args.dtype, progress=False, model=model)
    plain = captured = plain_cpu = captured_cpu = traced = float("inf")
    out = work / "bench.zarr"
    runner = HookedRunner(model, schema.variables_for(list(schema.DEFAULT_HOOKS), gated=True),
                          list(range(args.layers)), args.dtype, data.num_classes)
    stages: dict[str, float] = {}
    for _ in range(args.repeats):  # alternate, keep the best of each: fair on a busy machine
        _sync(args.device)
        t = time.perf_counter()
        for a in range(0, len(x), args.batch_size):  # the capture without the store: nnsight + host copies
            runner(data.tokens[a:a + args.batch_size], data.labels[a:a + args.batch_size],
                   data.doc_start[a:a + args.batch_size]).arrays()
        traced = min(traced, time.perf_counter() - t)
        _sync(args.device)
        t, c = time.perf_counter(), time.process_time()
        with torch.no_grad():
            for a in range(0, len(x), args.batch_size):
                model(x[a:a + args.batch_size])
        _sync(args.device)
        plain, plain_cpu = min(plain, time.perf_counter() - t), min(plain_cpu, time.process_time() - c)
        shutil.rmtree(out, ignore_errors=True)
        t, c = time.perf_counter(), time.process_time()
        summary = capture(ckpt, data, out, batch_size=args.batch_size, device=args.device, dtype=args.dtype,
                          progress=False, model=model)
        if time.perf_counter() - t < captured:
            stages = {"writer_busy_s": summary["writer_busy_s"], "model_blocked_s": summary["model_blocked_s"]}
        captured, captured_cpu = min(captured, time.perf_counter() - t), min(captured_cpu, time.process_time() - c)
    tokens = data.tokens.size
    summary = info(out)
    return {"tokens": int(tokens), "plain_tok_s": tokens / plain, "capture_tok_s": tokens / captured,
            "capture_over_plain": plain / captured, "store_bytes": summary["stored_bytes"],
            "traced_tok_s": tokens / traced, "traced_over_plain": plain / traced, **stages,
            "plain_s": plain, "capture_s": captured, "plain_cpu_s": plain_cpu, "capture_cpu_s": captured_cpu,
            "capture_over_plain_cpu": plain_cpu / captured_cpu}


def bench_write(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """StoreWriter rate on captured-shaped arrays vs `dd` of the same byte count into the same folder."""
    import numpy as np

    from deltalab.store import schema
    from deltalab.store.writer import StoreWriter

    src = work / "bench.zarr"
    attrs = json.loads((src / "zarr.json").read_text())["attributes"]
    n = args.samples
    sizes = attrs["sizes"]
    rng = np.random.default_rng(0)
    batches = []
    for a in range(0, n, args.batch_size):
        b = min(n, a + args.batch_size)
        arrays = {}
        for v in attrs["variables"]:
            if v == "complete":
                continue
            shape = schema.shape_of(v, {**sizes, "seq": b - a})
            layered = schema.VARIABLES[v].dims[1] == "layer"  # as the capture hands them: layer-major buffers
            values = rng.standard_normal((shape[1], shape[0], *shape[2:]) if layered else shape)
            values = values.astype(schema.storage_dtype(v, attrs["dtype"]))
            arrays[v] = values.swapaxes(0, 1) if layered else values
        batches.append((a, arrays))
    nbytes = sum(arr.nbytes for _, arrays in batches for arr in arrays.values())
    keep = {k: attrs[k] for k in attrs if k not in ("segments", "data_spec")}
    store_s = float("inf")
    for r in range(args.repeats):
        w, seg = StoreWriter.create_or_append(work / f"write{r}.zarr", keep, "bench", n)
        t = time.perf_counter()
        for a, arrays in batches:
            w.write_batch(a, arrays)
        store_s = min(store_s, time.perf_counter() - t)
    mb = max(1, round(nbytes / 2**20))

    def dd(extra: list[str]) -> float:
        target = work / "dd.bin"
        t0 = time.perf_counter()
        subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={mb}", *extra],
                       check=True, capture_output=True)
        dt = time.perf_counter() - t0
        target.unlink()
        return dt

    dd_s = min(dd([]) for _ in range(args.repeats))
    dd_sync_s = min(dd(["conv=fdatasync"]) for _ in range(args.repeats))
    return {"bytes": nbytes, "store_MB_s": nbytes / store_s / 1e6, "dd_MB_s": mb * 2**20 / dd_s / 1e6,
            "dd_fdatasync_MB_s": mb * 2**20 / dd_sync_s / 1e6,
            "store_over_dd": (nbytes / store_s) / (mb * 2**20 / dd_s)}


def _child(args: argparse.Namespace, samples: int, work: Path) -> dict[str, Any]:
    """Run one capture of `samples` sequences in a fresh process; return its peak RSS and Python-heap peak."""
    cmd = [sys.executable, "-m", "benchmarks.store", "--child", str(samples), "--work", str(work)]
    for key in ("length", "batch_size", "hidden", "heads", "layers", "device", "dtype", "threads"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "child failed")
    return json.loads(res.stdout.strip().splitlines()[-1])


class _RssPeak:
    """Peak resident memory while active, sampled from /proc every 5 ms (ru_maxrss where /proc is missing)."""

    def __init__(self) -> None:
        import threading

        self.peak_kb = self.now_kb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now_kb() -> int:
        try:
            pages = int(Path("/proc/self/statm").read_text().split()[1])
            return pages * os.sysconf("SC_PAGE_SIZE") // 1024
        except (OSError, ValueError, IndexError):
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak_kb = max(self.peak_kb, self.now_kb())

    def __enter__(self) -> _RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_kb = max(self.peak_kb, self.now_kb())


def child_main(args: argparse.Namespace) -> None:
    """One capture in a fresh process: RSS growth above the warmed-up baseline, and the Python-heap peak."""
    import tracemalloc

    from deltalab.models import save_checkpoint
    from deltalab.store import capture

    work = Path(args.work)
    model = _model(args)
    ckpt = work / "ckpt-child"
    if not ckpt.exists():
        save_checkpoint(model.cpu(), ckpt)
        model.to(args.device)
    kw = dict(batch_size=args.batch_size, device=args.device, dtype=args.dtype, progress=False, model=model)
    warm = work / f"mem-warm-{args.child}.zarr"
    shutil.rmtree(warm, ignore_errors=True)
    capture(ckpt, _spec(args, args.batch_size), warm, **kw)  # kernels, imports, allocator pools: not the data's
    out = work / f"mem-{args.child}.zarr"
    shutil.rmtree(out, ignore_errors=True)
    baseline_kb = _RssPeak.now_kb()
    tracemalloc.start()
    with _RssPeak() as rss:
        capture(ckpt, _spec(args, args.child), out, **kw)
    _, heap_peak = tracemalloc.get_traced_memory()
    print(json.dumps({"samples": args.child, "baseline_rss_MB": baseline_kb / 1024,
                      "capture_rss_growth_MB": (rss.peak_kb - baseline_kb) / 1024,
                      "peak_rss_MB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "python_heap_peak_MB": heap_peak / 2**20,
                      "store_MB": sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 2**20}))


def bench_memory(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The same capture at n and 10n sequences. n defaults to 10 batches: past the first QUEUE_DEPTH + 2 the
    write pipeline is full, so both runs reach the bound on batches held in memory at once."""
    from deltalab.store.capture import QUEUE_DEPTH

    n = args.mem_samples or 10 * args.batch_size
    small = _child(args, n, work)
    large = _child(args, n * 10, work)
    batch_mb = small["store_MB"] / math.ceil(n / args.batch_size)
    return {"small": small, "large": large, "rss_ratio": large["peak_rss_MB"] / small["peak_rss_MB"],
            "pipeline_bound_MB": (QUEUE_DEPTH + 2) * batch_mb,
            "growth_ratio": large["capture_rss_growth_MB"] / max(small["capture_rss_growth_MB"], 1.0),
            "heap_ratio": large["python_heap_peak_MB"] / max(small["python_heap_peak_MB"], 1e-9)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.store", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--samples", type=int, default=64, help="sequences for the throughput run")
    p.add_argument("--repeats", type=int, default=3, help="runs of each timing (best kept)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--mem-samples", type=int, default=None,
                   help="sequences of the small memory run (default: 10 batches; large: 10x)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--skip-memory", action="store_true", help="skip the 1x/10x memory runs")
    p.add_argument("--json-out", default="store-bench.json")
    p.add_argument("--work", default=None, help="scratch folder (default: a temp dir, removed after)")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.child is not None:
        child_main(args)
        return 0
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="deltalab-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        thr = bench_throughput(args, work)
        wr = bench_write(args, work)
        mem = None if args.skip_memory else bench_memory(args, work)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    import platform

    result = {"config": {k: v for k, v in vars(args).items() if k not in ("child", "work", "json_out", "repeats")},
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load": os.getloadavg()},
              "throughput": thr, "write": wr, "memory": mem}
    rows = [
        ("plain forward", f"{thr['plain_tok_s']:,.0f} tok/s", ""),
        ("capture (default hooks)", f"{thr['capture_tok_s']:,.0f} tok/s",
         f"{thr['capture_over_plain']:.0%} of plain wall (target >= 50%); "
         f"CPU time {thr['capture_over_plain_cpu']:.0%}"),
        ("  of which: nnsight + copies", f"{thr['traced_tok_s']:,.0f} tok/s",
         f"{thr['traced_over_plain']:.0%} of plain (no store); writer busy {thr['writer_busy_s']:.2f} s, "
         f"model waiting on it {thr['model_blocked_s']:.2f} s of {thr['capture_s']:.2f} s"),
        ("store write", f"{wr['store_MB_s']:,.0f} MB/s", f"{wr['store_over_dd']:.0%} of dd"),
        ("dd (page cache)", f"{wr['dd_MB_s']:,.0f} MB/s", f"fdatasync: {wr['dd_fdatasync_MB_s']:,.0f} MB/s"),
    ]
    if mem is not None:
        rows += [
            (f"RSS growth, {mem['small']['samples']} seqs", f"{mem['small']['capture_rss_growth_MB']:,.0f} MB",
             f"above {mem['small']['baseline_rss_MB']:,.0f} MB after warm-up; "
             f"store {mem['small']['store_MB']:,.0f} MB"),
            (f"RSS growth, {mem['large']['samples']} seqs", f"{mem['large']['capture_rss_growth_MB']:,.0f} MB",
             f"x{mem['growth_ratio']:.2f} for 10x data (store {mem['large']['store_MB']:,.0f} MB); "
             f"bound: {mem['pipeline_bound_MB']:,.0f} MB of batches in flight"),
        ]
    width = max(len(r[0]) for r in rows)
    print(f"store bench ({args.device}, {args.dtype}, B={args.batch_size}, T={args.length}, "
          f"hidden={args.hidden}, layers={args.layers}, threads={args.threads or 'default'})")
    for name, value, note in rows:
        print(f"  {name:<{width}}  {value:>16}  {note}")
    Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
