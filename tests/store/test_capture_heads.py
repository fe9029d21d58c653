"""`deltalab capture --heads`: a capture of some heads is the full capture restricted to them (bitwise), with the
model's head numbers as the `head` coordinate; the probes and the capture-time reductions give the full store's
results for those heads; the size estimate shrinks with the heads; bad selections and a resume with other heads
are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from deltalab import store
from deltalab.app.cli import app
from deltalab.store import schema
from deltalab.store.plan import CaptureError, resolve_heads

ZOO = Path(__file__).parents[2] / "models" / "zoo"
GATED = ZOO / "stdlib-gated-deltaproduct2"
SPEC = "S4:length=70,samples=4,seed=0"
HOOKS = "tokens,labels,loss,q,k,v,beta,g,state,o"
PER_HEAD = ("q", "k", "v", "beta", "g", "state", "o")
PROBES = ("betas", "keys", "spectra", "erank")


def cli(*args: str):
    return CliRunner().invoke(app, [*args])


def capture(folder: Path, out: Path, *extra: str, hooks: str = HOOKS, spec: str = SPEC) -> dict:
    res = cli("capture", str(folder), "--data", spec, "--out", str(out), "--hooks", hooks, "--batch-size", "2",
              "--no-progress", "--json", *extra)
    assert res.exit_code == 0, res.output
    return json.loads(next(ln for ln in res.output.splitlines() if ln.startswith('{"store"')))


def error_line(res) -> str:
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, res.output
    return lines[0]


def assert_restricted(full, sub, heads: list[int], variables=PER_HEAD) -> None:
    """Every per-head variable of `sub` is `full` at those heads, bit for bit (NaN where NaN)."""
    assert sub["head"].values.tolist() == heads
    for var in variables:
        if var not in full:
            continue
        assert sub[var].dims == full[var].dims, var
        np.testing.assert_array_equal(sub[var].values, full[var].sel(head=heads).values, err_msg=var)


@pytest.fixture(scope="module")
def gated_pair(tmp_path_factory):
    """The gated DeltaProduct_2 from the zoo captured whole and with --heads 1,3, both probed."""
    base = tmp_path_factory.mktemp("heads")
    full, sub = base / "full.zarr", base / "sub.zarr"
    capture(GATED, full)
    summary = capture(GATED, sub, "--heads", "3,1,3-3")  # unsorted and repeated: sorted, unique
    for path in (full, sub):
        for probe in PROBES:
            res = cli("probe", probe, "--store", str(path))
            assert res.exit_code == 0, (probe, res.output)
    return full, sub, summary


def test_heads_capture_equals_the_full_capture_at_those_heads(gated_pair):
    full, sub, _ = gated_pair
    a, b = store.open(full), store.open(sub)
    assert b.attrs["heads"] == [1, 3] and b.sizes["head"] == 2 and a.sizes["head"] == 4
    assert a.attrs["deltalab_format"] == b.attrs["deltalab_format"] == schema.CHECKSUM_FORMAT  # crc32c on every chunk
    assert_restricted(a, b, [1, 3])
    for var in ("tokens", "labels", "loss", "correct"):  # per-token variables are untouched
        np.testing.assert_array_equal(b[var].values, a[var].values)


@pytest.mark.parametrize("probe", PROBES)
def test_probe_results_equal_the_full_stores_at_those_heads(gated_pair, probe):
    full, sub, _ = gated_pair
    ra, rb = store.open_results(full, probe), store.open_results(sub, probe)
    assert rb["head"].values.tolist() == [1, 3]  # the model's head numbers
    for name, da in rb.data_vars.items():
        if "head" not in da.dims:
            continue
        want = np.asarray(ra[name].sel(head=[1, 3]).values).astype(np.complex128)  # spectra: complex eigenvalues
        got = np.asarray(da.values).astype(np.complex128)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, equal_nan=True, err_msg=f"{probe}.{name}")
    recs_a = {(r["layer"], r["head"], r.get("step")): r for r in ra.attrs["records"]}
    recs_b = rb.attrs["records"]
    assert sorted({r["head"] for r in recs_b}) == [1, 3]
    for r in recs_b:
        ref = recs_a[(r["layer"], r["head"], r.get("step"))]
        for k, v in r.items():
            if isinstance(v, float) and v == v:
                assert abs(v - ref[k]) <= 1e-6 * max(1.0, abs(ref[k])), (probe, k)


def test_reductions_during_capture_equal_the_full_stores_probes(gated_pair, tmp_path):
    full, _, _ = gated_pair
    out = tmp_path / "r.zarr"
    summary = capture(GATED, out, "--heads", "2,0", "--reduce", "ranks,spectra")
    assert summary["reduced"] == ["ranks", "spectra"]
    assert "state" not in store.open(out)  # reduced, not kept
    for probe in ("erank", "spectra"):
        ra, rb = store.open_results(full, probe), store.open_results(out, probe)
        assert rb["head"].values.tolist() == [0, 2]
        for name, da in rb.data_vars.items():
            if "head" in da.dims:
                np.testing.assert_allclose(np.asarray(da.values).astype(np.complex128),
                                           np.asarray(ra[name].sel(head=[0, 2]).values).astype(np.complex128),
                                           rtol=1e-5, atol=1e-6, equal_nan=True, err_msg=f"{probe}.{name}")


def test_estimate_shrinks_with_the_heads(gated_pair):
    full, sub, summary = gated_pair
    ds = store.open(full)
    H, k = ds.sizes["head"], 2
    per_head = sum(int(ds[v].nbytes) for v in ds.data_vars if "head" in ds[v].dims)
    rest = sum(int(ds[v].nbytes) for v in ds.data_vars if "head" not in ds[v].dims)
    tokens = ds.sizes["seq"] * ds.sizes["pos"]
    assert summary["estimated_bytes_per_token"] == pytest.approx((rest + per_head * k / H) / tokens, rel=1e-12)
    assert summary["estimated_bytes_per_token"] < (rest + per_head) / tokens


def test_resume_with_the_same_heads_and_refusal_of_other_heads(gated_pair):
    _, sub, _ = gated_pair
    again = capture(GATED, sub, "--heads", "1,3")
    assert again["written"] == 0 and again["skipped"] == 4
    line = error_line(cli("capture", str(GATED), "--data", SPEC, "--out", str(sub), "--hooks", HOOKS,
                          "--heads", "0,1"))
    assert "heads 1,3" in line and "this capture heads 0,1" in line and "pass --heads 1,3" in line
    line = error_line(cli("capture", str(GATED), "--data", "S4:length=70,samples=2,seed=5", "--out", str(sub),
                          "--hooks", HOOKS))  # appending all heads to a store of some
    assert "this capture all heads" in line and "pass --heads 1,3" in line


def test_full_store_refuses_a_heads_append(gated_pair):
    full, _, _ = gated_pair
    line = error_line(cli("capture", str(GATED), "--data", SPEC, "--out", str(full), "--hooks", HOOKS,
                          "--heads", "0"))
    assert "all heads" in line and "omit --heads" in line


@pytest.mark.parametrize(("heads", "needle"), [
    ("4", "head 4 is out of range: the model has 4 heads (0..3)"),
    ("-1", "'-1' is not an integer or a range"),
    ("", "--heads is empty"),
    (",", "--heads is empty"),
    ("a", "is not an integer or a range; pass e.g. --heads 0,3-5"),
    ("5-3", "is an empty range"),
    ("key:0", "does not group its heads"),
])
def test_bad_heads_are_one_line_errors(tmp_path, heads, needle):
    out = tmp_path / "s.zarr"
    line = error_line(cli("capture", str(GATED), "--data", SPEC, "--out", str(out), "--heads", heads))
    assert needle in line
    assert not out.exists()


def test_grouped_value_and_key_head_selection():
    key_head_of = [0, 0, 1, 1, 2, 2]
    assert resolve_heads("1,4", 6, key_head_of) == ([1, 4], [0, 2])
    assert resolve_heads("key:1", 6, key_head_of) == ([2, 3], [1])
    assert resolve_heads(None, 6, key_head_of) is None
    with pytest.raises(CaptureError, match=r"value head 6 is out of range: the model has 6 value heads \(0..5\) "
                                           r"and 3 key heads; --heads names value heads .* --heads key:0,2"):
        resolve_heads("6", 6, key_head_of)
    with pytest.raises(CaptureError, match=r"key head 3 is out of range: the model has 3 key heads \(0..2\) "
                                           r"and 6 value heads; drop key: to name value heads"):
        resolve_heads("key:3", 6, key_head_of)


def test_schema_key_head_positions():
    assert schema.key_head_positions({"key_head_of": [0, 0, 1]}) == [0, 0, 1]
    assert schema.key_head_positions({"key_head_of": [1, 3, 3], "key_heads": [1, 3]}) == [0, 1, 1]
    assert schema.head_numbers({"sizes": {"head": 3}}) == [0, 1, 2]
    assert schema.head_numbers({"sizes": {"head": 2}, "heads": [5, 7]}) == [5, 7]


# --- grouped heads (transformers Gated DeltaNet) and per-channel gates (Kimi Delta Attention) -------------------

@pytest.fixture(scope="module")
def grouped_full(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.models.hf_tiny import save_tiny

    base = tmp_path_factory.mktemp("grouped")
    folder = save_tiny("olmo_hybrid", base / "olmo")
    full = base / "full.zarr"
    capture(folder, full)
    res = cli("probe", "attention", "--store", str(full))
    assert res.exit_code == 0, res.output
    return folder, full


@pytest.mark.parametrize(("heads", "values", "keys"), [("1,2", [1, 2], [0, 1]), ("key:1", [2, 3], [1])])
def test_grouped_value_heads_keep_the_key_heads_they_read(grouped_full, tmp_path, heads, values, keys):
    folder, full = grouped_full
    out = tmp_path / "s.zarr"
    capture(folder, out, "--heads", heads)
    a, b = store.open(full), store.open(out)
    assert_restricted(a, b, values)  # q, k per value head (the default view) included
    assert b.attrs["key_heads"] == keys and b.attrs["key_head_of"] == [v // 2 for v in values]
    as_stored = store.open(out, key_heads="key")
    assert as_stored["key_head"].values.tolist() == keys and as_stored["key_head_of"].values.tolist() == b.attrs[
        "key_head_of"]
    np.testing.assert_array_equal(as_stored["k"].values, store.open(full, key_heads="key")["k"].values[..., keys, :])


def test_grouped_reduced_attention_equals_the_full_stores_probe(grouped_full, tmp_path):
    folder, full = grouped_full
    out = tmp_path / "r.zarr"
    capture(folder, out, "--heads", "key:1", "--reduce", "attention")
    ra, rb = store.open_results(full, "attention"), store.open_results(out, "attention")
    assert rb["head"].values.tolist() == [2, 3]
    for name, da in rb.data_vars.items():
        if "head" in da.dims:
            np.testing.assert_allclose(np.asarray(da.values, np.float64),
                                       np.asarray(ra[name].sel(head=[2, 3]).values, np.float64),
                                       rtol=1e-5, atol=1e-6, equal_nan=True, err_msg=name)


def test_grouped_out_of_range_names_value_and_key_heads(grouped_full, tmp_path):
    folder, _ = grouped_full
    line = error_line(cli("capture", str(folder), "--data", SPEC, "--out", str(tmp_path / "s.zarr"),
                          "--heads", "key:2"))
    assert "key head 2 is out of range: the model has 2 key heads (0..1) and 4 value heads" in line


def test_per_channel_gates_keep_their_heads(tmp_path):
    pytest.importorskip("transformers")
    from tests.models.kda_tiny import save_kda

    folder = save_kda("kimi_linear", tmp_path / "kimi")
    capture(folder, tmp_path / "full.zarr")
    capture(folder, tmp_path / "sub.zarr", "--heads", "1")
    a, b = store.open(tmp_path / "full.zarr"), store.open(tmp_path / "sub.zarr")
    assert b["g"].dims == ("seq", "layer", "pos", "head", "dk")
    assert_restricted(a, b, [1])


def test_vars_is_hooks_and_store_info_names_the_heads(gated_pair, tmp_path):
    full, sub, _ = gated_pair
    out = tmp_path / "v.zarr"
    res = cli("capture", str(GATED), "--data", SPEC, "--out", str(out), "--vars", "tokens,beta", "--heads", "2",
              "--batch-size", "2", "--no-progress")
    assert res.exit_code == 0, res.output
    ds = store.open(out)
    assert ds.attrs["hooks"] == ["tokens", "beta"] and ds["head"].values.tolist() == [2]
    np.testing.assert_array_equal(ds["beta"].values, store.open(full)["beta"].sel(head=[2]).values)
    info = cli("store", "info", str(sub))
    assert info.exit_code == 0 and "heads [1, 3]" in info.output


def test_rwkv7_per_channel_betas_and_removal_keys_keep_their_heads(tmp_path):
    """RWKV-7 (fla's checkpoint): k, v, beta, kappa get a sub-step axis of length 1 and beta/g are per key channel;
    --heads keeps the same heads of each."""
    folder = Path(__file__).parents[1] / "fixtures" / "fla" / "rwkv7_fused"
    hooks = "tokens,k,v,beta,g,state,o"
    capture(folder, tmp_path / "full.zarr", hooks=hooks)
    capture(folder, tmp_path / "sub.zarr", "--heads", "0,2-3", hooks=hooks)
    a, b = store.open(tmp_path / "full.zarr"), store.open(tmp_path / "sub.zarr")
    assert b["beta"].dims[-2:] == ("head", "dk") and "kappa" in b
    assert_restricted(a, b, [0, 2, 3], (*PER_HEAD, "kappa"))


def test_intervene_names_model_heads_on_a_heads_store(gated_pair):
    """intervene edits name the model's heads: its sweep covers the captured ones, a key projection of head 3 reads
    that head's keys (the same result as on the full store), and a head the store lacks is a one-line error."""
    from deltalab.models import load_checkpoint
    from deltalab.probes import data, intervene
    from deltalab.probes.base import ProbeError

    full, sub, _ = gated_pair
    model = load_checkpoint(GATED)
    ds_full = data.positional_heads(data.open_store(full))
    ds_sub = data.positional_heads(data.open_store(sub))
    assert sorted({e.head for e in intervene.sweep(ds_sub)}) == [1, 3]
    edit = [intervene.parse_edit("project_keys", "0:3=1")]
    a = intervene.run(ds_full, model, edits=edit).records[1]["delta_loss"]
    b = intervene.run(ds_sub, model, edits=edit).records[1]["delta_loss"]
    assert abs(a) > 1e-4 and abs(a - b) <= 1e-6
    with pytest.raises(ProbeError, match=r"the store holds heads 1,3 \(captured with --heads\), so head 0"):
        intervene.run(ds_sub, model, edits=[intervene.parse_edit("project_keys", "0:0=1")])
