"""Padding: variable-length task samples and unpacked text (`pack=no`) carry a `pad` mask into the store;
`store.open` hides padded positions (NaN) and the states that include them, so no probe analyses padding."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from deltalab import store
from deltalab.app.cli import app
from deltalab.store.data import load_data

ZOO = Path(__file__).parents[2] / "models" / "zoo"


@pytest.fixture(scope="module")
def padded_store(tmp_path_factory):
    out = tmp_path_factory.mktemp("pad") / "s.zarr"
    res = CliRunner().invoke(app, ["capture", str(ZOO / "s4-deltaproduct2"), "--data",
                                   "modarith:length=150,samples=6,seed=3,min_length=20", "--out", str(out),
                                   "--no-progress"])
    assert res.exit_code == 0, res.output
    return out


def test_task_padding_is_recorded_and_masked(padded_store):
    raw = store.open(padded_store, mask_padding=False)
    pad = np.asarray(raw["pad"].values)
    lengths = (~pad).sum(1)
    assert pad.any() and (lengths < 150).any() and (lengths >= 20).all()
    assert not (np.diff(pad.astype(int), axis=1) < 0).any()  # right padding: once padded, padded to the end
    ds = store.open(padded_store)
    beta = np.asarray(ds["beta"].values)  # [seq, layer, pos, step, head]
    by_token = np.moveaxis(beta, 2, 1)  # [seq, pos, layer, step, head]
    assert np.isnan(by_token[pad]).all() and np.isfinite(by_token[~pad]).all()
    state = np.asarray(ds["state"].values)  # [seq, layer, chunk, head, dk, dv]
    chunk_pos = np.asarray(ds["chunk_pos"].values)
    for s, n in enumerate(lengths):
        polluted = chunk_pos > n
        assert np.isnan(state[s, :, polluted]).all() and np.isfinite(state[s, :, ~polluted]).all()
    np.testing.assert_array_equal(np.asarray(ds["tokens"].values), np.asarray(raw["tokens"].values))


def test_probes_never_read_padding(padded_store):
    raw = store.open(padded_store, mask_padding=False)
    n_real = int((~np.asarray(raw["pad"].values)).sum())
    res = CliRunner().invoke(app, ["probe", "betas", "--store", str(padded_store), "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)
    assert {r["n"] for r in rows} == {n_real}  # every head counts the real tokens only
    for probe in ("keys", "spectra", "erank", "lengthgen", "linear"):
        res = CliRunner().invoke(app, ["probe", probe, "--store", str(padded_store), "--json"])
        assert res.exit_code == 0, (probe, res.output)
    pad = np.asarray(raw["pad"].values)
    from deltalab.store.reader import open_results

    erank = open_results(padded_store, "erank")
    per_token = [v for v in erank.data_vars if {"seq", "pos"} <= set(erank[v].dims) and erank[v].dtype.kind == "f"]
    assert per_token
    for v in per_token:
        vals = np.asarray(erank[v].transpose("seq", "pos", ...).values)
        assert np.isnan(vals[pad]).all() and np.isfinite(vals[~pad]).all(), v


def test_unpacked_text_pads_each_document(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("x" * 50)
    (docs / "b.txt").write_text("y" * 130)
    data = load_data(f"text:{docs}:length=64,pack=no", ZOO / "stdlib-deltanet")
    assert data.tokens.shape == (4, 64)  # a: 1 row; b: 3 rows (64 + 64 + 2)
    n_a, n_b = (~data.pad[0]).sum(), (~data.pad[3]).sum()  # real tokens (plus end-of-text where the tokenizer has one)
    assert data.pad[1:3].sum() == 0 and n_a in (50, 51) and n_b in (2, 3) and n_b - 2 == n_a - 50
    assert data.doc_start[:, 0].tolist() == [True, True, False, False]
    assert (data.labels[data.pad] == -100).all()
    assert data.spec.endswith(",pack=no")
    with pytest.raises(Exception, match="pack='maybe' must be yes"):
        load_data(f"text:{docs}:length=64,pack=maybe", ZOO / "stdlib-deltanet")
