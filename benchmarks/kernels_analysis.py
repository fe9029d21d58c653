"""Benchmark of the analysis kernels (spectra, state ranks) against their peers, measured in the same run.

Spectra: `householder_spectra` vs dense torch.linalg.eigvals of the same dk x dk products.
State ranks: `state_rank_metrics` (from chunk-boundary states) vs the DeltaProduct authors' float32 token
loop with torch.linalg.svdvals at every step. Each row reports token-heads per second, the ratio to the
peer and the largest relative error against a float64 reference. `python -m benchmarks.kernels_analysis`.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from deltalab.kernels.delta_rule.chunk import chunk_delta_product
from deltalab.kernels.delta_rule.naive import l2_normalize
from deltalab.kernels.ranks.chunk import RankMetrics, metrics_from_singular_values, state_rank_metrics
from deltalab.kernels.ranks.naive import naive_state_ranks
from deltalab.kernels.spectra.householder import householder_spectra
from deltalab.kernels.spectra.naive import dense_products, naive_spectra


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, repeat: int = 3, warmup: int = 1) -> tuple[float, Any]:
    """Best wall time of `repeat` runs after `warmup` (compilation, autotuning) and the last result."""
    out = None
    for _ in range(warmup):
        out = fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best, out


def _inputs(B, T, n_h, H, K, V, gated, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    k = l2_normalize(torch.randn(B, T, n_h, H, K, generator=gen)).to(device)
    v = torch.randn(B, T, n_h, H, V, generator=gen).to(device)
    beta = (torch.rand(B, T, n_h, H, generator=gen) * 2).to(device)
    g = (-torch.rand(B, T, H, generator=gen) * 0.1).to(device) if gated else None
    q = torch.randn(B, T, H, K, generator=gen).to(device)
    return q, k, v, beta, g


def _matched_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest eigenvalue error after pairing each token's eigenvalues greedily (nearest pair first)."""
    a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]).to(a.dtype)
    d = (a[:, :, None] - b[:, None, :]).abs().double()
    n, rows = a.shape[-1], torch.arange(a.shape[0], device=a.device)
    err = torch.zeros(a.shape[0], dtype=torch.float64, device=a.device)
    for _ in range(n):
        flat = d.reshape(a.shape[0], -1).argmin(-1)
        i, j = flat // n, flat % n
        err = torch.maximum(err, d[rows, i, j])
        d[rows, i, :] = float("inf")
        d[rows, :, j] = float("inf")
    return err.max().item()


def _spectra_row(device, B, T, H, K, n_h, gated, window, n_dense, repeat) -> dict:
    _, k, _, beta, g = _inputs(B, T, n_h, H, K, 1, gated, device, seed=n_h)
    n_win = T - window + 1
    secs, spec = timed(lambda: householder_spectra(k, beta, g, window=window), device, repeat)
    th = B * n_win * H
    # Peer: dense eigvals of the same products (float32, as one would), on a few token-heads of head 0.
    tw = n_dense + window - 1
    ks, bs, gs = k[:1, :tw, :, :1], beta[:1, :tw, :, :1], None if g is None else g[:1, :tw, :1]
    prods = dense_products(ks, bs, window=window, dtype=torch.float32)
    peer_secs, _ = timed(lambda: torch.linalg.eigvals(prods), device, repeat=1)
    peer_rate = prods.shape[1] / peer_secs
    err = _matched_error(spec.eigenvalues[:1, :n_dense, :1], naive_spectra(ks, bs, gs, window=window))
    rate = th / secs
    return {
        "target": "spectra",
        "name": "householder_spectra (float64 small problem)",
        "config": f"B={B} T={T} H={H} dk={K} n_h={n_h} gate={'on' if gated else 'off'} w={window}",
        "token_heads": th,
        "seconds": secs,
        "token_heads_per_s": rate,
        "peer": "dense torch.linalg.eigvals (float32)",
        "peer_token_heads_per_s": peer_rate,
        "ratio": rate / peer_rate,
        "max_abs_err_vs_float64": err,
    }


def spectra_rows(device: torch.device, B: int, T: int, H: int, K: int, n_dense: int, repeat: int) -> list[dict]:
    """Per-token spectra for n_h = 1..3, gate off/on; windows of 4 tokens on one sequence."""
    rows = []
    for n_h in (1, 2, 3):
        for gated in (False, True):
            rows.append(_spectra_row(device, B, T, H, K, n_h, gated, 1, n_dense, repeat))
        rows.append(_spectra_row(device, 1, T, H, K, n_h, False, 4, n_dense, 1))
    return rows


def _reference_ranks(k, v, beta, g, positions: list[int]) -> RankMetrics:
    """Float64 token loop, SVD only at `positions`: RankMetrics [B, len(positions), H]."""
    B, T, n_h, H, K = k.shape
    state = torch.zeros(B, H, K, v.shape[-1], dtype=torch.float64, device=k.device)
    k, v, beta = k.double(), v.double(), beta.double()
    want, out = set(positions), []
    for t in range(max(positions) + 1):
        if g is not None:
            state = state * g[:, t].double().exp()[..., None, None]
        for j in range(n_h):
            kt = k[:, t, j]
            r = v[:, t, j] - torch.einsum("bhkv,bhk->bhv", state, kt)
            state = state + beta[:, t, j][..., None, None] * kt[..., :, None] * r[..., None, :]
        if t in want:
            sig = torch.linalg.svdvals(state)
            out.append(torch.stack(metrics_from_singular_values(sig, state.square().sum((-1, -2)).sqrt())))
    return RankMetrics(*torch.stack(out, 2).unbind(0))


def _rel_err(ours: RankMetrics, ref: RankMetrics, positions: list[int]) -> float:
    worst = 0.0
    for f in RankMetrics._fields:
        a, b = getattr(ours, f)[:, positions].double(), getattr(ref, f)
        worst = max(worst, ((a - b).abs() / b.abs().clamp(min=1e-12)).max().item())
    return worst


def ranks_rows(
    device: torch.device, B: int, T: int, H: int, K: int, methods: list[str], peer_tokens: int, repeat: int
) -> list[dict]:
    rows = []
    for n_h, gated in ((3, True), (3, False), (1, False)):
        q, k, v, beta, g = _inputs(B, T, n_h, H, K, K, gated, device, seed=10 + n_h)
        with torch.no_grad():
            _, _, bounds = chunk_delta_product(q, k, v, beta, g)
        # Peer: the authors' loop (float32 replay, svdvals per step) on a prefix.
        tp = min(peer_tokens, T)
        args = (k[:, :tp], v[:, :tp], beta[:, :tp], None if g is None else g[:, :tp])
        peer_secs, _ = timed(lambda: naive_state_ranks(*args, dtype=torch.float32), device, repeat=1)  # noqa: B023
        peer_rate = B * tp * H / peer_secs
        positions = sorted({0, 1, 5, 63, 64, min(T - 1, 700), T - 1})
        ref = _reference_ranks(k, v, beta, g, positions)
        for method in methods:
            row = {
                "target": "ranks",
                "name": f"state_rank_metrics method={method}",
                "config": f"B={B} T={T} H={H} dk=dv={K} n_h={n_h} gate={'on' if gated else 'off'}",
                "peer": f"authors' float32 loop + svdvals per step ({tp} tokens)",
                "peer_token_heads_per_s": peer_rate,
            }
            try:
                secs, out = timed(lambda: state_rank_metrics(k, v, beta, g, bounds, method=method), device, repeat)  # noqa: B023
            except Exception as exc:  # report and go on: one broken back end should not hide the others
                rows.append({**row, "error": f"{type(exc).__name__}: {exc}"[:300]})
                continue
            rate = B * T * H / secs
            rows.append(
                {
                    **row,
                    "token_heads": B * T * H,
                    "seconds": secs,
                    "token_heads_per_s": rate,
                    "ratio": rate / peer_rate,
                    "max_rel_err_vs_float64": _rel_err(out, ref, positions),
                }
            )
    return rows


def solver_rows(device: torch.device, n: int, K: int, n_slow: int) -> list[dict]:
    """Singular-value back ends on n realistic states (a replayed chunk), seconds per matrix; failures are rows."""
    from deltalab.kernels.linalg import cusolver_eigh, triton_svd
    from deltalab.kernels.ranks.chunk import _gram, replay_chunks

    B, H, n_h = 1, 8, 3
    T = max(64, -(-n // H))
    q, k, v, beta, g = _inputs(B, T, n_h, H, K, K, True, device, seed=99)
    with torch.no_grad():
        _, _, bounds = chunk_delta_product(q, k, v, beta, g)
    c = -(-T // 64)
    pad = c * 64 - T
    kk, vv, bb = (torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) for x in (k, v, beta))
    gg = torch.nn.functional.pad(g, (0, 0, 0, pad))
    replay = lambda: replay_chunks(  # noqa: E731
        bounds[0, :c], kk.reshape(c, 64, n_h, H, K), vv.reshape(c, 64, n_h, H, K), bb.reshape(c, 64, n_h, H),
        gg.reshape(c, 64, H),
    )
    secs, states = timed(replay, device, repeat=2)
    states = states.reshape(-1, K, K)[:n]
    rows = [
        {
            "target": "solvers",
            "name": "replay (states from boundary)",
            "matrices": c * 64 * H,
            "seconds_per_matrix": secs / (c * 64 * H),
        }
    ]
    ref = torch.linalg.svdvals(states[:n_slow].double()).sort(-1).values

    def err(s: torch.Tensor) -> float:
        s = s[:n_slow].double().sort(-1).values
        return ((s - ref).abs().amax(-1) / ref.amax(-1)).max().item()

    def cus(dtype, vectors=False):
        return cusolver_eigh.batched_eigh(_gram(states, dtype), vectors)[0].clamp(min=0).sqrt()

    cands: list[tuple[str, Callable[[], torch.Tensor], int]] = [
        ("cusolver XsyevBatched float64 Gram", lambda: cus(torch.float64), n),
        ("cusolver XsyevBatched float32 Gram (inaccurate)", lambda: cus(torch.float32), n),
        ("triton bidiag+bisection (8 warps)", lambda: triton_svd.svdvals(states, num_warps=8), n),
        ("triton bidiag+bisection (16 warps)", lambda: triton_svd.svdvals(states, num_warps=16), n),
        ("triton bidiag+bisection (4 warps)", lambda: triton_svd.svdvals(states, num_warps=4), n),
        (
            "torch.linalg.eigvalsh float64 Gram",
            lambda: torch.linalg.eigvalsh(_gram(states[:n_slow], torch.float64)),
            n_slow,
        ),
        ("torch.linalg.svdvals float32", lambda: torch.linalg.svdvals(states[:n_slow]), n_slow),
    ]
    if device.type == "cuda":

        def magma():
            previous = torch.backends.cuda.preferred_linalg_library()
            torch.backends.cuda.preferred_linalg_library("magma")
            try:
                return torch.linalg.eigvalsh(_gram(states[:n_slow], torch.float64)).clamp(min=0).sqrt()
            finally:
                torch.backends.cuda.preferred_linalg_library(previous)

        cands.append(("magma eigvalsh float64 Gram", magma, n_slow))
    for name, fn, m in cands:
        try:
            secs, s = timed(fn, device, repeat=2)
            if "eigvalsh float64" in name and "magma" not in name:
                s = s.clamp(min=0).sqrt()
            rows.append(
                {
                    "target": "solvers",
                    "name": name,
                    "matrices": m,
                    "seconds_per_matrix": secs / m,
                    "matrices_per_s": m / secs,
                    "max_err_rel_sigma_max": err(s),
                }
            )
        except Exception as exc:  # a back end missing on this machine is a result, not a crash
            rows.append({"target": "solvers", "name": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
    return rows


def run(
    device: str | None = None,
    quick: bool = False,
    targets: tuple[str, ...] = ("spectra", "ranks"),
    methods: list[str] | None = None,
    rank_tokens: int = 4096,
) -> list[dict]:
    """Measure and return the rows (dicts). quick: tiny shapes for a CPU smoke run."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if methods is None:
        methods = ["gram64", "triton"] if dev.type == "cuda" else ["gram64"]
    rows: list[dict] = []
    if "spectra" in targets:
        if quick:
            rows += spectra_rows(dev, B=1, T=64, H=2, K=16, n_dense=4, repeat=1)
        else:
            rows += spectra_rows(dev, B=8, T=8192, H=8, K=128, n_dense=32, repeat=5)
    if "solvers" in targets:
        rows += solver_rows(dev, n=4 if quick else 4096, K=16 if quick else 128, n_slow=4 if quick else 64)
    if "ranks" in targets:
        if quick:
            rows += ranks_rows(dev, B=1, T=70, H=2, K=16, methods=methods, peer_tokens=8, repeat=1)
        else:
            rows += ranks_rows(dev, B=1, T=rank_tokens, H=8, K=128, methods=methods, peer_tokens=16, repeat=2)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    for r in rows:
        r["device"] = name
    return rows


def format_table(rows: list[dict]) -> str:
    """One table per target: config, method, token-heads/s, peer rate, ratio, error."""
    lines = []
    for r in rows:
        if r["target"] == "solvers":
            detail = r.get("error") or (
                f"{r['seconds_per_matrix'] * 1e6:10.2f} us/matrix"
                + (f"  err {r['max_err_rel_sigma_max']:.2g}" if "max_err_rel_sigma_max" in r else "")
            )
            lines.append(f"solver  {r['name']:<52} {detail}")
    for target in dict.fromkeys(r["target"] for r in rows if r["target"] != "solvers"):
        sel = [r for r in rows if r["target"] == target]
        lines.append(f"\n== {target} on {sel[0]['device']} (peer: {sel[0]['peer']}) ==")
        lines.append(f"{'config':<52} {'method':<44} {'tok-heads/s':>12} {'peer/s':>10} {'ratio':>9} {'max err':>9}")
        for r in sel:
            if "error" in r:
                lines.append(f"{r['config']:<52} {r['name']:<44} {r['error']}")
                continue
            err = r.get("max_abs_err_vs_float64", r.get("max_rel_err_vs_float64"))
            lines.append(
                f"{r['config']:<52} {r['name']:<44} {r['token_heads_per_s']:>12.4g} "
                f"{r['peer_token_heads_per_s']:>10.3g} {r['ratio']:>9.3g} {err:>9.2g}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke run)")
    parser.add_argument("--targets", default="spectra,ranks", help="comma-separated: spectra,ranks,solvers")
    parser.add_argument("--methods", default=None, help="rank methods, comma-separated (auto,gram64,triton,svd)")
    parser.add_argument("--rank-tokens", type=int, default=4096, help="sequence length of the rank rows")
    parser.add_argument("--out", default="bench_analysis.json", help="JSON file for the rows")
    args = parser.parse_args(argv)
    methods = args.methods.split(",") if args.methods else None
    rows = run(args.device, args.quick, tuple(args.targets.split(",")), methods, args.rank_tokens)
    print(format_table(rows))
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=2)
    print(f"\nwrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
