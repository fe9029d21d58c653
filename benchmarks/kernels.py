"""The delta-rule forward against fla: `python -m benchmarks.kernels [--quick] [--json out.json] [--skip ...]`.

Forward table: every point of the original grid (B in {1, 8}, T in {2048, 8192}, H = 8, dk = dv = 128,
n_h in {1, 2, 3}, gate off/on, bf16) with our time, fla 0.6.0's `chunk_gated_delta_product` measured in
the same run, their ratio, and our distance to the memory and FLOP floors. Then the real-model
shapes (fla's GDN default, Qwen3-Next's grouped heads, DeltaProduct n_h = 2, 3 at fla's layer default) at
(B, T) = (1, 32768), (8, 4096) and a packed batch of mixed document lengths (fla with the same cu_seqlens),
with each side's first-call (compile/autotune) time. Then the accuracy check (max relative error vs a
float64 reference, and vs fla) and the analysis rows of `benchmarks.kernels_analysis`.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import itertools
import json
import math
import sys
import time
from dataclasses import replace
from functools import partial

import torch

# (peak bytes/s, dense bf16 FLOP/s) by device name; the first match wins
PEAKS = [
    ("H200", 4.8e12, 989e12),
    ("H100 PCIe", 2.0e12, 756e12),
    ("H100 NVL", 3.9e12, 835e12),
    ("H100", 3.35e12, 989e12),
    ("A100", 2.0e12, 312e12),
]
GRID = dict(B=(1, 8), T=(2048, 8192), H=8, K=128, n_h=(1, 2, 3), gate=(False, True))


def device_peaks() -> tuple[str, float, float]:
    name = torch.cuda.get_device_name(0)
    for key, bw, flops in PEAKS:
        if key in name:
            return name, bw, flops
    return name + " (unknown: H100 peaks assumed)", 3.35e12, 989e12


def floors(B: int, T: int, H: int, K: int, V: int, n_h: int, gate: bool, elt: int = 2) -> tuple[float, float]:
    """(bytes, FLOPs) a chunked forward cannot avoid: read q,k,v,beta,g once; write o, final and
    boundary states (fp32); matrix products of the WY/UT chunk algorithm with C = 64 tokens."""
    nc = math.ceil(T / 64) + 1
    read = elt * B * T * H * (K + n_h * (K + V) + n_h) + (4 * B * T * H if gate else 0)
    write = elt * B * T * H * V + 4 * B * H * K * V * (nc + 1)
    C, L = 64, 64 * n_h
    per_chunk = L * L * K + L * L * (K + V) + 4 * L * K * V + 2 * C * K * V + C * L * (K + V)
    return float(read + write), float(per_chunk * B * H * math.ceil(T / 64))


# real-model shapes: (name, key heads, value heads, dk, dv, n_h), gate on; fla's peer for n_h = 1 is its GDN kernel
REAL_SHAPES = [
    ("GDN fla default", 6, 6, 256, 512, 1),
    ("Qwen3-Next grouped", 16, 32, 128, 128, 1),
    ("DeltaProduct n_h=2", 6, 6, 256, 512, 2),
    ("DeltaProduct n_h=3", 6, 6, 256, 512, 3),
]
REAL_SIZES = [(1, 32768), (8, 4096), ("varlen", 32768)]
# --sweep at the real rows, each a change of default_config's choice: pipeline stages of the sequential kernel, its
# value tile and path, and the output kernel's key block, value tile and loops
SWEEP_REAL = [
    {}, dict(state_stages=2), dict(state_stages=3), dict(state_bv=32), dict(state_bv=64),
    dict(state_keys_ws=True), dict(state_keys_ws=False), dict(out_bv=64), dict(out_bk=128), dict(out_bk=256),
    dict(out_prefetch=False), dict(out_aqk=False, out_pair=False),
]  # fmt: skip
SWEEP_REAL_VARLEN = [{}, dict(state_stages=2), dict(state_stages=3), dict(state_keys_ws=False)]


def mixed_lengths(total: int, seed: int = 0, lo: int = 16, hi: int = 8192) -> list[int]:
    """Document lengths log-uniform in [lo, hi] (so mostly not multiples of 64), summing to total."""
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while sum(out) < total:
        n = int(math.exp(math.log(lo) + torch.rand(1, generator=gen).item() * math.log(hi / lo)))
        out.append(min(n, total - sum(out)))
    return out


def real_floors(lengths: list[int], Hk, Hv, K, V, n_h, elt: int = 2) -> tuple[float, float]:
    """(bytes, FLOPs) as `floors`, for sequences of the given lengths, Hk key and Hv value heads, gate on."""
    tok = sum(lengths)
    nb = sum(math.ceil(n / 64) + 1 for n in lengths)
    nc = sum(math.ceil(n / 64) for n in lengths)
    read = elt * tok * (Hk * K * (1 + n_h) + Hv * n_h * (V + 1)) + 4 * tok * Hv
    write = elt * tok * Hv * V + 4 * Hv * K * V * (nb + len(lengths))
    C, L = 64, 64 * n_h
    per_chunk = L * L * K + L * L * (K + V) + 4 * L * K * V + 2 * C * K * V + C * L * (K + V)
    return float(read + write), float(per_chunk * Hv * nc)


def make_real_inputs(B, T, Hk, Hv, K, V, n_h, dtype=torch.bfloat16, seed=0):
    """q, k with Hk heads; v, beta, g with Hv heads; gate on; beta in (0, 2) as OLMo-Hybrid allows."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, T, Hk, K, device="cuda", generator=gen).to(dtype)
    k = torch.randn(B, T, n_h, Hk, K, device="cuda", generator=gen).to(dtype)
    v = torch.randn(B, T, n_h, Hv, V, device="cuda", generator=gen).to(dtype)
    beta = (torch.rand(B, T, n_h, Hv, device="cuda", generator=gen) * 2).to(dtype)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, Hv, device="cuda", generator=gen) + 3)
    return q, k, v, beta, g


def fla_real_call(q, k, v, beta, g, cu_seqlens=None):
    """fla 0.6.0 on our layout: its GDN kernel (grouped value heads) for n_h = 1, else its delta product."""
    from fla.ops.gated_delta_product import chunk_gated_delta_product
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    B, T, n_h, Hk, K = k.shape
    Hv, V = v.shape[3], v.shape[4]
    if n_h == 1:
        return chunk_gated_delta_rule(
            q, k[:, :, 0], v[:, :, 0], g, beta[:, :, 0], output_final_state=True, use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu_seqlens,
        )  # fmt: skip
    return chunk_gated_delta_product(
        q, k.reshape(B, T * n_h, Hk, K), v.reshape(B, T * n_h, Hv, V), g, beta.reshape(B, T * n_h, Hv),
        num_householder=n_h, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens,
    )  # fmt: skip


def first_call_s(fn) -> float:
    """Seconds of one synchronised call (at a new shape: compilation and autotuning included)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def bench_real(bw: float, peak: float, log, rows: list, dump, only: str = "", sweep: bool = False) -> list[dict]:
    """The real-model rows: shapes at (1, 32768), (8, 4096) and a packed batch of mixed lengths."""
    from deltalab.kernels.delta_rule.triton_chunk import default_config, triton_delta_product

    fla, why = load_fla()
    lengths = mixed_lengths(REAL_SIZES[-1][1])
    log("\n== real-model shapes (bf16, gate on, beta in (0,2)): ours vs fla 0.6.0 (GDN kernel for n_h=1) ==")
    log(f"   varlen: {len(lengths)} documents, {sum(lengths)} tokens, lengths {min(lengths)}-{max(lengths)}")
    log("   first: seconds of the first call at the shape (compile + fla's autotuning), ours / fla.")
    log(f"   ms: each side's fastest of {ROUNDS} medians (do_bench), the sides taking turns.")
    if fla is None:
        log(f"   fla column empty: {why}")
    log("   ours: o, final and fp32 boundary states; o+fin: ours returning what fla returns (o and final state; the")
    log("   boundary states it still writes for its output kernel are then bf16, o bit-identical).")
    head = ["shape", "Hk/Hv", "dk/dv", "B x T", "ours ms", "o+fin ms", "fla ms", "fla/ours", "fla/o+fin",
            "mem floor", "x floor", "first s"]
    widths = [18, 5, 7, 10, 8, 8, 8, 8, 9, 9, 7, 11]
    log(_fmt_row(head, widths))
    for name, Hk, Hv, K, V, n_h in REAL_SHAPES:
        if only and not any(o in name for o in only.split(",")):
            continue
        for B, T in REAL_SIZES:
            varlen = B == "varlen"
            x = make_real_inputs(1 if varlen else B, T, Hk, Hv, K, V, n_h)
            cu = torch.tensor([0, *itertools.accumulate(lengths)], device="cuda") if varlen else None
            ours = partial(triton_delta_product, *x, normalize_qk=True, cu_seqlens=cu)
            first_ours = first_call_s(ours)
            sides = dict(ours=ours, lean=partial(ours, output_boundary_states=False))
            first_fla = float("nan")
            if fla is not None:
                peer = partial(fla_real_call, *x, cu_seqlens=cu)
                try:
                    first_fla = first_call_s(peer)
                    sides["fla"] = peer
                except Exception as exc:  # noqa: BLE001 - a shape fla refuses is a result
                    log(f"      fla failed: {type(exc).__name__}: {str(exc)[:160]}")
            t = time_interleaved(sides)
            t_ours, t_lean, t_fla = t["ours"], t["lean"], t.get("fla", float("nan"))
            nbytes, nflop = real_floors(lengths if varlen else [T] * B, Hk, Hv, K, V, n_h)
            mem_ms = nbytes / bw * 1e3
            size = f"varlen {len(lengths)}" if varlen else f"{B}x{T}"
            r = dict(
                shape=name, Hk=Hk, Hv=Hv, K=K, V=V, n_h=n_h, B=B, T=T, varlen=varlen,
                lengths=lengths if varlen else None, ours_ms=t_ours, fla_ms=t_fla, speedup_vs_fla=t_fla / t_ours,
                ours_o_final_ms=t_lean, speedup_o_final_vs_fla=t_fla / t_lean,
                mem_floor_ms=mem_ms, x_mem_floor=t_ours / mem_ms, flop_floor_ms=nflop / peak * 1e3,
                first_call_ours_s=first_ours, first_call_fla_s=first_fla,
            )  # fmt: skip
            if sweep:  # launch choices, timed as the o+fin column (what fla returns)
                r["sweep"] = {}
                lean = partial(ours, output_boundary_states=False)
                base = default_config(len(lengths) if varlen else B, Hv, V, n_h, K)  # each choice: a change of it
                want = ours()[0].float()  # each choice's o against the default's (a miscompile shows here)
                r["sweep_err"] = {}
                choices = {}
                for kw in SWEEP_REAL if not varlen else SWEEP_REAL_VARLEN:
                    fn = partial(lean, config=dataclasses.replace(base, **kw))
                    try:
                        got = fn()[0].float()
                        r["sweep_err"][repr(kw)] = float((got - want).abs().max() / want.abs().max())
                        choices[repr(kw)] = fn
                    except Exception as exc:  # noqa: BLE001 - a config that does not fit is a result
                        r["sweep"][repr(kw)] = float("inf")
                        log(f"      config {kw} failed: {type(exc).__name__}: {str(exc)[:100]}")
                r["sweep"].update(time_interleaved(choices))  # timed as the o+fin column was
                log("      sweep (o+fin ms, o's max rel difference from the default's): " + ", ".join(
                    f"{k} {v:.3f} ({r['sweep_err'].get(k, float('nan')):.0e})" for k, v in r["sweep"].items()))
            rows.append(r)
            dump()
            log(
                _fmt_row(
                    [
                        name,
                        f"{Hk}/{Hv}",
                        f"{K}/{V}",
                        size,
                        f"{t_ours:.3f}",
                        f"{t_lean:.3f}",
                        f"{t_fla:.3f}",
                        f"{t_fla / t_ours:.2f}x",
                        f"{t_fla / t_lean:.2f}x",
                        f"{mem_ms:.3f}",
                        f"{t_ours / mem_ms:.1f}x",
                        f"{first_ours:.1f}/{first_fla:.1f}",
                    ],
                    widths,
                )  # fmt: skip
            )
            del x
            torch.cuda.empty_cache()
    log(real_verdict(rows))
    return rows


def _verdict(rows: list[dict], what: str, unit: str, where) -> tuple[str, list[dict]]:
    """The 1.3x target's line over `rows` (`what`: "real shape" or "grid point"): judged on o+fin (the outputs fla
    returns), with the strict column's worst beside it; `where(row)` names the worst. Also the rows fla ran at."""
    ok = [r for r in rows if r["speedup_o_final_vs_fla"] == r["speedup_o_final_vs_fla"]]  # fla ran
    if not ok:
        return f"   target >= 1.3x fla on every {what}: not judged (fla did not run)", ok
    worst = min(ok, key=lambda r: r["speedup_o_final_vs_fla"])
    missed = [r for r in ok if r["speedup_o_final_vs_fla"] < 1.3]
    verdict = "MET" if not missed else f"NOT MET at {len(missed)} of {len(ok)} {unit}"
    return (
        f"   target >= 1.3x fla on every {what} (o+fin, the outputs fla returns): {verdict} (worst"
        f" {worst['speedup_o_final_vs_fla']:.2f}x: {where(worst)}); with fp32 boundary states too, worst"
        f" {min(r['speedup_vs_fla'] for r in ok):.2f}x"
    ), ok


def real_verdict(rows: list[dict]) -> str:
    """The real rows' 1.3x line (`_verdict`), with the slowest first call of ours."""
    line, ok = _verdict(rows, "real shape", "rows",
                        lambda r: f"{r['shape']} " + ("varlen" if r["varlen"] else f"B={r['B']} T={r['T']}"))
    return line + f"; slowest first call of ours {max(r['first_call_ours_s'] for r in rows):.1f} s" if ok else line


def grid_verdict(rows: list[dict]) -> str:
    """The grid's 1.3x line (`_verdict`)."""
    return _verdict(rows, "grid point", "points",
                    lambda r: f"B={r['B']} T={r['T']} n_h={r['n_h']} gate {'on' if r['gate'] else 'off'}")[0]


def make_inputs(B, T, H, K, V, n_h, gate, dtype=torch.bfloat16, seed=0, h0=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, T, H, K, device="cuda", generator=gen).to(dtype)
    k = torch.randn(B, T, n_h, H, K, device="cuda", generator=gen).to(dtype)
    v = torch.randn(B, T, n_h, H, V, device="cuda", generator=gen).to(dtype)
    beta = (torch.rand(B, T, n_h, H, device="cuda", generator=gen) * 2).to(dtype)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device="cuda", generator=gen) + 3) if gate else None
    s0 = torch.randn(B, H, K, V, device="cuda", generator=gen) * 0.1 if h0 else None
    return q, k, v, beta, g, s0


NO_FLA = False  # --no-fla: time ours alone (fla's autotuning takes about a minute per new shape)


def load_fla():
    if NO_FLA:
        return None, "skipped (--no-fla)"
    try:
        from fla.ops.gated_delta_product import chunk_gated_delta_product
    except Exception as exc:  # noqa: BLE001 - any import failure means "no peer"
        return None, f"fla not importable ({type(exc).__name__}: {exc})"
    return chunk_gated_delta_product, None


def fla_call(fla, q, k, v, beta, g, s0=None):
    B, T, n_h, H, K = k.shape
    return fla(
        q,
        k.reshape(B, T * n_h, H, K),
        v.reshape(B, T * n_h, H, v.shape[-1]),
        g,
        beta.reshape(B, T * n_h, H),
        num_householder=n_h,
        initial_state=s0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )


def timeit(fn) -> float:
    """Median milliseconds (triton's do_bench: warm-up, L2 flushed between runs)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


ROUNDS = 3  # --rounds: interleaved timings of ours and fla at each point


def time_interleaved(fns: dict, rounds: int | None = None, timer=None) -> dict[str, float]:
    """Each callable timed `rounds` times, the sides taking turns; its fastest median (host noise only adds time).

    At B = 1 the kernels wait on the host's launches, and the host's speed drifts within a run: one timing each
    hands whichever side ran during a slow spell a ratio it did not earn. Taking turns gives both the same spells.
    """
    rounds = ROUNDS if rounds is None else rounds
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    timer = timeit if timer is None else timer
    best = {name: math.inf for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            best[name] = min(best[name], timer(fn))
    return best


def _fmt_row(cols, widths):
    return "  ".join(str(c).rjust(w) for c, w in zip(cols, widths))


def _forward_point(B, T, n_h, gate, bw, peak, sweep, fla) -> dict:
    from deltalab.kernels.delta_rule.triton_chunk import default_config, triton_delta_product

    H, K = GRID["H"], GRID["K"]
    x = make_inputs(B, T, H, K, K, n_h, gate)[:5]
    cfg = default_config(B, H, K, n_h)
    # ours (o, final and fp32 boundary states), lean (what fla returns: o and the final state; the chunk states the
    # output kernel reads are then bf16) and fla, taking turns
    sides = dict(
        ours=partial(triton_delta_product, *x, normalize_qk=True, config=cfg),
        lean=partial(triton_delta_product, *x, normalize_qk=True, output_boundary_states=False),
    )
    if fla is not None:
        sides["fla"] = partial(fla_call, fla, *x)
    t = time_interleaved(sides)
    ours, lean, t_fla = t["ours"], t["lean"], t.get("fla", float("nan"))
    times = {repr(cfg): ours}
    if sweep and B >= 8 and T >= 8192 and gate:  # alternatives where the GPU is full (B=1: see the report)
        alts = {}
        for c in [replace(cfg, state_bv=bv) for bv in (32, 64, 128) if bv != cfg.state_bv]:
            alts[repr(c)] = partial(triton_delta_product, *x, normalize_qk=True, config=c)
            try:
                alts[repr(c)]()  # (compiles: a config that does not fit fails here)
            except Exception as exc:  # noqa: BLE001 - a config that does not fit is a result, not a crash
                times[repr(c)] = float("inf")
                del alts[repr(c)]
                print(f"      config failed: {c}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
        times.update(time_interleaved(alts))  # timed as the default was
    nbytes, nflop = floors(B, T, H, K, K, n_h, gate)
    mem_ms, flop_ms = nbytes / bw * 1e3, nflop / peak * 1e3
    row = dict(
        B=B,
        T=T,
        H=H,
        K=K,
        V=K,
        n_h=n_h,
        gate=gate,
        ours_ms=ours,
        ours_o_final_ms=lean,
        fla_ms=t_fla,
        speedup_vs_fla=t_fla / ours,
        speedup_o_final_vs_fla=t_fla / lean,
        mem_floor_ms=mem_ms,
        flop_floor_ms=flop_ms,
        x_mem_floor=ours / mem_ms,
        x_flop_floor=ours / flop_ms,
        bytes=nbytes,
        flops=nflop,
        config=f"bv={cfg.state_bv}",
    )
    if len(times) > 1:
        best = min(times, key=times.get)
        row["sweep"] = times
        row["best"] = dict(ms=times[best], config=best)
    return row


def parse_grid_sizes(text: str) -> set[tuple[int, int]]:
    """'1x8192,8x2048' -> {(1, 8192), (8, 2048)}: the grid's (B, T) pairs to run."""
    try:
        sizes = {(int(b), int(t)) for b, t in (item.split("x") for item in text.split(",") if item)}
    except ValueError:
        raise ValueError(f"--grid-sizes wants BxT pairs like 1x8192,8x2048, got {text!r}") from None
    unknown = sizes - {(b, t) for b in GRID["B"] for t in GRID["T"]}
    if unknown:
        raise ValueError(f"--grid-sizes {sorted(unknown)} not on the grid (B in {GRID['B']}, T in {GRID['T']})")
    return sizes


def bench_forward(
    quick: bool, bw: float, peak: float, sweep: bool, log, rows: list, dump, sizes: set | None = None
) -> list[dict]:
    """Fill `rows` point by point (dump() after each, so a killed run keeps what it measured); `sizes` limits (B, T)."""
    fla, why = load_fla()
    Bs, Ts = ((1, 8), (2048,)) if quick else (GRID["B"], GRID["T"])
    nhs = (1, 3) if quick else GRID["n_h"]
    head = [
        "B",
        "T",
        "n_h",
        "gate",
        "ours ms",
        "o+fin ms",
        "fla ms",
        "fla/ours",
        "fla/o+fin",
        "mem floor",
        "x floor",
        "flop floor",
        "x flop",
        "config",
    ]
    widths = [2, 5, 3, 4, 8, 8, 8, 8, 9, 9, 7, 10, 6, 16]
    log("\n== forward: triton_delta_product vs fla chunk_gated_delta_product (bf16, H=8, dk=dv=128) ==")
    log("   ours: o, final state and the fp32 boundary states (every 64 tokens); o+fin: ours returning what fla")
    log("   returns (o and final state); fla: o and final state.")
    log("   floors: bytes of the inputs + o + fp32 states / peak bandwidth; WY/UT chunk FLOPs / peak bf16.")
    log(f"   ms: each side's fastest of {ROUNDS} medians (do_bench), the sides taking turns.")
    if fla is None:
        log(f"   fla column empty: {why}")
    log(_fmt_row(head, widths))
    for B in Bs:
        for T in Ts:
            if sizes is not None and (B, T) not in sizes:
                continue
            for n_h in nhs:
                for gate in GRID["gate"]:
                    r = _forward_point(B, T, n_h, gate, bw, peak, sweep, fla)
                    rows.append(r)
                    dump()
                    log(
                        _fmt_row(
                            [
                                B,
                                T,
                                n_h,
                                "on" if gate else "off",
                                f"{r['ours_ms']:.3f}",
                                f"{r['ours_o_final_ms']:.3f}",
                                f"{r['fla_ms']:.3f}",
                                f"{r['speedup_vs_fla']:.2f}x",
                                f"{r['speedup_o_final_vs_fla']:.2f}x",
                                f"{r['mem_floor_ms']:.3f}",
                                f"{r['x_mem_floor']:.1f}x",
                                f"{r['flop_floor_ms']:.3f}",
                                f"{r['x_flop_floor']:.1f}x",
                                r["config"],
                            ],
                            widths,
                        )
                    )
                    if "best" in r:
                        log(f"      best {r['best']['ms']:.3f} ms with {r['best']['config']}")
                    torch.cuda.empty_cache()
    log(grid_verdict(rows))
    return rows


def _rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def bench_accuracy(log, B: int = 1, T: int = 512, H: int = 8, K: int = 128) -> list[dict]:
    """Max relative error (max |x - ref| / max |ref|) vs a float64 token loop on the same rounded inputs."""
    from deltalab.kernels.delta_rule.naive import naive_delta_product
    from deltalab.kernels.delta_rule.triton_chunk import triton_delta_product

    fla, why = load_fla()
    log(
        f"\n== accuracy: max relative error vs float64 reference (B={B}, T={T}, H={H}, dk=dv={K}, beta in [0,2],"
        " initial state) =="
    )
    head = ["kernel", "dtype", "n_h", "gate", "o", "final", "boundary", "vs fla o", "vs fla final"]
    widths = [6, 8, 3, 4, 9, 9, 9, 9, 12]
    log(_fmt_row(head, widths))
    rows = []
    cases = [(n_h, gate, torch.bfloat16) for n_h in (1, 2, 3) for gate in (False, True)]
    cases += [(n_h, True, dt) for dt in (torch.float16, torch.float32) for n_h in (1, 3)]
    for n_h, gate, dtype in cases:
        q, k, v, beta, g, s0 = make_inputs(B, T, H, K, K, n_h, gate, dtype, seed=1, h0=True)
        d = torch.float64
        ref = naive_delta_product(
            q.to(d),
            k.to(d),
            v.to(d),
            beta.to(d),
            None if g is None else g.to(d),
            initial_state=s0.to(d),
            normalize_qk=True,
        )
        o, fin, bnd = triton_delta_product(q, k, v, beta, g, initial_state=s0, normalize_qk=True)
        row = dict(
            kernel="ours",
            dtype=str(dtype).split(".")[-1],
            n_h=n_h,
            gate=gate,
            o=_rel(o, ref[0]),
            final=_rel(fin, ref[1]),
            boundary=_rel(bnd, ref[2]),
        )
        fla_row = None
        if fla is not None and dtype != torch.float32:
            fo, ffin = fla_call(fla, q, k, v, beta, g, s0)
            row.update(vs_fla_o=_rel(o, fo), vs_fla_final=_rel(fin, ffin))
            fla_row = dict(
                kernel="fla",
                dtype=row["dtype"],
                n_h=n_h,
                gate=gate,
                o=_rel(fo, ref[0]),
                final=_rel(ffin, ref[1]),
                boundary=float("nan"),
            )
        for r in (row, fla_row):
            if r is None:
                continue
            rows.append(r)
            log(
                _fmt_row(
                    [
                        r["kernel"],
                        r["dtype"],
                        n_h,
                        "on" if gate else "off",
                        f"{r['o']:.2e}",
                        f"{r['final']:.2e}",
                        f"{r['boundary']:.2e}",
                        f"{r.get('vs_fla_o', float('nan')):.2e}",
                        f"{r.get('vs_fla_final', float('nan')):.2e}",
                    ],
                    widths,
                )
            )
    for dt in ("bfloat16", "float16", "float32"):
        mine = [r for r in rows if r["kernel"] == "ours" and r["dtype"] == dt]
        log(
            f"   max over variants, ours {dt}: o {max(r['o'] for r in mine):.2e}, final "
            f"{max(r['final'] for r in mine):.2e}, boundary {max(r['boundary'] for r in mine):.2e}"
        )
    if why:
        log(f"   fla rows missing: {why}")
    return rows


def _profile(fn, reps: int = 5) -> list[tuple[str, float]]:
    """(kernel, GPU ms per call) of fn, slowest first (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    evs = [(e.key, e.device_time_total / reps / 1e3) for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(evs, key=lambda x: -x[1])


def profile_breakdown(points, log) -> list[dict]:
    """Per-kernel GPU time of one forward, ours and fla's, to see where the time goes."""
    from deltalab.kernels.delta_rule.triton_chunk import triton_delta_product

    fla, _ = load_fla()
    out = []
    for B, T, n_h, gate in points:
        x = make_inputs(B, T, 8, 128, 128, n_h, gate)[:5]
        for name, fn in (
            ("ours", partial(triton_delta_product, *x, normalize_qk=True)),
            ("fla", partial(fla_call, fla, *x) if fla else None),
        ):
            if fn is None:
                continue
            evs = _profile(fn)
            log(
                f"-- profile {name} B={B} T={T} n_h={n_h} gate={gate}: "
                + ", ".join(f"{kname[:40]} {ms:.3f}" for kname, ms in evs[:8])
            )
            out.append(dict(who=name, B=B, T=T, n_h=n_h, gate=gate, kernels_ms=dict(evs)))
    return out


REAL_PROFILE = [("GDN fla default", 1, 32768), ("GDN fla default", 8, 4096), ("Qwen3-Next grouped", 8, 4096)]
REAL_PROFILE += [("DeltaProduct n_h=3", 8, 4096), ("GDN fla default", "varlen", 32768)]


def profile_real(log, only: str = "") -> list[dict]:
    """Per-kernel GPU time at real-model shapes (ours as o+fin; fla's too unless --no-fla), `--only` as the rows."""
    from deltalab.kernels.delta_rule.triton_chunk import triton_delta_product

    fla, _ = load_fla()
    shapes = {s[0]: s[1:] for s in REAL_SHAPES}
    out = []
    for name, B, T in REAL_PROFILE:
        if only and not any(o in name for o in only.split(",")):
            continue
        varlen = B == "varlen"
        x = make_real_inputs(1 if varlen else B, T, *shapes[name])
        cu = torch.tensor([0, *itertools.accumulate(mixed_lengths(T))], device="cuda") if varlen else None
        ours = partial(triton_delta_product, *x, normalize_qk=True, cu_seqlens=cu, output_boundary_states=False)
        for who, fn in (("ours", ours), ("fla", partial(fla_real_call, *x, cu_seqlens=cu))):
            if who == "fla" and fla is None:
                continue
            evs = _profile(fn)
            log(f"-- profile {who} {name} {B}x{T}: " + ", ".join(f"{k[:28]} {ms:.3f}" for k, ms in evs[:7]))
            out.append(dict(who=who, shape=name, B=B, T=T, kernels_ms=dict(evs)))
        del x
        torch.cuda.empty_cache()
    return out


def bench_analysis_rows(quick: bool, log):
    try:
        from benchmarks import kernels_analysis as bench_analysis
    except ImportError as exc:
        log(f"\n== analysis: benchmarks.kernels_analysis not available ({exc}) ==")
        return {"skipped": str(exc)}
    run = bench_analysis.run
    kwargs = {"quick": quick} if "quick" in inspect.signature(run).parameters else {}
    log("\n== analysis targets (benchmarks.kernels_analysis: spectra, state ranks) ==")
    rows = run(**kwargs)
    if hasattr(bench_analysis, "format_table") and isinstance(rows, list):
        log(bench_analysis.format_table(rows))
    return rows


def main(argv: list[str] | None = None) -> int:
    global NO_FLA, ROUNDS
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few grid points only")
    ap.add_argument("--json", metavar="OUT", help="write all results to this JSON file")
    ap.add_argument("--sweep", action="store_true", help="also time other launch configs (grid: T=8192, gate on)")
    ap.add_argument("--profile", action="store_true", help="per-kernel breakdown of a few points")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: forward,real,accuracy,analysis")
    ap.add_argument("--only", default="", help="real-model rows whose shape name contains one of these (comma list)")
    ap.add_argument("--grid-sizes", default="", help="grid (B, T) pairs to run, e.g. 1x8192,8x2048 (default: all)")
    ap.add_argument("--no-fla", action="store_true", help="time ours alone (no fla column, no fla autotuning)")
    ap.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved timings a side at each row (its fastest)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    try:
        sizes = parse_grid_sizes(args.grid_sizes) if args.grid_sizes else None
    except ValueError as exc:
        ap.error(str(exc))
    if not torch.cuda.is_available():
        print("benchmarks.kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    skip = set(filter(None, args.skip.split(",")))
    NO_FLA = args.no_fla
    ROUNDS = args.rounds
    name, bw, peak = device_peaks()
    results: dict = dict(
        device=name,
        peak_bytes_per_s=bw,
        peak_flops=peak,
        torch=torch.__version__,
        started=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    try:
        import triton

        results["triton"] = triton.__version__
    except ImportError:
        pass
    fla, why = load_fla()
    results["fla"] = why or "fla " + getattr(sys.modules.get("fla"), "__version__", "?")

    def log(msg: str) -> None:
        print(msg, flush=True)

    def dump() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1, default=str)

    log(f"device: {name}; peak {bw / 1e12:.2f} TB/s, {peak / 1e12:.0f} TFLOP/s bf16; {results['fla']}")
    if "forward" not in skip:
        results["forward"] = []
        bench_forward(args.quick, bw, peak, args.sweep, log, results["forward"], dump, sizes)
        dump()
    if "real" not in skip:
        results["real"] = []
        bench_real(bw, peak, log, results["real"], dump, only=args.only, sweep=args.sweep)
        dump()
    if "accuracy" not in skip:
        results["accuracy"] = bench_accuracy(log)
        dump()
    if args.profile:
        pts = [(1, 8192, 3, True), (8, 8192, 3, True), (8, 8192, 1, False)]
        if "forward" not in skip:
            results["profile"] = profile_breakdown(pts[:1] if args.quick else pts, log)
        if "real" not in skip:
            results["profile_real"] = profile_real(log, args.only)
        dump()
    if "analysis" not in skip:
        results["analysis"] = bench_analysis_rows(args.quick, log)
        dump()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
