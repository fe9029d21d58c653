"""Stores for the dashboard tests, built once per pytest run (memoised here, shared by the app test modules).

- `probed_store`: the planted synthetic store (probes.synthetic: layer 0 head 0 rotates with beta = 2 and
  keys in a 3-D subspace) with every store-only probe's results;
- `bare_store`: a small synthetic store without probe results;
- `default_store`: the default-store path end to end: a tiny random S4 checkpoint standing in for the
  bundled one, captured and probed (intervene included) by app.default_store.ensure_default_store.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

_BUILT: dict[str, Any] = {}
STORE_PROBES = ("betas", "keys", "spectra", "erank", "linear", "lengthgen")


def _base(tmp_path_factory) -> Path:
    if "base" not in _BUILT:
        _BUILT["base"] = tmp_path_factory.mktemp("app_stores")
    return _BUILT["base"]


def probed_store(tmp_path_factory) -> Path:
    if "probed" not in _BUILT:
        os.environ.setdefault("TQDM_DISABLE", "1")
        from deltalab.app.default_store import run_probe
        from deltalab.probes.synthetic import write_synthetic_store

        path = write_synthetic_store(_base(tmp_path_factory) / "probed.zarr", n_seq=8, length=128, n_layers=2,
                                     n_heads=4, gated=True)
        for name in STORE_PROBES:
            run_probe(path, name)
        _BUILT["probed"] = path
    return _BUILT["probed"]


def bare_store(tmp_path_factory) -> Path:
    if "bare" not in _BUILT:
        from deltalab.probes.synthetic import write_synthetic_store

        _BUILT["bare"] = write_synthetic_store(_base(tmp_path_factory) / "bare.zarr", n_seq=4, length=64,
                                               n_layers=1, n_heads=4, gated=False)
    return _BUILT["bare"]


def tiny_checkpoint(folder: Path, train_length: int = 32) -> Path:
    """A random 1-layer, 2-head gated DeltaProduct_2 over the S4 vocabulary, with its training length beside it."""
    import torch

    from deltalab.models import DeltaProductForCausalLM, ModelConfig, save_checkpoint

    torch.manual_seed(0)
    cfg = ModelConfig(model_type="gated_deltaproduct", vocab_size=24, hidden_size=32, num_hidden_layers=1,
                      num_heads=2, head_dim=16, expand_v=1.0, num_householder=2, use_forget_gate=True,
                      use_output_gate=False, use_short_conv=False, allow_neg_eigval=True)
    save_checkpoint(DeltaProductForCausalLM(cfg), folder)
    (folder / "train.json").write_text(json.dumps({"train_length": train_length}))
    (folder / "README.md").write_text("# Tiny S4 stand-in\n\nA random model standing in for the bundled checkpoint.")
    return folder


def default_store(tmp_path_factory) -> dict[str, Any]:
    """{checkpoint, cache, store, progress}: the default store built through ensure_default_store."""
    if "default" not in _BUILT:
        os.environ.setdefault("TQDM_DISABLE", "1")
        from deltalab.app.default_store import STORE_NAME, ensure_default_store

        base = _base(tmp_path_factory)
        ckpt = tiny_checkpoint(base / "s4-tiny")
        cache = base / "cache"
        progress: list[tuple[float, str]] = []
        store = ensure_default_store(lambda f, m: progress.append((f, m)), checkpoint=ckpt,
                                     out=cache / STORE_NAME, samples=8)
        _BUILT["default"] = {"checkpoint": ckpt, "cache": cache, "store": store, "progress": progress}
    return _BUILT["default"]


def other_checkpoint_store(tmp_path_factory) -> Path:
    """A second tiny S4 checkpoint (another random seed) captured on the default store's inputs, without probe
    results: the two-store comparison (previews fill in)."""
    if "other" not in _BUILT:
        import torch

        from deltalab import store
        from deltalab.models import DeltaProductForCausalLM, save_checkpoint

        built = default_store(tmp_path_factory)
        base = _base(tmp_path_factory)
        first = store.open(built["store"])
        from deltalab.models import load_checkpoint

        cfg = load_checkpoint(built["checkpoint"]).config
        torch.manual_seed(1)
        ckpt = base / "s4-tiny-other"
        save_checkpoint(DeltaProductForCausalLM(cfg), ckpt)
        out = base / "other.zarr"
        store.capture(ckpt, first.attrs["data_spec"], out, batch_size=16, progress=False,
                      command_line=["deltalab", "capture", str(ckpt), "--data", first.attrs["data_spec"], "--out",
                                    str(out)])
        _BUILT["other"] = out
    return _BUILT["other"]
