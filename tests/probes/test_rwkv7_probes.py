"""Probes on an RWKV-7 store (per-channel beta a_rwkv, removal key kappa, per-channel decays): exact spectra against
dense float64 eigvals of the multiplied-out transitions, state ranks against a float64 per-step loop, per-channel
betas, decays, keys; attention maps against the dense float64 oracle; capture-time reductions equal the probes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from deltalab import store
from deltalab.app.cli import app
from deltalab.store.reader import open_results
from tests.models.rwkv7_tiny import FIXTURE, probed_rwkv7_store

SPEC = "S4:length=70,samples=3,seed=0"


@pytest.fixture(scope="module")
def rwkv_store(tmp_path_factory):
    probes = {p: [] for p in ("betas", "keys", "decays", "erank", "spectra")}
    return probed_rwkv7_store(tmp_path_factory.mktemp("rwkv7_probes"), SPEC, probes)


def _inputs(ds, layer_index: int) -> dict[str, np.ndarray]:
    """One layer's stored inputs in float64, the step axis dropped: k, v, kappa, beta, g [s, T, H, *]."""
    out = {}
    for n in ("k", "v", "kappa", "beta", "g"):
        x = np.asarray(ds[n].isel(layer=layer_index).values, dtype=np.float64)
        out[n] = x[:, :, 0] if "step" in ds[n].dims else x
    return out


def test_spectra_are_the_dense_eigvals_of_the_stored_transitions(rwkv_store):
    ds = store.open(rwkv_store)
    assert ds.attrs["deltalab_format"] == 3  # per-channel beta and crc32c chunks: a version-1 or 2 reader refuses it
    res = open_results(rwkv_store, "spectra")
    dk, w = ds.sizes["dk"], 4
    assert res.attrs["dplr"] and res.sizes["aeig"] == dk and res.sizes["weig"] == w
    for li in range(ds.sizes["layer"]):
        a = _inputs(ds, li)
        kappa, beta, g = (torch.from_numpy(a[n]) for n in ("kappa", "beta", "g"))
        u = kappa * beta
        eye = torch.eye(dk, dtype=torch.float64)
        A = torch.diag_embed(g.exp()) - u[..., :, None] * kappa[..., None, :]  # [s, T, H, dk, dk]
        dense = torch.linalg.eigvals(A)
        assert dense.imag.abs().max() < 1e-9
        got = np.asarray(res["eig_A"].isel(layer=li).values)
        assert np.abs(got.imag).max() == 0 and (np.diff(got.real, axis=-1) >= 0).all()
        err = np.abs(got.real - np.sort(dense.real.numpy(), -1)).max()
        assert err < 1e-6, err  # float64 solver, stored as complex64
        eig_p = np.asarray(res["eig_P"].isel(layer=li).values)[..., 0]
        np.testing.assert_allclose(eig_p.real, 1 - (a["kappa"] ** 2 * a["beta"]).sum(-1), atol=1e-6)
        # windows of 4 removal factors R = I - u kappa^T: their power sums are tr(P^p) - (dk - w)
        R = eye - u[..., :, None] * kappa[..., None, :]
        win = np.asarray(res["window_eig_P"].isel(layer=li).values).astype(np.complex128)  # [s, n_win, H, w]
        starts = np.asarray(res["window_start"].values)
        for wi, t0 in enumerate(starts):
            P = R[:, t0 + 3] @ R[:, t0 + 2] @ R[:, t0 + 1] @ R[:, t0]
            Pp = eye.expand_as(P)
            for p in range(1, w + 1):
                Pp = Pp @ P
                trace = torch.diagonal(Pp, dim1=-2, dim2=-1).sum(-1).numpy() - (dk - w)
                np.testing.assert_allclose((win[:, wi] ** p).sum(-1), trace, atol=2e-5)


def test_erank_replays_the_dplr_states_like_a_float64_loop(rwkv_store):
    ds = store.open(rwkv_store)
    res = open_results(rwkv_store, "erank")
    li = 1
    a = {n: torch.from_numpy(x) for n, x in _inputs(ds, li).items()}
    S, T, H, K = a["k"].shape
    state = torch.zeros(S, H, K, a["v"].shape[-1], dtype=torch.float64)
    er, sr = np.zeros((S, T, H)), np.zeros((S, T, H))
    for t in range(T):  # H <- (diag(e^g) - u kappa^T) H + k v^T, one dense product per step
        M = torch.diag_embed(a["g"][:, t].exp()) - (a["kappa"][:, t] * a["beta"][:, t])[..., :, None] \
            * a["kappa"][:, t][..., None, :]
        state = M @ state + a["k"][:, t][..., :, None] * a["v"][:, t][..., None, :]
        sv = torch.linalg.svdvals(state)
        p = sv / sv.sum(-1, keepdim=True)
        er[:, t] = torch.exp(-(p * torch.log(p.clamp(min=1e-300))).sum(-1)).numpy()
        sr[:, t] = ((sv**2).sum(-1) / sv[..., 0] ** 2).numpy()
    got_er = np.asarray(res["erank"].isel(layer=li).values)
    got_sr = np.asarray(res["stable_rank"].isel(layer=li).values)
    np.testing.assert_allclose(got_er, er, rtol=1e-4)
    np.testing.assert_allclose(got_sr, sr, rtol=1e-4)
    assert (er[:, -1] > 1.5).all()  # a real test: the states are not rank one


def test_betas_are_per_channel_removal_strengths(rwkv_store):
    ds = store.open(rwkv_store)
    res = open_results(rwkv_store, "betas")
    beta = np.asarray(ds["beta"].values, dtype=np.float64)[:, :, :, 0]  # [s, L, T, H, dk]
    assert res.attrs["per_channel"] and res.attrs["beta_range"] == [0.0, 1.0]
    np.testing.assert_allclose(res["beta_channel_mean"].values, beta.mean((0, 2)), rtol=1e-5)
    np.testing.assert_allclose(res["frac_strong_channel"].values, (beta > 0.9).mean((0, 2)))
    np.testing.assert_allclose(res["beta_mean"].values[:, 0], beta.mean((0, 2, 4)), rtol=1e-5)
    np.testing.assert_allclose(res["frac_strong"].values[:, 0], (beta > 0.9).mean((0, 2, 4)))
    assert res["beta_hist"].values.sum(-1).min() == beta[:, 0, :, 0].size  # every channel counted
    assert (res["frac_negative"].values == 0).all()  # a_rwkv < 1: no negative eigenvalue
    rec = res.attrs["records"][0]
    assert len(rec["channel_means"]) == ds.sizes["dk"]


def test_decays_and_keys_on_rwkv7(rwkv_store):
    ds = store.open(rwkv_store)
    dec = open_results(rwkv_store, "decays")
    g = np.asarray(ds["g"].values, dtype=np.float64)  # [s, L, T, H, dk], log w in [-e^-0.5, 0)
    assert g.min() >= -np.exp(-0.5) - 1e-6 and g.max() < 0
    d = np.exp(g).mean((0, 2))
    np.testing.assert_allclose(dec["mean_decay"].values, d, rtol=1e-5)
    np.testing.assert_allclose(dec["memory_of_mean_decay"].values, 1 / (1 - d), rtol=1e-5)
    keys = open_results(rwkv_store, "keys")
    evr = keys["explained_variance_ratio"]
    k = np.asarray(ds["k"].isel(layer=1, step=0, head=2).values, dtype=np.float64).reshape(-1, ds.sizes["dk"])
    sv = np.linalg.svd(k - k.mean(0), compute_uv=False) ** 2
    got = np.asarray(evr.sel(layer=int(ds["layer"].values[1]), head=2, step=0).values)
    np.testing.assert_allclose(got, sv / sv.sum(), atol=1e-5)


def test_keys_of_kappa_is_the_pca_of_the_removal_keys(rwkv_store):
    from deltalab.probes import keys
    from deltalab.probes.base import ProbeError

    res = CliRunner().invoke(app, ["probe", "keys", "--store", str(rwkv_store), "--of", "kappa", "--name",
                                   "keys-kappa"])
    assert res.exit_code == 0, res.output
    ds = store.open(rwkv_store)
    got = open_results(rwkv_store, "keys-kappa")
    assert got.attrs["of"] == "kappa"
    kap = np.asarray(ds["kappa"].isel(layer=0, step=0, head=1).values, dtype=np.float64).reshape(-1, ds.sizes["dk"])
    sv = np.linalg.svd(kap - kap.mean(0), compute_uv=False) ** 2
    evr = np.asarray(got["explained_variance_ratio"].sel(layer=int(ds["layer"].values[0]), head=1, step=0).values)
    np.testing.assert_allclose(evr, sv / sv.sum(), atol=1e-5)
    with pytest.raises(ProbeError, match="only rwkv7 stores have removal keys"):
        keys.run(ds.drop_vars("kappa"), of="kappa")


def test_attention_probe_matches_the_dense_oracle(rwkv_store):
    """The probe's top-k sources of every token against alpha of the float64 dense oracle on the stored inputs (one
    layer, two sequences); o rebuilt from the map equals the stored read-out; the approximation's error is that of
    the decay-only oracle (removal dropped); a window with --context folds earlier tokens into the stored state."""
    from deltalab.kernels.attention.dplr_naive import naive_dplr_attention

    res = CliRunner().invoke(app, ["probe", "attention", "--store", str(rwkv_store), "--top-k", "5"])
    assert res.exit_code == 0, res.output
    ds, out = store.open(rwkv_store), open_results(rwkv_store, "attention")
    assert float(out["reconstruction_error"].max()) < 1e-4
    li = 1
    a = {n: torch.from_numpy(x[:2]) for n, x in _inputs(ds, li).items()}
    q = torch.from_numpy(np.asarray(ds["q"].isel(layer=li, seq=[0, 1]).values, dtype=np.float64))
    kap = a["kappa"]
    alpha, _ = naive_dplr_attention(q, a["k"], a["v"], -kap, kap * a["beta"], a["g"], scale=1.0)
    zero = torch.zeros_like(kap)
    approx, _ = naive_dplr_attention(q, a["k"], a["v"], zero, zero, a["g"], scale=1.0)
    src = torch.from_numpy(np.asarray(out["attn_source_pos"].isel(layer=li, seq=[0, 1]).values, dtype=np.int64))
    w = np.asarray(out["attn_weight"].isel(layer=li, seq=[0, 1]).values, dtype=np.float64)
    has = torch.arange(5)[None, None, None, :] <= torch.arange(src.shape[1])[None, :, None, None]  # t + 1 sources
    assert bool(((src >= 0) == has).all())
    want = alpha.gather(-1, src.clamp(min=0)).masked_fill(src < 0, 0).numpy()
    np.testing.assert_allclose(w, want, atol=1e-5 * float(alpha.abs().max()))
    top1 = alpha.abs().argmax(-1)
    assert (src[..., 0] == top1).float().mean() > 0.99  # ties at float32 aside
    werr = ((alpha - approx).norm(dim=-1) / alpha.norm(dim=-1)).numpy()
    got = np.asarray(out["gla_weight_error"].isel(layer=li, seq=[0, 1]).values)
    np.testing.assert_allclose(got, werr, rtol=1e-3, atol=1e-5)
    assert werr.mean() > 1e-3  # the rank-one removal matters on this model
    # a window with context: sources before the kept context enter through the stored chunk-start state
    res = CliRunner().invoke(app, ["probe", "attention", "--store", str(rwkv_store), "--window", "66:70",
                                   "--context", "2", "--top-k", "5", "--name", "attention-ctx"])
    assert res.exit_code == 0, res.output
    ctx = open_results(rwkv_store, "attention-ctx")
    assert ctx.attrs["first_source"] == 64 and float(ctx["reconstruction_error"].max()) < 1e-4
    src = torch.from_numpy(np.asarray(ctx["attn_source_pos"].isel(layer=li, seq=[0, 1]).values, dtype=np.int64))
    assert bool(((src >= 64) == (src >= 0)).all()) and bool((src[:, -1] >= 64).all())  # 6 sources for 5 ranks
    want = alpha[:, 66:].gather(-1, src.clamp(min=0)).masked_fill(src < 0, 0).numpy()
    w = np.asarray(ctx["attn_weight"].isel(layer=li, seq=[0, 1]).values, dtype=np.float64)
    np.testing.assert_allclose(w, want, atol=1e-5 * float(alpha.abs().max()))


def test_bad_strong_threshold_is_one_line(rwkv_store):
    res = CliRunner().invoke(app, ["probe", "betas", "--store", str(rwkv_store), "--strong", "1.5"])
    assert res.exit_code == 2 and "--strong 1.5" in res.output and res.output.strip().count("\n") == 0


def test_reductions_during_capture_equal_the_probes(rwkv_store, tmp_path):
    from tests.store.test_reduce import _assert_same

    out = tmp_path / "r.zarr"
    res = CliRunner().invoke(app, ["capture", str(FIXTURE), "--data", SPEC, "--out", str(out), "--hooks",
                                   "tokens,labels,loss", "--reduce", "ranks,spectra", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "kappa" not in store.open(out) and "state" not in store.open(out)
    for name in ("erank", "spectra"):
        _assert_same(open_results(out, name), open_results(rwkv_store, name), rtol=1e-5)


def test_reduce_attention_on_rwkv7_equals_the_probe(tmp_path):
    from tests.store.test_reduce import _assert_same

    out = tmp_path / "a.zarr"
    res = CliRunner().invoke(app, ["capture", str(FIXTURE), "--data", SPEC, "--out", str(out), "--hooks",
                                   "tokens,labels,q,k,v,beta,g", "--reduce", "attention", "--no-progress"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(app, ["probe", "attention", "--store", str(out), "--name", "attention-probe"])
    assert res.exit_code == 0, res.output
    _assert_same(open_results(out, "attention"), open_results(out, "attention-probe"), rtol=1e-5)


def test_intervene_on_rwkv7_sets_every_channel_and_refuses_surgery(rwkv_store):
    """--set-beta on rwkv7 fills every key channel of the head (checked against a plain forward hook), the default
    sweep runs, and state surgery (Householder replay) is one line."""
    from deltalab.models import load_checkpoint
    from deltalab.probes import intervene
    from deltalab.probes.base import ProbeError

    ds = store.open(rwkv_store)
    model = load_checkpoint(FIXTURE, device="cpu", dtype=torch.float32).eval()
    tokens, labels = np.asarray(ds["tokens"].values), np.asarray(ds["labels"].values)
    edit = intervene.parse_edit("set_beta", "1:2:0=0")
    acc, loss, _, _ = intervene.evaluate(model, tokens, labels, [edit], {})

    def zero_head(module, args, output):
        output = output.clone()
        output[:, :, 2] = 0
        return output

    handle = model.layers[1].attn.hook_beta.register_forward_hook(zero_head)
    try:
        by_hand = intervene.evaluate(model, tokens, labels, [], {})
    finally:
        handle.remove()
    assert loss == pytest.approx(by_hand[1], rel=1e-6) and acc == pytest.approx(by_hand[0])
    assert loss != pytest.approx(intervene.evaluate(model, tokens, labels, [], {})[1], rel=1e-6)
    res = CliRunner().invoke(app, ["probe", "intervene", "--store", str(rwkv_store), "--checkpoint", str(FIXTURE)])
    assert res.exit_code == 0, res.output
    with pytest.raises(ProbeError, match="state surgery replays the Householder delta rule"):
        intervene.run(ds, model, edits=[intervene.parse_surgery("erase", "0:1@3")])


@pytest.mark.gpu
def test_gpu_rwkv7_reductions_and_probes_equal_the_cpu_probes(tmp_path):
    """On CUDA: an rwkv7 capture with --reduce ranks,spectra (on the batch's GPU tensors), the probes with
    --device cuda and the probes with --device cpu on the same store give the same results."""
    from tests.store.test_reduce import _assert_same

    out = tmp_path / "g.zarr"
    res = CliRunner().invoke(app, ["capture", str(FIXTURE), "--data", SPEC, "--out", str(out), "--device", "cuda",
                                   "--hooks", "tokens,labels,loss,q,k,v,beta,g,state,o", "--reduce", "ranks,spectra",
                                   "--rank-every", "1", "--keep", "states", "--no-progress"])
    assert res.exit_code == 0, res.output
    for name in ("erank", "spectra"):
        for device in ("cuda", "cpu"):
            res = CliRunner().invoke(app, ["probe", name, "--store", str(out), "--device", device, "--name",
                                           f"{name}-{device}"])
            assert res.exit_code == 0, res.output
            _assert_same(open_results(out, name), open_results(out, f"{name}-{device}"), rtol=1e-4)


def test_rwkv7_store_without_beta_is_one_line_for_spectra_and_erank(tmp_path):
    out = tmp_path / "nb.zarr"
    res = CliRunner().invoke(app, ["capture", str(FIXTURE), "--data", "S4:length=20,samples=2,seed=0", "--out",
                                   str(out), "--hooks", "tokens,labels,k,v,g,state", "--no-progress"])
    assert res.exit_code == 0, res.output
    for probe in ("spectra", "erank", "betas"):
        res = CliRunner().invoke(app, ["probe", probe, "--store", str(out)])
        assert res.exit_code == 2 and res.output.strip().count("\n") == 0, (probe, res.output)
        assert "beta" in res.output and "--hooks" in res.output, (probe, res.output)
