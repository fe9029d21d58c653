"""Your own input in the dashboard, end to end: `python -m benchmarks.dashboard_input [--tokens 256] [--repeats 5]
[--checkpoint models/zoo/s4-deltaproduct2] [--device cpu]`.

Times what the Input page does when the researcher presses Run — encode the typed sequence, run the checkpoint
with the capture hooks, build the store-shaped Dataset — and then what the pages compute from it on their first
visit (the betas / keys / spectra / effective-rank previews and the text view's rotation angles). The model load
and warm-up (nnsight's first trace sets itself up for seconds) are reported apart: the dashboard does them once per
process, in the background when the Input page opens.
Prints a table of medians (and the minimum) over the repeats; target: under 2 s for 256 tokens on a laptop CPU.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time
from pathlib import Path

import numpy as np

ZOO = Path(__file__).resolve().parents[1] / "models" / "zoo"


def store_attrs(checkpoint: Path, tokens: int) -> dict:
    """The attributes a default capture of `checkpoint` would record (the Input page copies its store's)."""
    from deltalab.kernels.constants import CHUNK_SIZE
    from deltalab.models import ModelConfig
    from deltalab.models.run_files import read_task_file
    from deltalab.store import schema
    from deltalab.store.plan import checkpoint_digest

    cfg = ModelConfig.from_dict(json.loads((checkpoint / "config.json").read_text()))
    task = read_task_file(checkpoint)
    meta = {"kind": "task", "task": task} if task else {"kind": "text", "tokenizer": "tokenizer.json"}
    if meta["kind"] == "task":
        meta["task"] = {"name": meta["task"].get("task") or meta["task"].get("name")}
    return {"model_config": cfg.to_dict(), "checkpoint_digest": checkpoint_digest(checkpoint),
            "layers": list(range(cfg.num_hidden_layers)), "chunk_size": CHUNK_SIZE,
            "variables": schema.variables_for(schema.DEFAULT_HOOKS, gated=cfg.use_forget_gate),
            "data_meta": meta, "data_spec": "bench" if meta["kind"] == "task" else "text:bench",
            "command_line": ["deltalab", "capture", str(checkpoint)], "sizes": {"pos": tokens}}


def typed_input(attrs: dict, tokens: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    if attrs["data_meta"]["kind"] == "task":
        return " ".join(str(int(i)) for i in rng.integers(0, attrs["model_config"]["vocab_size"], tokens))
    words = ["def", "return", "self", "value", "(", ")", ":", "\n    ", "for", "in", "range", "x", "=", "+", "1"]
    text = ""
    while len(text.encode()) < tokens:
        text += str(rng.choice(words)) + " "
    return text.encode()[:tokens].decode("utf-8", errors="ignore")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, default=ZOO / "s4-deltaproduct2")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    p.add_argument("--store", type=Path, default=None,
                   help="also time the dashboard itself (streamlit AppTest) on this store of the checkpoint: "
                        "Run pressed on the Input page, then the first visit of each page showing the input")
    args = p.parse_args(argv)

    import torch

    from deltalab.app.dash import own_input, previews, textgrid

    torch.set_num_threads(max(1, torch.get_num_threads()))
    attrs = store_attrs(args.checkpoint, args.tokens)
    tok = textgrid.tokenizer_file(args.checkpoint)
    once: dict[str, float] = {}
    t0 = time.perf_counter()
    model = own_input.get_model(args.checkpoint, args.device)
    once["load + warm up the model (in the background)"] = time.perf_counter() - t0
    for probe in ("betas", "keys", "spectra", "erank"):  # imports (scikit-learn, kernels) as a warm server has them
        importlib.import_module(f"deltalab.probes.{probe}")

    rows: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        rows.setdefault(name, []).append(seconds)

    for r in range(args.repeats):
        text = typed_input(attrs, args.tokens, r)
        t_all = time.perf_counter()
        t0 = time.perf_counter()
        enc = own_input.encode(text, attrs, tok)
        add("encode", time.perf_counter() - t0)
        timing = own_input.Timing()
        ds = own_input.run(model, enc, attrs, timing)
        for k, v in timing.stages.items():
            add(k, v)
        add("= input on every page (Run pressed -> data ready)", time.perf_counter() - t_all)
        for probe in ("betas", "keys", "spectra", "erank"):
            t0 = time.perf_counter()
            previews.compute(importlib.import_module(f"deltalab.probes.{probe}"), ds)
            add(f"page preview: {probe}", time.perf_counter() - t0)
        t0 = time.perf_counter()
        k = np.asarray(ds["k"].isel(seq=0, layer=0, head=0).values)
        b = np.asarray(ds["beta"].isel(seq=0, layer=0, head=0).values)
        textgrid.rotation_angles(k, b)
        add("text view: rotation angles", time.perf_counter() - t0)
        add("= plus every page's first computation", time.perf_counter() - t_all)
    cfg = attrs["model_config"]
    print(f"\n{args.checkpoint.name}: {cfg['num_hidden_layers']} layer(s) x {cfg['num_heads']} heads, "
          f"{args.tokens} tokens, device {args.device}, {torch.get_num_threads()} torch threads, "
          f"{args.repeats} repeats\n")
    print(f"{'stage':58s} {'median s':>9s} {'min s':>8s}")
    print("-" * 77)
    for name, v in once.items():
        print(f"{name + ' (once per process)':58s} {v:9.3f} {'':>8s}")
    for name, v in rows.items():
        print(f"{name:58s} {statistics.median(v):9.3f} {min(v):8.3f}")
    target = statistics.median(rows["= input on every page (Run pressed -> data ready)"])
    print(f"\ntarget < 2 s for {args.tokens} tokens: {'met' if target < 2.0 else 'NOT met'} ({target:.3f} s)")
    if args.store is not None:
        pages = apptest(args.store, typed_input(attrs, args.tokens, 7))
        print(f"\ndashboard script time on {args.store} (streamlit AppTest, server side, no browser):")
        for name, v in pages.items():
            print(f"  {name:56s} {v:9.3f}")
        rows.update({f"dashboard: {k}": [v] for k, v in pages.items()})
    if args.json:
        args.json.write_text(json.dumps({"once": once, "median": {k: statistics.median(v) for k, v in rows.items()},
                                         "tokens": args.tokens, "checkpoint": str(args.checkpoint)}, indent=1))


def apptest(store: Path, text: str) -> dict[str, float]:
    """Seconds of each dashboard script run: Run pressed on the Input page, then each page's first visit."""
    import os

    from streamlit.testing.v1 import AppTest

    os.environ["DELTALAB_STORE"] = str(store)
    at = AppTest.from_file(str(Path(__file__).resolve().parents[1] / "app" / "dashboard.py"), default_timeout=300)
    at.run()
    at.sidebar.radio(key="page").set_value("Input").run()
    time.sleep(5)  # the page warms the model in the background while the researcher types
    at.text_area(key="input_text").set_value(text).run()
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    at.button(key="input_run").click().run()
    out["Run pressed -> Input page drawn with the input's charts"] = time.perf_counter() - t0
    if at.exception or at.error:
        raise SystemExit(f"the Input page failed: {[e.value for e in at.error] or [e.message for e in at.exception]}")
    for page in ("Text", "Betas", "Keys", "Spectra", "Effective rank", "Token"):
        t0 = time.perf_counter()
        at.sidebar.radio(key="page").set_value(page).run()
        out[f"first visit: {page}"] = time.perf_counter() - t0
    return out


if __name__ == "__main__":
    main()
