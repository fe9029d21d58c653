"""Key/query channel pruning: planted channels per method, strong RRQR, exact surgery, study records."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import scipy.linalg
import torch

from deltalab.kernels.linalg.rrqr import strong_rrqr, swap_gains
from deltalab.models import DeltaProductForCausalLM, ModelConfig, load_checkpoint, save_checkpoint
from deltalab.train.prune import (
    METHODS,
    Calibration,
    LayerPlan,
    LayerStats,
    PruneError,
    PrunePlan,
    apply_plan,
    collect_calibration,
    gradient_scores,
    kept_dim,
    parse_methods,
    plan,
    prune,
    reduced_config,
)

KINDS = {
    "delta_net": dict(model_type="delta_net", expand_k=1.0, expand_v=1.0),
    "gated_deltanet": dict(model_type="gated_deltanet", head_dim=8, expand_v=1.0),
    "gated_deltaproduct": dict(model_type="gated_deltaproduct", head_dim=8, expand_v=1.0, num_householder=2,
                               use_forget_gate=True, allow_neg_eigval=True),
}


def tiny(kind: str = "gated_deltaproduct", **over) -> DeltaProductForCausalLM:
    """2 layers, 2 heads, dk = dv = 8, hidden 16, short conv on."""
    base = dict(vocab_size=11, hidden_size=16, num_hidden_layers=2, num_heads=2, use_short_conv=True, hidden_ratio=2)
    cfg = ModelConfig(**{**base, **KINDS[kind], **over})
    return DeltaProductForCausalLM(cfg).eval()


def ids(n: int = 4, t: int = 40, vocab: int = 11, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(seed))


def stats_from_rows(q: np.ndarray, k: np.ndarray | None = None) -> LayerStats:
    """LayerStats for one layer from raw query rows [n, H, dk] (keys: the same rows unless given)."""
    qt = torch.from_numpy(q).double()
    kt = qt[:, None] if k is None else torch.from_numpy(k).double()
    H, dk = qt.shape[1:]
    return LayerStats(torch.zeros(1), [qt], [kt], torch.zeros(H, dk, dk), torch.zeros(H, dk), 0)


# --- selection ------------------------------------------------------------------------------------

def test_kept_dim_follows_the_authors_floor():
    assert [kept_dim(32, c) for c in (0.0, 0.3, 0.4, 0.5, 0.75)] == [32, 22, 19, 16, 8]
    assert kept_dim(128, 0.5) == 64 and kept_dim(4, 0.99) == 1
    with pytest.raises(PruneError, match="compression"):
        kept_dim(32, 1.0)


def test_l1_keeps_heavy_channels_jointly_over_q_and_all_householder_keys():
    model = tiny()
    planted = [[1, 2, 5, 7], [0, 3, 4, 6]]
    with torch.no_grad():
        for block in model.layers:
            a = block.attn
            wq = a.q_proj.weight.view(2, 8, -1)
            wk = a.k_proj.weight.view(2, 2, 8, -1)  # (n h d) rows
            for h, chans in enumerate(planted):
                wq[h, chans] *= 3.0
                wk[1, h, chans] *= 3.0  # only the second Householder key: selection must see all n_h keys
    p = plan(model, "l1", 0.5)
    for lp in p.layers:
        assert lp.index.tolist() == planted


def test_random_is_seeded_valid_and_seed_dependent():
    model = tiny()
    a, b, c = (plan(model, "random", 0.5, seed=s) for s in (1, 1, 2))
    for lp in a.layers:
        assert lp.index.shape == (2, 4)
        for row in lp.index.tolist():
            assert row == sorted(set(row)) and all(0 <= i < 8 for i in row)
    assert all(torch.equal(x.index, y.index) for x, y in zip(a.layers, b.layers))
    assert any(not torch.equal(x.index, y.index) for x, y in zip(a.layers, c.layers))


def test_wanda_weighs_channels_by_input_norms_where_l1_does_not():
    model = tiny()
    D = model.config.hidden_size
    planted, others = [0, 2, 4, 6], [1, 3, 5, 7]
    with torch.no_grad():
        for block in model.layers:
            a = block.attn
            for w, lead in ((a.q_proj.weight, (2,)), (a.k_proj.weight, (2, 2))):
                w3 = w.view(*lead, 8, D)
                w3.zero_()
                w3[..., others, 1:] = 0.1  # L1 1.5, all on quiet inputs
                w3[..., planted, 1:] = 0.01
                w3[..., planted, 0] = 0.5  # L1 0.65, mostly on the one loud input
    x_sq = torch.full((D,), 1e-4, dtype=torch.float64)
    x_sq[0] = 1e4
    layers = [LayerStats(x_sq, [], [], torch.zeros(2, 8, 8), torch.zeros(2, 8), 0) for _ in model.layers]
    assert all(lp.index.tolist() == [planted] * 2 for lp in plan(model, "wanda", 0.5, Calibration(layers, 1)).layers)
    assert all(lp.index.tolist() == [others] * 2 for lp in plan(model, "l1", 0.5).layers)


def test_grad_drops_channels_that_cannot_change_the_loss():
    model = tiny()
    dead = [1, 6]  # zero query and key rows: |W * dL/dW| = 0
    with torch.no_grad():
        for block in model.layers:
            block.attn.q_proj.weight.view(2, 8, -1)[:, dead] = 0
            block.attn.k_proj.weight.view(2, 2, 8, -1)[:, :, dead] = 0
    x = ids()
    calib = collect_calibration(model, x, batch_size=2, rrqr_rows=64)
    calib.grad_scores = gradient_scores(model, x[:, :-1], x[:, 1:], batch_size=2)
    assert all(p.requires_grad for p in model.parameters())  # restored
    alive = [i for i in range(8) if i not in dead]
    keep = plan(model, "grad", 0.25, calib)  # 6 of 8
    for lp in keep.layers:
        assert lp.index.tolist() == [alive, alive]


def test_drrqr_keeps_an_independent_set_of_activation_channels():
    rng = np.random.default_rng(0)
    n, planted = 2000, [0, 3, 5, 6]
    q = np.zeros((n, 2, 8))
    for h in range(2):
        q[:, h, planted] = rng.standard_normal((n, 4)) * [1.0, 0.5, 2.0, 0.8]
        for j, src in zip([1, 2, 4, 7], planted):  # the others: scaled copies of kept ones (dependent)
            q[:, h, j] = 0.3 * q[:, h, src]
    k = np.stack([q, q[::-1]], 1)  # two Householder keys (rows shuffled): same column space
    calib = Calibration([stats_from_rows(q, k)], n)
    model = tiny(num_hidden_layers=1)
    p = plan(model, "drrqr", 0.5, calib)
    assert p.layers[0].index.tolist() == [planted, planted]


def test_pca_keeps_the_subspace_the_activations_live_in():
    model = tiny(num_hidden_layers=1)
    x = ids(8, 64)
    calib = collect_calibration(model, x, batch_size=4)
    T = plan(model, "pca", 0.5, calib).layers[0].transform  # [H, 4, 8]
    assert torch.allclose(T @ T.transpose(-1, -2), torch.eye(4, dtype=T.dtype).expand(2, 4, 4), atol=1e-10)
    st = calib.layers[0]
    n = 2 * st.count
    cov = st.cov_sum / n - torch.einsum("hd,he->hde", st.mean_sum / n, st.mean_sum / n)
    evals = torch.linalg.eigvalsh(cov).flip(-1)
    captured = torch.einsum("hkd,hde,hke->h", T, cov, T)  # variance in the kept subspace = top-4 eigenvalues
    assert torch.allclose(captured, evals[:, :4].sum(-1), rtol=1e-8)


def test_every_method_prunes_every_model_type():
    for kind in KINDS:
        model = tiny(kind)
        x = ids(2, 24)
        calib = collect_calibration(model, x, batch_size=2, rrqr_rows=32)
        calib.grad_scores = gradient_scores(model, x[:, :-1], x[:, 1:], batch_size=2)
        for method in METHODS:
            pruned, p = prune(model, method, 0.75, calib)
            assert pruned.config.head_k_dim == 2 and pruned.config.head_v_dim == 8
            with torch.no_grad():
                assert pruned(x).logits.shape == (2, 24, 11)


def test_methods_parse_and_validate():
    assert parse_methods("all") == list(METHODS)
    assert parse_methods("Taylor, rrqr,S-Wanda") == ["grad", "drrqr", "wanda"]
    with pytest.raises(PruneError, match="unknown method"):
        parse_methods("l1,magnitude")
    with pytest.raises(PruneError, match="calibration"):
        plan(tiny(), "drrqr", 0.5)


# --- strong RRQR ------------------------------------------------------------------------------------

def kahan(n: int, c: float = 0.285) -> np.ndarray:
    """Kahan's matrix: QR with column pivoting leaves it unpivoted and misses its small singular value."""
    s = math.sqrt(1 - c * c)
    K = np.diag(s ** np.arange(n)) @ (np.eye(n) + np.triu(-c * np.ones((n, n)), 1))
    return K * (1 - 1e-10) ** np.arange(n)[None, :]


@pytest.mark.parametrize("case", ["kahan", "random"])
def test_drrqr_is_rank_revealing_where_pivoted_qr_is_not(case):
    rng = np.random.default_rng(1)
    if case == "kahan":
        M, k = kahan(40), 39
    else:
        n = 24
        basis = np.linalg.qr(rng.standard_normal((n, n)))[0]
        M = rng.standard_normal((300, n)) @ np.diag(np.logspace(0, -5, n)) @ basis
        k = 12
    n, f = M.shape[1], 1.5
    sigma = np.linalg.svd(M, compute_uv=False)
    bound = math.sqrt(1 + f * f * k * (n - k))
    res = strong_rrqr(M, k, f)
    R0, _ = scipy.linalg.qr(M, mode="r", pivoting=True)
    R0 = R0[:n]
    # the factorisation is of M's columns in the returned order
    assert np.allclose(np.linalg.svd(res.R, compute_uv=False), sigma, rtol=1e-8)
    assert sorted(res.perm.tolist()) == list(range(n))
    # strong RRQR conditions and the Gu-Eisenstat singular-value bounds (Theorem 3.2)
    assert swap_gains(res.R, k).max() <= f + 1e-12
    sa = np.linalg.svd(res.R[:k, :k], compute_uv=False)
    sc = np.linalg.svd(res.R[k:, k:], compute_uv=False)
    assert np.all(sa >= sigma[:k] / bound * (1 - 1e-9))
    assert np.all(sc <= sigma[k:] * bound * (1 + 1e-9))
    # never worse than the QRCP start: |det A| only grows
    assert abs(np.linalg.det(res.R[:k, :k])) >= abs(np.linalg.det(R0[:k, :k])) * (1 - 1e-9)
    if case == "kahan":  # pivoted QR breaks the bound on Kahan's matrix; one swap repairs it
        assert swap_gains(R0, k).max() > 10 * f
        assert np.linalg.svd(R0[k:, k:], compute_uv=False)[0] > sigma[k] * bound
        assert res.swaps >= 1


# --- surgery ----------------------------------------------------------------------------------------

def identity_plan(model) -> PrunePlan:
    dk, H = model.config.head_k_dim, model.config.num_heads
    return PrunePlan("identity", 0.0, dk, dk, [LayerPlan(index=torch.arange(dk).expand(H, dk).clone())
                                               for _ in model.layers])


@pytest.mark.parametrize("kind", list(KINDS))
def test_surgery_at_zero_compression_is_exact_and_loads(kind, tmp_path):
    model = tiny(kind)
    x = ids()
    pruned = apply_plan(model, identity_plan(model))
    with torch.no_grad():
        ref, out = model(x).logits, pruned(x).logits
    assert torch.equal(ref, out)
    save_checkpoint(pruned, tmp_path / "p0")
    again = load_checkpoint(tmp_path / "p0")
    with torch.no_grad():
        assert torch.equal(again(x).logits, ref)


@pytest.mark.parametrize("kind", list(KINDS))
def test_pruning_channels_that_are_exactly_zero_keeps_the_logits(kind, tmp_path):
    model = tiny(kind)
    zero = [[0, 3, 4, 7], [1, 2, 5, 6]]  # different channels per head
    with torch.no_grad():
        model.embeddings.weight *= 50  # a residual stream of RMS ~1, as in trained models (block norms see eps ~1e-6)
        for block in model.layers:
            a = block.attn
            n_h = a.num_householder
            for h, chans in enumerate(zero):
                a.q_proj.weight.view(2, 8, -1)[h, chans] = 0
                a.k_proj.weight.view(n_h, 2, 8, -1)[:, h, chans] = 0
    x = ids()
    pruned, p = prune(model, "l1", 0.5)  # zero rows have the lowest L1 score
    assert [lp.index.tolist() for lp in p.layers] == [[[1, 2, 5, 6], [0, 3, 4, 7]]] * 2
    save_checkpoint(pruned, tmp_path / "p50")
    cfg = json.loads((tmp_path / "p50" / "config.json").read_text())
    if kind == "delta_net":
        assert cfg["expand_k"] * cfg["hidden_size"] == 2 * 4
    else:
        assert cfg["head_dim"] == 4 and int(cfg["head_dim"] * cfg["expand_v"]) == 8
    again = load_checkpoint(tmp_path / "p50")
    assert again.config.head_k_dim == 4 and again.layers[0].attn.q_proj.weight.shape == (8, 16)
    assert again.layers[0].attn.k_conv1d.weight.shape == (2 * 4 * model.config.num_householder, 1, 4)
    grab: dict[str, torch.Tensor] = {}
    for tag, m in (("old", model), ("new", pruned)):
        for name in ("hook_state", "hook_o"):
            getattr(m.layers[0].attn, name).register_forward_hook(
                lambda mod, i, out, key=f"{tag}.{name}": grab.__setitem__(key, out))
    with torch.no_grad():
        ref, out = model(x).logits, pruned(x).logits
    # the state keeps exactly the kept rows (the dropped rows of the old state are zero) ...
    kept = torch.tensor([[1, 2, 5, 6], [0, 3, 4, 7]])
    old_state = grab["old.hook_state"]
    torch.testing.assert_close(grab["new.hook_state"], torch.stack(
        [old_state[:, :, h, kept[h]] for h in range(2)], 2), atol=1e-6, rtol=1e-5)
    assert old_state.square().sum() > 0
    # ... the read-out differs only by the attention scale: fla's default for the new head dim,
    # 4**-0.5 instead of 8**-0.5 (what the authors' code does) ...
    torch.testing.assert_close(grab["new.hook_o"], grab["old.hook_o"] * 2**0.5, atol=1e-6, rtol=1e-5)
    # ... which the per-head o_norm cancels up to its eps (tokens whose read-out is ~sqrt(eps))
    torch.testing.assert_close(out, ref, atol=1e-2, rtol=0)
    # keep_scale folds the old scale into norm_eps (fla-compatible): the same logits to float precision
    kept_scale = apply_plan(model, p, keep_scale=True)
    assert kept_scale.config.norm_eps == pytest.approx(2 * model.config.norm_eps)
    save_checkpoint(kept_scale, tmp_path / "p50k")
    with torch.no_grad():
        torch.testing.assert_close(load_checkpoint(tmp_path / "p50k")(x).logits, ref, atol=2e-6, rtol=1e-5)
    # so does putting the old scale back through the read-out hook point
    pruned.layers[0].attn.hook_o.register_forward_hook(lambda mod, i, o: o * 2**-0.5)
    pruned.layers[1].attn.hook_o.register_forward_hook(lambda mod, i, o: o * 2**-0.5)
    again.layers[0].attn.hook_o.register_forward_hook(lambda mod, i, o: o * 2**-0.5)
    again.layers[1].attn.hook_o.register_forward_hook(lambda mod, i, o: o * 2**-0.5)
    with torch.no_grad():
        torch.testing.assert_close(pruned(x).logits, ref, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(again(x).logits, ref, atol=2e-6, rtol=1e-5)


def test_pca_rotation_is_exact_when_conv_and_activation_commute_with_it():
    model = tiny("delta_net", qk_activation="identity")
    with torch.no_grad():  # one filter per head: a shared convolution commutes with rotations (paper Lemma B.2)
        for block in model.layers:
            for conv in (block.attn.q_conv1d, block.attn.k_conv1d):
                w = conv.weight.view(2, 8, 1, 4)
                w[:] = w[:, :1].clone()
    x = ids()
    calib = collect_calibration(model, x, batch_size=2)
    pruned, p = prune(model, "pca", 0.0, calib)
    T = p.layers[0].transform.float()
    old = model.layers[0].attn.q_conv1d.weight.view(2, 8, 4)
    new = pruned.layers[0].attn.q_conv1d.weight.view(2, 8, 4)
    torch.testing.assert_close(new, torch.einsum("hkd,hdl->hkl", T * T, old))  # W' = (T o T) W
    with torch.no_grad():
        torch.testing.assert_close(pruned(x).logits, model(x).logits, atol=1e-5, rtol=1e-5)


def test_reduced_config_keeps_dv_with_fla_integer_rules():
    for kind in ("gated_deltanet", "gated_deltaproduct"):
        cfg = ModelConfig(vocab_size=11, hidden_size=96, num_hidden_layers=1, num_heads=3,
                          **{**KINDS[kind], "head_dim": 32, "expand_v": 1.5})
        for keep in range(1, 33):
            new = reduced_config(cfg, keep)
            assert new.head_k_dim == keep and new.head_v_dim == 48
            assert int(keep * new.expand_v) == 48 and math.isclose(3 * keep * new.expand_v, 144, rel_tol=1e-5)
            assert ModelConfig.from_dict(new.to_dict()).head_v_dim == 48
    cfg = ModelConfig(vocab_size=11, hidden_size=96, num_hidden_layers=1, num_heads=3, model_type="delta_net",
                      expand_k=1.0, expand_v=1.0)
    for keep in range(1, 33):
        new = ModelConfig.from_dict(reduced_config(cfg, keep).to_dict())
        assert (new.head_k_dim, new.head_v_dim) == (keep, 32)


# --- the study ----------------------------------------------------------------------------------------

def test_study_records_and_cli(tmp_path, capsys):
    from deltalab.train.prune_study import main

    model = tiny("gated_deltaproduct", vocab_size=4)
    save_checkpoint(model, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "task.json").write_text(json.dumps({"name": "parity", "train_length": 32}))
    code = main([str(tmp_path / "ckpt"), "--methods", "l1,grad,drrqr", "--compressions", "0,50",
                 "--calib-windows", "4", "--eval-windows", "4", "--rank-windows", "2", "--batch-size", "4",
                 "--out", str(tmp_path / "prune.json"), "--save-dir", str(tmp_path / "pruned"), "--json",
                 "--no-progress"])
    assert code == 0
    records = json.loads(capsys.readouterr().out)
    assert [(r["method"], r["compression"]) for r in records] == [
        ("baseline", 0.0), ("l1", 0.0), ("grad", 0.0), ("drrqr", 0.0), ("l1", 0.5), ("grad", 0.5), ("drrqr", 0.5)]
    for r in records:
        for key in ("method", "compression", "perplexity", "nll", "accuracy", "head_dim", "head_dim_kept",
                    "rank_utilisation", "stable_rank", "tokens_per_s", "speedup", "mixer_speedup", "model_type"):
            assert key in r, key
        assert r["perplexity"] > 1 and 0 <= r["accuracy"] <= 1 and 0 < r["rank_utilisation"] <= 1
        assert r["head_dim_kept"] == (8 if r["compression"] == 0 else 4)
    base = records[0]
    assert all(r["perplexity"] == pytest.approx(base["perplexity"], rel=1e-6) for r in records if r["compression"] == 0)
    doc = json.loads((tmp_path / "prune.json").read_text())
    assert doc["command"].startswith("deltalab prune ") and doc["records"] == records
    assert load_checkpoint(tmp_path / "pruned" / "drrqr-50").config.head_k_dim == 4
    assert (tmp_path / "pruned" / "drrqr-50" / "task.json").is_file()
    assert main([str(tmp_path / "ckpt"), "--methods", "magnitude"]) == 2
    assert "unknown method" in capsys.readouterr().err
