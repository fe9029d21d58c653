"""`deltalab capture` end to end on a transformers hybrid, with and without reductions:
`python -m benchmarks.reduce_capture [--family F] [--default-config] [--batch 4 --length 2048] [--quick]`.

A random bf16 model built from its Config class on the GPU (as benchmarks.hf_capture). In one run: the plain
forward's tokens/s, then `store.capture` into a store on local disk in each mode, every number a share of the
plain forward measured in the same run:
- `states`: the default hooks, states included (`--dtype float16`): disk-bound at real sizes;
- `reduce`: `--hooks tokens,beta --reduce ranks,spectra` (q, k, v, g captured for the reductions, not stored);
- `reduce+states`: the same with `--keep states --state-every 8`;
- `hooks`: `--hooks tokens,beta` without reductions (capture's own cost: the traced forward, its copies).
Each mode first runs one batch into a throwaway store (compilation, allocator warm-up), then `--batches`
batches timed (use 6 or more at real sizes: the reducer's and writer's drain after the last forward is part of the
time). tokens/s counts the capture with its per-batch reductions; the summaries written once at the end
(`summary s`, the probes' own, growing with the tokens) are reported apart. Also: GPU memory peak, the forward's
wait for the reducer (`red. wait s`), `steady x`: the pace between the first and the last batch handed to the
writer as a share of the plain forward (a long capture's rate: without the last batch's reductions and writes
after the forward, which a 6-batch run counts in full), time in the reductions (`reduce s`, on their own thread
and CUDA stream, beside the forward), in writing their results (`write s`, the writer thread) and store bytes per token.
`--stages`: each reduction alone on one captured batch, the GPU otherwise idle (wall and kernel time).
`--profile`: the first reduce run's timed capture under torch.profiler (CUDA kernels included); the operators with
the most self time on the device and on the host, and deltalab's own stages, are printed after the table.
Diagnosis only: `--no-summary` (the end-of-run summaries skipped), `--no-write` (reductions computed, nothing of
them written), `--zarr-threads N` (zarr's codec pool), `--switch-interval S` (the GIL's hand-over between capture's
threads).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from benchmarks.hf_capture import DEVICE, _default_model, _model, _sync


def _data(n: int, length: int, vocab: int, seed: int):
    from deltalab.models import IGNORE_INDEX
    from deltalab.store.data import Data

    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, vocab, size=(n, length), dtype=np.int32)
    doc = np.zeros((n, length), bool)
    doc[:, 0] = True
    return Data(spec=f"random:length={length},samples={n},seed={seed}", tokens=tokens,
                labels=np.full((n, length), IGNORE_INDEX, np.int32), doc_start=doc)


def _everies(text: str) -> list[int | None]:
    """"auto,1024" -> [None, 1024] (None: CaptureReductions picks `auto_rank_every` for the model)."""
    return [None if e.strip() == "auto" else int(e) for e in text.split(",") if e.strip()]


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="olmo_hybrid", help="olmo_hybrid (default), qwen3_5_text or kimi_linear")
    p.add_argument("--default-config", action="store_true", help="the family's transformers default (real) size")
    p.add_argument("--quick", action="store_true", help="a small model and shape (a smoke run)")
    p.add_argument("--layers", type=int, default=None, help="layers of the small models (--quick or the default)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--batches", type=int, default=3, help="timed batches per mode")
    p.add_argument("--states-batches", type=int, default=None,
                   help="timed batches of the states mode (default: --batches; at 8 x 4096 a batch of every "
                        "state in float16 is 32 GB)")
    p.add_argument("--rank-every", default="auto", help="--rank-every values for the reduce mode (auto: capture's "
                   "CUDA default, probes.reduce.auto_rank_every)")
    p.add_argument("--reduce", default="ranks,spectra",
                   help="the reductions of the reduce modes; several sets separated by '+' (ranks,spectra+ranks)")
    p.add_argument("--modes", default="states,reduce,reduce+states")
    p.add_argument("--dir", default=None, help="where the stores go (default: a temporary folder)")
    p.add_argument("--json", default=None)
    p.add_argument("--switch-interval", type=float, default=None,
                   help="sys.setswitchinterval for the capture runs (GIL hand-over between capture's threads)")
    p.add_argument("--zarr-threads", type=int, default=None,
                   help="diagnosis: zarr's codec threads (default: asyncio's, min(32, cores + 4)); fewer leave cores "
                        "to the forward's launches")
    p.add_argument("--no-summary", action="store_true",
                   help="skip the probes' summaries at the end of each capture (not in tokens/s; they took 30 s per "
                        "6 batches of 8 x 4096 at a 7B model's size, and a 12-batch run timed out in them)")
    p.add_argument("--no-write", action="store_true",
                   help="diagnosis: compute the reductions but write none of them (nor their summaries)")
    p.add_argument("--stages", action="store_true",
                   help="after the runs: each reduction alone on one captured batch (idle GPU), wall and kernel time")
    p.add_argument("--profile", action="store_true", help="profile the first reduce run; print the top operators")
    p.add_argument("--profile-rows", type=int, default=20, help="operators per profile table (default 20)")
    args = p.parse_args()
    from deltalab.models.hf.families import FAMILIES
    from deltalab.models.hf.hooked import HookedHFModel
    from deltalab.probes.reduce import CaptureReductions
    from deltalab.store import capture

    torch.manual_seed(0)
    if args.quick:
        hf = _model(args.family, hidden=512, layers=args.layers or 4, k_heads=4, v_heads=8, head_dim=64)
        args.batch, args.length = 2, 512
    elif args.default_config:
        hf = _default_model(args.family)
    else:
        hf = _model(args.family, hidden=2048, layers=args.layers or 8, k_heads=8, v_heads=16, head_dim=128)
    text = hf.config.get_text_config()
    B, T = args.batch, args.length
    ids = torch.randint(3, min(32000, text.vocab_size), (B, T), device=DEVICE)
    with torch.no_grad():
        hf(ids, use_cache=False)
        _sync()
        t0 = time.perf_counter()
        for _ in range(3):
            hf(ids, use_cache=False)
        _sync()
        plain_s = (time.perf_counter() - t0) / 3
    print(f"[{time.strftime('%H:%M:%S')}] plain forward {plain_s * 1e3:.0f} ms", file=sys.stderr, flush=True)
    model = HookedHFModel(hf, FAMILIES[args.family])
    with torch.no_grad():  # the hooked model without nnsight: deltalab's kernel, chunk-boundary states formed
        model(ids)
        _sync()
        t0 = time.perf_counter()
        for _ in range(3):
            model(ids)
        _sync()
        hooked_s = (time.perf_counter() - t0) / 3
    print(f"[{time.strftime('%H:%M:%S')}] hooked forward (no nnsight) {hooked_s * 1e3:.0f} ms", file=sys.stderr,
          flush=True)
    root = Path(args.dir or tempfile.mkdtemp(prefix="deltalab-reduce-"))
    ckpt = root / "ckpt"
    ckpt.mkdir(parents=True, exist_ok=True)
    vocab = min(32000, text.vocab_size)
    rows = []
    plain_tok_s = B * T / plain_s
    runs: list[tuple[str, dict]] = []
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        if mode == "states":
            runs.append((mode, dict(hooks=None, dtype="float16")))
        elif mode == "hooks":
            runs.append((mode, dict(hooks=["tokens", "beta"])))
        elif mode in ("reduce", "reduce+states"):
            for names in args.reduce.split("+"):
                for every in _everies(args.rank_every):
                    kw = dict(hooks=["tokens", "beta"], names=names.split(","), every=every)
                    if mode == "reduce+states":
                        kw.update(hooks=["tokens", "beta", "state"], state_every=8)
                    runs.append((f"{mode} {names} (every {every or 'auto'})", kw))
        else:
            raise SystemExit(f"error: --modes {mode}: choose among states, hooks, reduce, reduce+states")
    if args.zarr_threads is not None:  # read when zarr makes its pool, at its first write below
        import zarr

        zarr.config.set({"threading.max_workers": args.zarr_threads})
    if args.no_write:  # the reductions' host side without their store writes (where does capture wait?)
        CaptureReductions.write = lambda self, path, attrs, start, reduced, n_seq: None
        CaptureReductions.finish = lambda self, path: {}
    if args.no_summary:  # timing runs only: the end-of-run summaries (not in tok/s) cost GPU time, ~5 s a batch
        CaptureReductions.finish = lambda self, path: {}
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    profiled: str | None = None
    tables: list[str] = []
    for label, kw in runs:
        profile_this = args.profile and profiled is None and "names" in kw
        for warm in (True, False):
            out = root / ("warm.zarr" if warm else "timed.zarr")
            shutil.rmtree(out, ignore_errors=True)
            timed = (args.states_batches or args.batches) if label == "states" else args.batches
            n = B if warm else B * timed
            red = CaptureReductions(kw["names"], device=DEVICE, rank_every=kw["every"]) if "names" in kw else None
            if DEVICE == "cuda":
                torch.cuda.reset_peak_memory_stats()
            run = partial(capture, ckpt, _data(n, T, vocab, seed=1 if warm else 2), out, model=model,
                          hooks=kw.get("hooks"), batch_size=B, device=DEVICE, dtype=kw.get("dtype", "float32"),
                          progress=False, state_every=kw.get("state_every", 1), reductions=red,
                          command_line=["benchmarks.reduce_capture"])
            if profile_this and not warm:
                summary, found = _profiled(run, args.profile_rows)
                profiled, tables = label, found
            else:
                summary = run()
            if warm:  # only the timed store is measured; the warm-up's would double the disk a mode needs
                shutil.rmtree(out, ignore_errors=True)
        finish = red.seconds["finish"] if red is not None else 0.0
        tok_s = n * T / (summary["seconds"] - finish)
        if red is not None and kw["every"] is None and "ranks" in kw["names"]:
            label = label.replace("every auto", f"every auto: {red.rank_every}")
        steady = summary.get("steady_s_per_batch")
        steady_share = B * T / steady / plain_tok_s if steady else float("nan")
        rows.append({"mode": label, "tokens": n * T, "tok_s": tok_s, "steady_share_of_plain": steady_share,
                     "share_of_plain": tok_s / plain_tok_s, "finish_s": finish,
                     "reduce_s": red.seconds["batches"] if red is not None else 0.0,
                     "compute_s": red.seconds["compute"] if red is not None else 0.0,
                     "gpu_peak_gb": torch.cuda.max_memory_allocated() / 1e9 if DEVICE == "cuda" else float("nan"),
                     "store_bytes_per_token": _dir_bytes(out) / (n * T), "seconds": summary["seconds"],
                     "writer_busy_s": summary["writer_busy_s"], "model_blocked_s": summary["model_blocked_s"],
                     "reduce_wait_s": summary["reduce_wait_s"]})
        shutil.rmtree(out, ignore_errors=True)
        print(f"[{time.strftime('%H:%M:%S')}] {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    stages = _stages(partial(capture, ckpt, _data(B, T, vocab, seed=3), root / "stages.zarr", model=model,
                             hooks=["tokens", "beta"], batch_size=B, device=DEVICE, progress=False,
                             command_line=["benchmarks.reduce_capture"]),
                     args.reduce.split("+")[0].split(","), _everies(args.rank_every)[0], args.profile_rows) \
        if args.stages else []
    shutil.rmtree(root, ignore_errors=True)
    params = sum(p.numel() for p in hf.parameters()) / 1e9
    print(f"{args.family} {params:.2f}B params, bf16, B x T = {B} x {T}, "
          f"{torch.cuda.get_device_name() if DEVICE == 'cuda' else 'cpu'}; plain forward {plain_s * 1e3:.0f} ms "
          f"({plain_tok_s:,.0f} tok/s); hooked forward without nnsight {hooked_s * 1e3:.0f} ms "
          f"({plain_s / hooked_s:.2f} x plain)")
    print(f"{'mode':<34} {'tok/s':>10} {'x plain':>8} {'steady x':>8} {'GPU GB':>7} {'store B/tok':>12} "
          f"{'blocked s':>9} {'red. wait s':>11} {'reduce s':>8} {'write s':>8} {'summary s':>9}")
    for r in rows:
        print(f"{r['mode']:<34} {r['tok_s']:>10,.0f} {r['share_of_plain']:>8.2f} "
              f"{r['steady_share_of_plain']:>8.2f} {r['gpu_peak_gb']:>7.1f} "
              f"{r['store_bytes_per_token']:>12,.0f} {r['model_blocked_s']:>9.2f} {r['reduce_wait_s']:>11.2f} "
              f"{r['compute_s']:>8.2f} {r['reduce_s']:>8.2f} "
              f"{r['finish_s']:>9.2f}")
    if stages:
        print("\n".join(stages))
    if profiled is not None:
        print(f"\nprofile of `{profiled}` (timed batches; its tokens/s above are under the profiler's overhead):")
        print("\n".join(tables))
    if args.json:
        Path(args.json).write_text(json.dumps({"family": args.family, "params_b": params, "batch": B, "length": T,
                                               "plain_tok_s": plain_tok_s, "hooked_s": hooked_s, "rows": rows,
                                               "profiled": profiled},
                                              indent=1))


def _stages(run, names: list[str], every: int | None, rows: int) -> list[str]:
    """Each reduction alone on one captured batch, the GPU otherwise idle: wall time, kernel time, top kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from deltalab.probes.reduce import CaptureReductions

    kept: dict = {}
    compute = CaptureReductions.compute

    def spy(self, attrs, tensors, host):
        kept.update(red=self, args=(attrs, tensors, host))
        return compute(self, attrs, tensors, host)

    CaptureReductions.compute = spy
    try:
        run(reductions=CaptureReductions(names, device=DEVICE, rank_every=every))
    finally:
        CaptureReductions.compute = compute
    red, lines = kept["red"], ["reductions alone on one batch (GPU otherwise idle):",
                               f"{'reduction':<12} {'wall s':>8} {'kernels s':>10}"]
    tops = []
    for name in names:
        red.names = [name]
        compute(red, *kept["args"])  # warm
        _sync()
        t0 = time.perf_counter()
        compute(red, *kept["args"])
        _sync()
        wall = time.perf_counter() - t0
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
        with profile(activities=activities) as prof:
            compute(red, *kept["args"])
            _sync()
        events = prof.key_averages()
        gpu = sum(e.time_range.elapsed_us() for e in prof.events()  # kernels and copies on the device
                  if e.device_type == DeviceType.CUDA and not e.name.startswith("deltalab.")) / 1e6
        lines.append(f"{name:<12} {wall:>8.3f} {gpu:>10.3f}")
        tops += [f"\n{name}: top kernels", events.table(sort_by="self_cuda_time_total" if DEVICE == "cuda"
                                                         else "self_cpu_time_total", row_limit=rows)]
    return lines + tops


def _profiled(run, rows: int) -> tuple[dict, list[str]]:
    """run() under torch.profiler: its result and the operator tables by self GPU time and self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with profile(activities=activities) as prof:
        summary = run()
    _sync()
    events = prof.key_averages()
    tables = []
    if DEVICE == "cuda":
        tables += ["top operators by self CUDA time:", events.table(sort_by="self_cuda_time_total", row_limit=rows)]
    tables += ["top operators by self CPU time:", events.table(sort_by="self_cpu_time_total", row_limit=rows)]
    ours = sorted((e for e in events if e.key.startswith("deltalab.")), key=lambda e: -e.cpu_time_total)
    tables += ["deltalab's stages (host wall time on their thread, GPU time of the kernels they launched):",
               f"{'stage':<32} {'calls':>6} {'host s':>8} {'GPU s':>8}"]
    tables += [f"{e.key:<32} {e.count:>6} {e.cpu_time_total / 1e6:>8.3f} {e.device_time_total / 1e6:>8.3f}"
               for e in ours]
    return summary, tables


if __name__ == "__main__":
    main()
