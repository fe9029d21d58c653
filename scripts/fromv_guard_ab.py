"""U from v on the W path with its one-stage guard lifted (`_Phases.state` runs such 32-wide tiles at one stage since
the twelfth session's miscompile), now that T loads unmasked: errors at the GPU tests' shapes, then o+final ms at
Qwen3-Next 1x32768 (the W path) against the default. `python scripts/fromv_guard_ab.py` (GPU)."""

from __future__ import annotations

import dataclasses
from functools import partial

import kernels.triton_chunk as tc
from benchmarks.kernels import REAL_SHAPES, _profile, make_real_inputs, timeit
from scripts.fromv_check import report


def _lift_guard() -> None:
    real = dataclasses.replace
    tc.replace = lambda cfg, **kw: cfg if kw == {"state_stages": 1} else real(cfg, **kw)


def main() -> None:
    _lift_guard()
    report(stage_counts=(2, 3), tiles=(32,))
    _, Hk, Hv, K, V, n_h = next(s for s in REAL_SHAPES if s[0].startswith("Qwen"))
    x = make_real_inputs(1, 32768, Hk, Hv, K, V, n_h)
    base = tc.default_config(1, Hv, V, n_h, K)
    lean = partial(tc.triton_delta_product, *x, normalize_qk=True, output_boundary_states=False)
    want = lean(config=base)[0].float()
    for cfg in (base, dataclasses.replace(base, state_from_v=True)):
        got = lean(config=cfg)[0].float()
        diff = ((got - want).abs().max() / want.abs().max()).item()
        prof = ", ".join(f"{k[:16]} {ms:.3f}" for k, ms in _profile(partial(lean, config=cfg))[:5])
        print(f"Qwen 1x32768 from_v={cfg.state_from_v}: {timeit(partial(lean, config=cfg)):.3f} ms, o diff {diff:.1e}; "
              f"{prof}", flush=True)


if __name__ == "__main__":
    main()
