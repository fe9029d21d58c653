"""Capture on a model spread over devices with transformers' device_map (tests/store/device_map.py).

`run_same` captures one saved model on one device and through device_map auto/balanced and compares every variable;
`run_big` builds the model on the meta device, creates its weights where accelerate places them and captures it with
reductions. On the CPU they run on tiny configs (a smoke run); the tests marked multi_gpu split the model over the
GPUs and need at least two.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.store import device_map  # noqa: E402

SMOKE = dict(tiny=True, batch=2, length=96, batches=1)


def _same(tmp_path: Path) -> dict:
    r = device_map.run_same(device_map.Options(**SMOKE, dir=str(tmp_path / "w")))
    assert not (tmp_path / "w").exists()  # the stores and the checkpoint are removed
    return r


def test_same_compares_every_variable_of_each_placement(tmp_path):
    r = _same(tmp_path)
    assert [row["run"] for row in r["rows"]] == ["one device", "device_map auto", "device_map balanced"]
    for label in ("device_map auto", "device_map balanced"):
        diffs = r["max_rel_diff"][label]
        assert {"q", "k", "v", "beta", "g", "state", "o"} <= set(diffs)
        assert max(diffs.values()) == 0.0  # one device: the same arithmetic, bit for bit


def test_big_builds_on_the_devices_and_captures_with_reductions(tmp_path):
    r = device_map.run_big(device_map.Options(**SMOKE, family="qwen3_next", dir=str(tmp_path / "w")))
    assert not (tmp_path / "w").exists()
    assert r["reduce"] == ["ranks", "spectra"] and r["tok_s"] > 0 and r["finite_beta"] == 1.0
    assert sum(r["placement"].values()) == pytest.approx(r["params_b"] * 1e3, rel=1e-3)  # every parameter placed
    assert r["store_bytes_per_token"] < 4096  # states and q, k, v not stored


@pytest.mark.multi_gpu
def test_two_gpus_give_the_store_of_one_bit_for_bit(tmp_path):
    """On two GPUs "balanced" splits the layers; every captured variable equals the one-GPU store exactly (same
    kernels, same order). Before the Triton forward ran under its inputs' device guard, the second GPU's layers ran
    on the first GPU's stream and the stores differed by 0.5 in beta and 1e18 in o."""
    r = _same(tmp_path)
    balanced = next(row for row in r["rows"] if row["run"] == "device_map balanced")
    assert len([d for d in balanced["placement"] if d.startswith("cuda")]) >= 2
    for label in ("device_map auto", "device_map balanced"):
        assert max(r["max_rel_diff"][label].values()) == 0.0, r["max_rel_diff"][label]


@pytest.mark.multi_gpu
def test_a_model_split_over_the_gpus_captures_with_reductions(tmp_path):
    """A per-GPU budget below the model's size makes accelerate place its layers on several GPUs; the capture with
    reductions then runs across them, every parameter placed and every beta finite."""
    import torch
    import transformers as tf
    from accelerate import init_empty_weights

    cfg = device_map.config("qwen3_next", True, None)
    with init_empty_weights():
        size = sum(p.numel() * 2 for p in tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).parameters())
    budget = 1.5 * size / torch.cuda.device_count() / 2**30
    r = device_map.run_big(device_map.Options(**SMOKE, family="qwen3_next", max_memory_gib=budget,
                                              dir=str(tmp_path / "w")))
    assert len([d for d in r["placement"] if d.startswith("cuda")]) >= 2, r["placement"]
    assert r["reduce"] == ["ranks", "spectra"] and r["tok_s"] > 0 and r["finite_beta"] == 1.0
    assert sum(r["placement"].values()) == pytest.approx(r["params_b"] * 1e3, rel=1e-3)
