"""linear and lengthgen probes: a planted copy head is decoded, a random layer is not; accuracy vs position."""

from __future__ import annotations

import numpy as np
import pytest

from deltalab.models import IGNORE_INDEX
from deltalab.probes import data, lengthgen, linear
from deltalab.probes.synthetic import COPY_HEAD, synthetic_arrays, write_synthetic_store

KW = {"n_seq": 10, "length": 96, "seed": 6}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return write_synthetic_store(tmp_path_factory.mktemp("lin") / "s.zarr", batch_size=4, train_length=64, **KW)


def test_linear_decodes_the_copy_head_only(store):
    res = linear.run(data.open_store(store), max_train=3000)
    out = res.dataset
    acc = out["accuracy"]
    assert acc.sel(layer=0, probe_head=linear.ALL_HEADS) > 0.95
    assert acc.sel(layer=0, probe_head=COPY_HEAD) > 0.95
    assert acc.sel(layer=1, probe_head=linear.ALL_HEADS) < 0.5  # layer 1 carries no label information
    assert acc.sel(layer=0, probe_head=3) < 0.5
    test_seqs = set(out.attrs["test_seqs"])
    assert 0 < len(test_seqs) < KW["n_seq"]
    by_pos = out["accuracy_by_pos"].sel(layer=0, probe_head=linear.ALL_HEADS).values
    assert np.isnan(by_pos[0])  # position 0 is unlabelled in every sequence
    assert np.nanmean(by_pos) > 0.95
    rec = next(r for r in res.records if r["layer"] == 0 and r["head"] is None)
    assert rec["n_classes"] == 6 and rec["chance"] < 0.5 and rec["features"] == "o"


def test_linear_rebuilt_readout_equals_stored(store):
    ds = data.open_store(store)
    stored = linear.run(ds, per_head=False, max_train=2000).dataset["accuracy"].values
    rebuilt = linear.run(ds.drop_vars("o"), per_head=False, max_train=2000).dataset["accuracy"].values
    np.testing.assert_allclose(rebuilt, stored, atol=0.02)


def test_linear_bad_features(store):
    with pytest.raises(ValueError, match="nope"):
        linear.run(data.open_store(store), features="nope")


def test_lengthgen_within_and_beyond(store):
    res = lengthgen.run(data.open_store(store), bucket=32)
    out = res.dataset
    a = synthetic_arrays(train_length=64, **KW)
    valid = a["labels"] != IGNORE_INDEX
    n = valid.sum(0)
    want = np.where(n > 0, (a["correct"] & valid).sum(0) / np.maximum(n, 1), np.nan)
    np.testing.assert_allclose(out["accuracy"].values, want)
    assert out.attrs["accuracy_within_train"] == 1.0
    assert 0.15 < out.attrs["accuracy_beyond_train"] < 0.45  # planted: right 30% of the time
    assert out.attrs["first_failure_pos"] == 64
    assert out["sequence_accuracy"].values[63] == 1.0 and out["sequence_accuracy"].values[-1] < 0.1
    assert [r["beyond_train"] for r in res.records] == [False, False, True]
    assert res.records[2]["pos_start"] == 64 and res.records[2]["loss"] > 1.0


def test_lengthgen_train_length_override_and_missing_vars(store, tmp_path):
    out = lengthgen.run(data.open_store(store), train_length=32).dataset
    assert out["beyond_train"].values.sum() == 96 - 32
    ds = data.open_store(store)
    del ds.attrs["train_length"]
    (tmp_path / "task.json").write_text('{"name": "S4", "train_length": 48}')
    assert lengthgen.run(ds, checkpoint=tmp_path).dataset.attrs["train_length"] == 48
    assert lengthgen.run(ds).dataset.attrs["train_length"] == -1  # unknown
    with pytest.raises(ValueError, match="correct"):
        lengthgen.run(data.open_store(store).drop_vars("correct"))
