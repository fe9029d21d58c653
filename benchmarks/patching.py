"""Patching benchmark: `python -m benchmarks.patching [--model s4|stdlib] [--T 64] [--device cpu] [--quick]`.

On a bundled model, in the same run on the same device:
- `batched`: `probes.patching.activation_patching` over hooks x layers x heads x positions, --batch-size patched
  runs per forward; `loop`: the same cells one forward each (TransformerLens's `get_act_patch_*` way), through the
  same code with batch size 1; the ratio and the largest difference between the two results;
- the same for `state_patching` (every head x token of every layer, full state patches);
- `attribution`: `attribution_patching` of the same cells and every state, against one forward + backward of the
  model (the ratio), and the Spearman rank correlation of its estimates with actual patching (activation cells
  and state cells).
Cases: `s4` (models/zoo/s4-deltaproduct2 on an S4 word, one word letter changed; metric: logit of the clean
final group element minus the corrupted one's), `stdlib` (models/zoo/stdlib-deltanet on Python source, one
character changed; metric: KL to the clean run at the last position). Prints a table; `--json` for the numbers.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

ZOO = Path(__file__).resolve().parents[1] / "models" / "zoo"
STDLIB_TEXT = "def shift(items, n):\n    return items[n:] + items[:n]\n\nclass Stack:\n    def push(self, x):\n"


def case(name: str, T: int, seed: int = 0):
    """(model, clean ids, corrupted ids, metric) of a case."""
    from deltalab.models import load_checkpoint
    from deltalab.probes.patching import Metric

    if name == "s4":
        from deltalab.tasks.state_tracking import get_task

        model = load_checkpoint(ZOO / "s4-deltaproduct2")
        group = get_task("S4").group
        rng = np.random.default_rng(seed)
        clean = rng.integers(0, group.order, T)
        corrupted = clean.copy()
        while True:
            corrupted[T // 3] = rng.integers(0, group.order)
            a, b = group.scan(clean[None])[0, -1], group.scan(corrupted[None])[0, -1]
            if a != b:
                break
        return model, clean, corrupted, Metric("logit-diff", (int(a), int(b)))
    model = load_checkpoint(ZOO / "stdlib-deltanet")
    text = (STDLIB_TEXT * (T // len(STDLIB_TEXT) + 1)).encode()[:T]
    clean = np.frombuffer(text, np.uint8).astype(np.int64)
    corrupted = clean.copy()
    corrupted[T // 3] = ord("q") if clean[T // 3] != ord("q") else ord("z")
    return model, clean, corrupted, Metric("kl")


def timed(fn, device: str, repeat: int = 1) -> tuple[float, object]:
    """(best wall time in s of `repeat` calls, the last result)."""
    best, out = float("inf"), None
    for _ in range(repeat):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best, out


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    from scipy.stats import spearmanr

    keep = np.isfinite(a) & np.isfinite(b)
    return float(spearmanr(a[keep], b[keep]).statistic)


def run(name: str, T: int, device: str, batch_size: int, hooks: list[str]) -> dict:
    from deltalab.probes.patching import activation_patching, attribution_patching, state_patching

    model, clean, corrupted, metric = case(name, T)
    model = model.to(device)
    kw = dict(hooks=hooks)
    res: dict = {"case": name, "T": T, "device": device, "metric": metric.label, "batch_size": batch_size}
    t_b, act = timed(lambda: activation_patching(model, clean, corrupted, metric, batch_size=batch_size, **kw), device)
    t_l, act1 = timed(lambda: activation_patching(model, clean, corrupted, metric, batch_size=1, **kw), device)
    res["activation"] = dict(cells=int(np.isfinite(act.metric.values).sum()), batched_s=t_b, loop_s=t_l,
                             speedup=t_l / t_b, max_diff=float(np.nanmax(np.abs(act.metric - act1.metric))))
    t_b, st = timed(lambda: state_patching(model, clean, corrupted, metric, batch_size=batch_size), device)
    t_l, st1 = timed(lambda: state_patching(model, clean, corrupted, metric, batch_size=1), device)
    res["state"] = dict(cells=int(st.metric.size), batched_s=t_b, loop_s=t_l, speedup=t_l / t_b,
                        max_diff=float(np.nanmax(np.abs(st.metric - st1.metric))))
    ids = torch.as_tensor(corrupted, device=device)

    def forward_backward():
        with torch.enable_grad():
            model.zero_grad(set_to_none=True)
            model(ids[None]).logits.float().logsumexp(-1).sum().backward()
        model.zero_grad(set_to_none=True)
    t_fb, _ = timed(forward_backward, device, repeat=3)
    t_a, att = timed(lambda: attribution_patching(model, clean, corrupted, metric, **kw), device, repeat=3)
    res["attribution"] = dict(seconds=t_a, forward_backward_s=t_fb, ratio=t_a / t_fb,
                              spearman_activation=spearman(att.attribution.values.ravel(), act.patched.values.ravel()),
                              spearman_state=spearman(att.state_attribution.values.ravel(),
                                                      st.patched.sel(part="full").values.ravel()))
    return res


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["s4", "stdlib", "both"], default="both")
    p.add_argument("--T", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--hooks", default="resid_pre,o,beta")
    p.add_argument("--quick", action="store_true", help="T = 16: a smoke run")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    T = 16 if args.quick else args.T
    rows = [run(n, T, args.device, args.batch_size, args.hooks.split(","))
            for n in (["s4", "stdlib"] if args.model == "both" else [args.model])]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print("| case | T | sweep | cells | batched (s) | loop (s) | speedup | max diff |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        for kind in ("activation", "state"):
            x = r[kind]
            print(f"| {r['case']} | {r['T']} | {kind} | {x['cells']} | {x['batched_s']:.3f} | {x['loop_s']:.3f} | "
                  f"{x['speedup']:.1f}x | {x['max_diff']:.1e} |")
    print()
    print("| case | attribution (s) | forward+backward (s) | ratio | Spearman vs activation patching | "
          "Spearman vs state patching |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        a = r["attribution"]
        print(f"| {r['case']} | {a['seconds']:.3f} | {a['forward_backward_s']:.3f} | {a['ratio']:.1f}x | "
              f"{a['spearman_activation']:.3f} | {a['spearman_state']:.3f} |")


if __name__ == "__main__":
    main()
