"""`deltalab capture --reduce ranks,spectra,attention [--keep states]` and `--state-every N`: analyses computed
while each batch is in memory equal the probes run on the stored data afterwards; states can be left out or
thinned; bad flags fail in one line and write nothing."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from deltalab import store
from deltalab.app.cli import app
from deltalab.probes.results import read_results

ZOO = Path(__file__).parents[2] / "models" / "zoo"
MODEL = ZOO / "s4-deltaproduct2"
# 7 sequences in batches of 3 (a short last batch), padding (min_length), two state chunks and a bit
DATA = "modarith:length=150,samples=7,seed=5,min_length=40"


def _capture(out: Path, *extra: str) -> None:
    res = CliRunner().invoke(app, ["capture", str(MODEL), "--data", DATA, "--out", str(out), "--batch-size", "3",
                                   "--no-progress", *extra])
    assert res.exit_code == 0, res.output


def _probe(store_path: Path, name: str, *extra: str) -> None:
    res = CliRunner().invoke(app, ["probe", name, "--store", str(store_path), "--name", f"{name}-probe", *extra])
    assert res.exit_code == 0, res.output


def _assert_same(a, b, rtol: float = 1e-5, skip: str = "no-such-name") -> None:
    """Every variable and record field of probe result `b` (except names starting with `skip`) is in `a` with equal
    values (NaN where NaN)."""
    missing = {v for v in b.data_vars if not v.startswith(skip)} - set(a.data_vars)
    assert not missing, missing
    for v in [v for v in b.data_vars if not v.startswith(skip)]:
        x, y = np.asarray(a[v].values), np.asarray(b[v].values)
        assert x.shape == y.shape, v
        if np.issubdtype(y.dtype, np.inexact):
            np.testing.assert_allclose(x, y, rtol=rtol, atol=1e-6, equal_nan=True, err_msg=v)
        else:
            np.testing.assert_array_equal(x, y, err_msg=v)
    assert a.attrs["complete"] and [r["layer"] for r in a.attrs["records"]] == [r["layer"] for r in b.attrs["records"]]
    for ra, rb in zip(a.attrs["records"], b.attrs["records"]):
        for key, value in rb.items():
            if key.startswith(skip):
                continue
            if isinstance(value, float):
                assert ra[key] == pytest.approx(value, rel=rtol, abs=1e-6, nan_ok=True), key
            else:
                assert ra[key] == value, key


@pytest.fixture(scope="module")
def reduced(tmp_path_factory):
    out = tmp_path_factory.mktemp("reduce") / "s.zarr"
    _capture(out, "--reduce", "ranks,spectra,attention")
    return out


def test_reductions_equal_the_probes(reduced):
    ds = store.open(reduced)
    assert "state" not in ds and {"k", "v", "beta", "q"} <= set(ds.data_vars)  # states dropped by default
    for name in ("erank", "spectra", "attention"):
        _probe(reduced, name)
        _assert_same(read_results(reduced, name), read_results(reduced, f"{name}-probe"))
    attrs = read_results(reduced, "erank").attrs
    assert attrs["params"]["reduced_during_capture"] and attrs["command_line"][0] == "deltalab"
    assert attrs["reduced_seqs"] == [[0, 7]]


def test_keep_states_stores_them_and_reductions_still_equal(tmp_path):
    out = tmp_path / "s.zarr"
    _capture(out, "--reduce", "ranks", "--keep", "states")
    assert "state" in store.open(out)
    _probe(out, "erank")  # the probe starts each chunk from the stored state; the reduction from its own
    _assert_same(read_results(out, "erank"), read_results(out, "erank-probe"))


def test_resumed_and_appended_captures_reduce_every_sequence(tmp_path):
    out = tmp_path / "s.zarr"
    _capture(out)  # no reductions: the first segment is reduced from the store at the next --reduce
    res = CliRunner().invoke(app, ["capture", str(MODEL), "--data", "modarith:length=150,samples=4,seed=9",
                                   "--out", str(out), "--no-progress", "--reduce", "ranks", "--keep", "states",
                                   "--json"])
    assert res.exit_code == 0, res.output
    assert '"reduced_from_store": {"erank": 7}' in res.output
    res = CliRunner().invoke(app, ["capture", str(MODEL), "--data", "modarith:length=150,samples=2,seed=4",
                                   "--out", str(out), "--no-progress", "--reduce", "ranks", "--keep", "states",
                                   "--json"])  # the group grows to take the new batch; nothing is recomputed
    assert res.exit_code == 0 and '"reduced_from_store": {"erank": 0}' in res.output, res.output
    tok = read_results(out, "erank")
    assert tok.sizes["seq"] == 13 and tok.attrs["reduced_seqs"] == [[0, 13]]
    _probe(out, "erank")
    _assert_same(tok, read_results(out, "erank-probe"))


def test_rank_every_equals_the_probe_with_every(tmp_path):
    out = tmp_path / "s.zarr"
    _capture(out, "--reduce", "ranks", "--rank-every", "16")
    _probe(out, "erank", "--every", "16")
    reduced = read_results(out, "erank")
    _assert_same(reduced, read_results(out, "erank-probe"))
    er = np.asarray(reduced["erank"].values)  # [seq, layer, pos, head]
    ranked = (np.arange(er.shape[2]) + 1) % 16 == 0
    assert np.isnan(er[:, :, ~ranked]).all() and np.isfinite(er[:, :, ranked]).any()
    assert reduced.attrs["params"]["every"] == 16 and np.isfinite(reduced["erank_mean"].values).all()


def test_rank_every_a_chunk_multiple_keeps_only_the_ranked_states(tmp_path, monkeypatch):
    """--rank-every 64 ranks chunk-boundary states only: capture keeps those two of each layer's three (cut as the
    layer runs) and the reductions, run on the reducer thread, still equal the probe on the stored inputs."""
    from deltalab.probes.reduce import CaptureReductions

    seen, compute = [], CaptureReductions.compute

    def spy(self, attrs, tensors, host):
        seen.append((tuple(tensors["state"].shape), threading.current_thread().name))
        return compute(self, attrs, tensors, host)

    monkeypatch.setattr(CaptureReductions, "compute", spy)
    out = tmp_path / "s.zarr"
    _capture(out, "--reduce", "ranks", "--rank-every", "64")
    assert len(seen) == 3  # three batches
    for shape, thread in seen:
        assert shape[2] == 2 and thread.startswith("deltalab-reduce")  # (layer, seq, chunk, ...): after 64, 128
    _probe(out, "erank", "--every", "64")
    reduced = read_results(out, "erank")
    _assert_same(reduced, read_results(out, "erank-probe"))
    er = np.asarray(reduced["erank"].values)
    assert np.isfinite(er[:, :, 63]).any() and np.isnan(er[:, :, 64:127]).all()


def test_state_every_keeps_every_nth_boundary(tmp_path):
    full, thin = tmp_path / "full.zarr", tmp_path / "thin.zarr"
    _capture(full)
    _capture(thin, "--state-every", "2")
    a, b = store.open(full), store.open(thin)
    assert a.attrs["chunk_size"] == 64 and b.attrs["chunk_size"] == 128
    assert list(a["chunk_pos"].values) == [0, 64, 128, 150] and list(b["chunk_pos"].values) == [0, 128, 150]
    np.testing.assert_array_equal(b["state"].values, a["state"].isel(chunk=[0, 2, 3]).values)
    for path in (full, thin):
        _probe(path, "erank")
    _assert_same(read_results(thin, "erank-probe"), read_results(full, "erank-probe"), rtol=1e-4)


@pytest.mark.parametrize("flags, message", [
    (["--reduce", "ranks,pca"], "--reduce pca: unknown; choose among ranks,spectra,attention"),
    (["--keep", "states"], "--keep only applies with --reduce"),
    (["--state-every", "0"], "--state-every must be >= 1, got 0"),
    (["--reduce", "ranks", "--rank-every", "0"], "--rank-every 0: pass a positive number of tokens"),
    (["--reduce", "ranks", "--keep", "keys"], "--keep keys: unknown"),
    (["--state-every", "2", "--hooks", "k,v,beta"], "--state-every 2 but no states are captured"),
    (["--reduce", "spectra", "--spectra-precision", "float16"], "--spectra-precision float16: pass one of float64"),
    (["--spectra-precision", "float32"], "--spectra-precision only applies with --reduce spectra"),
])
def test_bad_reduce_flags_fail_in_one_line_and_write_nothing(tmp_path, flags, message):
    out = tmp_path / "s.zarr"
    res = CliRunner().invoke(app, ["capture", str(MODEL), "--data", DATA, "--out", str(out), "--no-progress", *flags])
    assert res.exit_code == 2 and message in res.output, res.output
    assert len([ln for ln in res.output.splitlines() if ln.strip()]) == 1
    assert not out.exists()


def test_reductions_read_hooks_that_are_not_stored(reduced, tmp_path):
    """`--hooks tokens,beta --reduce ...`: q, k, v are captured for the reductions and never written; the
    results equal those of the store that kept them."""
    out = tmp_path / "s.zarr"
    _capture(out, "--reduce", "ranks,spectra,attention", "--hooks", "tokens,beta")
    ds = store.open(out)
    assert ds.attrs["variables"] == ["tokens", "doc_start", "pad", "beta", "complete"]
    assert not (out / "k").exists() and not (out / "q").exists()
    for name in ("erank", "spectra", "attention"):
        _assert_same(read_results(out, name), read_results(reduced, name))
    res = CliRunner().invoke(app, ["capture", str(MODEL), "--data", "modarith:length=150,samples=2,seed=1",
                                   "--out", str(out), "--no-progress", "--hooks", "tokens,beta", "--batch-size", "3"])
    assert res.exit_code == 0, res.output  # a plain append: the reductions cannot cover it later...
    res = CliRunner().invoke(app, ["capture", str(MODEL), "--data", "modarith:length=150,samples=2,seed=2",
                                   "--out", str(out), "--no-progress", "--hooks", "tokens,beta", "--batch-size", "3",
                                   "--reduce", "ranks"])
    assert res.exit_code == 2 and "captured without --reduce" in res.output, res.output  # ...and says so
    assert len(res.output.strip().splitlines()) == 1
    kept = read_results(out, "erank")["erank"].isel(seq=slice(0, 7))  # what was reduced before is kept
    np.testing.assert_array_equal(kept.values, read_results(reduced, "erank")["erank"].values)
    assert store.open(out).sizes["seq"] == 11  # and both appended segments are in the store


def test_state_every_must_match_on_append(tmp_path):
    out = tmp_path / "s.zarr"
    _capture(out, "--state-every", "2")
    res = CliRunner().invoke(app, ["capture", str(MODEL), "--data", "modarith:length=150,samples=2,seed=1",
                                   "--out", str(out), "--no-progress", "--batch-size", "3"])
    assert res.exit_code == 2 and "pass --state-every 2" in res.output, res.output


@pytest.mark.gpu
def test_gpu_reductions_on_the_device_equal_the_probes(tmp_path):
    """On CUDA the reductions run on the batch's GPU tensors (nothing copied back for them); the probes, run
    afterwards on the stored data with --device cuda, give the same results."""
    out = tmp_path / "s.zarr"
    _capture(out, "--device", "cuda", "--reduce", "ranks,spectra,attention", "--rank-every", "1",
             "--keep", "states")
    for name in ("erank", "spectra", "attention"):
        _probe(out, name, "--device", "cuda")
        _assert_same(read_results(out, name), read_results(out, f"{name}-probe"), rtol=1e-4)
    assert read_results(out, "erank").attrs["params"]["device"] == "cuda"


def test_a_failing_reduction_stops_capture_with_its_error(tmp_path, monkeypatch):
    """The reductions run on their own thread: an error there reaches the caller (not a hang, not a silent store
    without results), and the batches already written stay readable."""
    from deltalab.probes.reduce import CaptureReductions

    def boom(self, attrs, tensors, host):
        raise RuntimeError("reduction failed on purpose")

    monkeypatch.setattr(CaptureReductions, "compute", boom)
    out = tmp_path / "s.zarr"
    res = CliRunner().invoke(app, ["capture", str(MODEL), "--data", DATA, "--out", str(out), "--batch-size", "3",
                                   "--no-progress", "--reduce", "ranks"])
    assert res.exit_code != 0
    assert "reduction failed on purpose" in repr(res.exception) + res.output
    assert store.open(out).sizes["seq"] == 3  # the first batch, written before its reduction failed, is kept
    monkeypatch.undo()
    _capture(out, "--reduce", "ranks")  # the rerun resumes: the rest captured, the first batch reduced from the store
    assert store.open(out).sizes["seq"] == 7
    assert read_results(out, "erank").attrs["reduced_seqs"] == [[0, 7]]


@pytest.mark.parametrize(("heads", "length", "every"), [(768, 4096, 2048), (8, 512, 64), (1152, 2048, 2048),
                                                         (256, 8192, 512), (768, 100, 64), (96, 150, 128)])
def test_auto_rank_every_ranks_half_a_state_per_token_within_the_sequence(heads, length, every):
    from deltalab.probes.reduce import RANKED_PER_TOKEN, auto_rank_every

    got = auto_rank_every(heads, length)
    assert got == every and got % 64 == 0
    assert heads / got <= RANKED_PER_TOKEN or got == length // 64 * 64  # within budget, or capped by the sequence


def test_auto_rank_every_is_resolved_for_the_captured_model(tmp_path):
    """rank_every=None (the CLI's CUDA default): the model's delta-rule heads and the sequence length pick it
    before capture, and the results record the value used (here: the bundled model's few heads -> 64)."""
    from deltalab.probes.reduce import CaptureReductions
    from deltalab.store import capture

    red = CaptureReductions(["ranks"], rank_every=None)
    out = tmp_path / "s.zarr"
    capture(MODEL, DATA, out, hooks=["tokens", "beta"], batch_size=3, progress=False, reductions=red)
    assert red.rank_every == 64
    reduced = read_results(out, "erank")
    assert reduced.attrs["params"]["every"] == 64
    er = np.asarray(reduced["erank"].values)
    assert np.isfinite(er[:, :, 63]).any() and np.isnan(er[:, :, 64:127]).all()


def test_steady_pace_leaves_out_start_up_and_drain():
    from deltalab.store.capture import _steady

    assert _steady([0.0, 1.0]) is None  # two batches: no spacing between full-pipeline batches to speak of
    assert _steady([10.0, 12.0, 14.0, 16.5]) == pytest.approx(6.5 / 3, abs=1e-4)  # rounded to 0.1 ms
