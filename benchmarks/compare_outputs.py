"""Outputs of the default Triton forwards, saved and compared bit for bit across two versions of the kernels.

    python -m benchmarks.compare_outputs save before.safetensors [--digest] [--quick]
    python -m benchmarks.compare_outputs compare before.safetensors after.safetensors

`save` runs the default forwards at the points `benchmarks.kernels` times (the grid, with fp32 boundary states and
lean, i.e. o and the final state only; the real-model rows, the packed batch included), at `benchmarks.kda`'s
rows, and at a few small fp16 / fp32 points with initial states, and writes o, the final and the boundary states
of each to a safetensors file (`--digest`: each tensor's SHA-256 instead, 32 bytes, for shapes whose states run to
gigabytes). `compare` prints one line per point and exits 1 when any tensor differs in a single bit (or is missing
from one file), 2 when a file cannot be read. The inputs are seeded, so two versions see the same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

Point = tuple[str, Callable[[], dict[str, torch.Tensor | None]]]


def _delta_points(quick: bool) -> Iterator[Point]:
    """(name, thunk) per point of `benchmarks.kernels`: thunk() -> {output name: tensor}."""
    from benchmarks.kernels import GRID, REAL_SHAPES, REAL_SIZES, make_inputs, make_real_inputs, mixed_lengths
    from deltalab.kernels.delta_rule.triton_chunk import triton_delta_product

    def run(x, **kw):
        def thunk():
            full = triton_delta_product(*x, normalize_qk=True, **kw)
            lean = triton_delta_product(*x, normalize_qk=True, output_boundary_states=False, **kw)
            return dict(o=full[0], final=full[1], boundary=full[2], lean_o=lean[0], lean_final=lean[1])

        return thunk

    H, K = GRID["H"], GRID["K"]
    Bs, Ts, nhs = ((1, 8), (2048,), (1, 3)) if quick else (GRID["B"], GRID["T"], GRID["n_h"])
    for B, T, n_h, gate in itertools.product(Bs, Ts, nhs, GRID["gate"]):
        yield f"grid B={B} T={T} n_h={n_h} gate={int(gate)}", run(make_inputs(B, T, H, K, K, n_h, gate)[:5])
    lengths = mixed_lengths(REAL_SIZES[-1][1])
    cu = torch.tensor([0, *itertools.accumulate(lengths)], device="cuda")
    for (name, Hk, Hv, K_, V, n_h), (B, T) in itertools.product(REAL_SHAPES, REAL_SIZES[1:] if quick else REAL_SIZES):
        varlen = B == "varlen"
        x = make_real_inputs(1 if varlen else B, T, Hk, Hv, K_, V, n_h)
        yield f"real {name} {'varlen' if varlen else f'{B}x{T}'}", run(x, cu_seqlens=cu if varlen else None)
    for dtype in (torch.float16, torch.float32):  # the F32 operand path and fp16 inputs, with initial states
        x = make_inputs(2, 300, 4, 64, 64, 2, True, dtype=dtype, seed=3, h0=True)
        yield f"small {str(dtype)[6:]} n_h=2 h0", run(x[:5], initial_state=x[5])


def _kda_points(quick: bool) -> Iterator[Point]:
    """(name, thunk) per row of `benchmarks.kda` (per-channel gates), fp32 boundary states and lean."""
    from benchmarks.kda import GRID, inputs
    from deltalab.kernels.delta_rule.triton_kda import triton_kda

    def run(q, k, v, beta, g):
        args = (q, k.unsqueeze(2), v.unsqueeze(2), beta.unsqueeze(2).float(), g)

        def thunk():
            full = triton_kda(*args, scale=q.shape[-1] ** -0.5)
            lean = triton_kda(*args, scale=q.shape[-1] ** -0.5, output_boundary_states=False)
            return dict(o=full[0], final=full[1], boundary=full[2], lean_o=lean[0], lean_final=lean[1])

        return thunk

    Bs, Ts, Hs = ((1, 8), (2048,), (16,)) if quick else (GRID["B"], GRID["T"], GRID["H"])
    for B, T, H in itertools.product(Bs, Ts, Hs):
        yield f"kda B={B} T={T} H={H}", run(*inputs(B, T, H, "cuda"))


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    """x's storage as a flat uint8 tensor on the CPU (bit patterns, not values: -0.0 and NaNs count)."""
    return x.detach().contiguous().view(-1).view(torch.uint8).cpu()


def save(path: Path, digest: bool, quick: bool) -> int:
    """Run every point and write its outputs (or their SHA-256) to `path`; returns the exit code."""
    from safetensors.torch import save_file

    if not torch.cuda.is_available():
        print("compare_outputs save: needs a CUDA GPU (the Triton forwards); run it on a machine with one")
        return 2
    tensors: dict[str, torch.Tensor] = {}
    points = [*_delta_points(quick), *_kda_points(quick)]
    for i, (name, thunk) in enumerate(points, 1):
        with torch.no_grad():
            out = thunk()
        for what, x in out.items():
            if x is None:
                continue
            key = f"{name} | {what}"
            if digest:
                tensors[key] = torch.frombuffer(bytearray(hashlib.sha256(_as_bytes(x).numpy()).digest()),
                                                dtype=torch.uint8)
            else:
                tensors[key] = x.detach().cpu().contiguous()
        print(f"[{i}/{len(points)}] {name}: " + ", ".join(f"{k} {tuple(v.shape)}" for k, v in out.items() if v is
                                                         not None), flush=True)
        del out
        torch.cuda.empty_cache()
    save_file(tensors, str(path), metadata={"digest": str(digest), "torch": torch.__version__})
    print(f"wrote {len(tensors)} tensors of {len(points)} points to {path}")
    return 0


def _same(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, str]:
    """(bit-identical, a note on how they differ)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False, f"{tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    if torch.equal(_as_bytes(a), _as_bytes(b)):
        return True, ""
    if a.dtype == torch.uint8 and a.numel() == 32:
        return False, "digests differ"
    diff = (a.double() - b.double()).abs().max().item()
    return False, f"max |diff| {diff:.3e} (max |a| {a.double().abs().max().item():.3e})"


def compare(path_a: Path, path_b: Path) -> int:
    """One line per point (same / differs, which outputs); exit code 1 on any difference."""
    from safetensors import safe_open

    opened = []
    for p in (path_a, path_b):
        try:
            opened.append(safe_open(str(p), framework="pt"))
        except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user error
            print(f"compare_outputs: cannot read {p} ({type(exc).__name__}: {exc}); pass two files from `save`")
            return 2
    fa, fb = opened
    keys_a, keys_b = set(fa.keys()), set(fb.keys())
    points = list(dict.fromkeys(k.split(" | ")[0] for k in sorted(keys_a | keys_b, key=_point_order(fa, fb))))
    bad = 0
    for point in points:
        notes = []
        for key in sorted(k for k in keys_a | keys_b if k.split(" | ")[0] == point):
            what = key.split(" | ")[1]
            if key not in keys_a or key not in keys_b:
                notes.append(f"{what} only in {path_a if key in keys_a else path_b}")
                continue
            same, note = _same(fa.get_tensor(key), fb.get_tensor(key))
            if not same:
                notes.append(f"{what}: {note}")
        bad += bool(notes)
        print(f"{'DIFFERS' if notes else 'same   '}  {point}" + (f"  ({'; '.join(notes)})" if notes else ""))
    print(f"{len(points) - bad} of {len(points)} points bit-identical")
    return 1 if bad else 0


def _point_order(fa, fb) -> Callable[[str], int]:
    """Sort key: a point's position in the first file that holds it (the order `save` ran them)."""
    order: dict[str, int] = {}
    for k in [*fa.keys(), *fb.keys()]:
        order.setdefault(k, len(order))
    return lambda k: order[k]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compare_outputs", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("save", help="run the default forwards and write their outputs")
    s.add_argument("path", type=Path)
    s.add_argument("--digest", action="store_true", help="store each tensor's SHA-256 instead of the tensor")
    s.add_argument("--quick", action="store_true", help="a few points only")
    c = sub.add_parser("compare", help="compare two saved files bit for bit")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = parser.parse_args(argv)
    if args.cmd == "save":
        if args.path.exists() and args.path.is_dir():
            print(f"compare_outputs save: {args.path} is a folder; pass a file name such as outputs.safetensors")
            return 2
        return save(args.path, args.digest, args.quick)
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
