"""State surgery: edits agree with a token loop that edits the state itself; through nnsight on a bundled text LM,
erasing the association the exact map points to changes the prediction (a constructed case)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from deltalab.models import IGNORE_INDEX
from deltalab.probes import intervene
from deltalab.probes.base import ProbeError
from deltalab.probes.surgery import StateEdit, edited_output

ZOO = Path(__file__).resolve().parents[2] / "models" / "zoo"


def loop_with_edit(q, k, v, beta, g, e: StateEdit, scale):
    """float64 token loop of the layer with `e` applied to the state itself (the independent route)."""
    B, T, H, K = q.shape
    n_h, V = k.shape[2], v.shape[-1]
    state = torch.zeros(B, H, K, V, dtype=torch.float64)
    gg = torch.zeros(B, T, H, dtype=torch.float64) if g is None else g
    src = e.position if e.source is None else e.source
    step = n_h - 1 if e.step is None else e.step
    out = []
    for t in range(T):
        decay = gg[:, t].exp()[..., None, None].expand(B, H, K, 1).clone()
        if e.kind == "scale_decay" and t >= e.position:
            decay[:, e.head, slice(None) if e.channel is None else e.channel] *= e.factor
        state = state * decay
        for j in range(n_h):
            kk, vv, bb = k[:, t, j], v[:, t, j], beta[:, t, j]
            resid = vv - torch.einsum("bhkv,bhk->bhv", state, kk)
            state = state + bb[..., None, None] * kk[..., :, None] * resid[..., None, :]
        if t == e.position and e.kind in ("erase", "write"):
            key = k[:, src, step, e.head]
            if e.kind == "erase":
                unit = key / key.norm(dim=-1, keepdim=True)
                state[:, e.head] -= unit[:, :, None] * torch.einsum("bk,bkv->bv", unit, state[:, e.head])[:, None]
            else:
                state[:, e.head] += key[:, :, None] * v[:, src, step, e.head][:, None, :]
        out.append(scale * torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(out, 1)


EDITS = [
    StateEdit("erase", head=1, position=5),
    StateEdit("erase", head=0, position=9, step=0, source=3),
    StateEdit("write", head=1, position=6, source=2, step=1),
    StateEdit("scale_decay", head=1, position=4, factor=0.3),
    StateEdit("scale_decay", head=0, position=7, channel=2, factor=0.0),
    StateEdit("scale_decay", head=1, position=0, channel=5, factor=1.5),
]


@pytest.mark.parametrize("edit,gated", list(itertools.product(EDITS, [False, True])))
def test_edit_matches_a_loop_that_edits_the_state(edit, gated):
    B, T, H, K, V, n_h = 2, 12, 2, 8, 6, 2
    q = F.normalize(torch.randn(B, T, H, K, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(B, T, n_h, H, K, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, n_h, H, V, dtype=torch.float64)
    beta = torch.rand(B, T, n_h, H, dtype=torch.float64) * 2
    g = -torch.rand(B, T, H, dtype=torch.float64) * 0.5 if gated else None
    none = StateEdit("scale_decay", head=0, position=0, factor=1.0)
    o = loop_with_edit(q, k, v, beta, g, none, K**-0.5)
    want = loop_with_edit(q, k, v, beta, g, edit, K**-0.5)
    got = edited_output(q, k, v, beta, g, o, edit)
    assert got.dtype == o.dtype
    assert ((got - want).norm() / want.norm()).item() < 1e-12  # float64 in, float64 arithmetic
    changed = (want - o).norm(dim=-1).amax((0, 2))  # per token
    assert (changed[: edit.position] == 0).all() and changed[edit.position :].max() > 1e-3
    got32 = edited_output(*(x.float() for x in (q, k, v, beta)), None if g is None else g.float(), o.float(), edit)
    assert got32.dtype == torch.float32 and ((got32 - want).norm() / want.norm()).item() < 1e-5
    assert torch.equal(got[:, :, 1 - edit.head], o[:, :, 1 - edit.head])  # the other head is untouched


def test_surgery_specs_parse_and_reject():
    e = intervene.parse_surgery("erase", "1:3@89")
    assert (e.kind, e.layer, e.head, e.position, e.step) == ("erase", 1, 3, 89, None)
    e = intervene.parse_surgery("write", "0:1@12=5:0")
    assert (e.position, e.source, e.step) == (12, 5, 0) and e.label == "write 0:1@12=5:0"
    e = intervene.parse_surgery("scale_decay", "0:1:3@7=0.5")
    assert (e.channel, e.position, e.value) == (3, 7, 0.5)
    for kind, text in (("erase", "1:3"), ("write", "0:1@12"), ("scale_decay", "0:1@7=-1")):
        with pytest.raises(ProbeError) as err:
            intervene.parse_surgery(kind, text)
        assert "\n" not in str(err.value)


TEXT = b"class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def norm(self"
LAYER, HEAD, QUERY, SOURCE = 1, 3, 98, 89  # "def norm(self" reads the space at 89 (the indentation of `def`)


@pytest.fixture(scope="module")
def lm():
    from nnsight import NNsight

    from deltalab.models import load_checkpoint

    model = load_checkpoint(ZOO / "stdlib-deltanet", device="cpu").eval()
    return model, NNsight(model)


def test_erasing_the_source_the_map_points_to_changes_the_prediction(lm):
    """stdlib-deltanet: after `    def norm(self` it predicts ')'. The exact map of layer 1 head 3 at that token
    ranks the indentation space at 89 among its top sources; erasing that association (H_89 <- (I - k k^T) H_89)
    turns the prediction to '.' (as in `self.x` of a method body), while erasing the weakest source does nothing
    of the kind."""
    from deltalab.kernels.attention.chunk import delta_attention

    model, nn_model = lm
    ids = torch.tensor([list(TEXT)])
    hooks: dict = {}
    with nn_model.trace(ids):
        a = nn_model.layers[LAYER].attn
        for name in ("hook_q", "hook_k", "hook_v", "hook_beta"):
            hooks[name] = getattr(a, name).output.save()
    x = [hooks[n].detach().double() for n in ("hook_q", "hook_k", "hook_v", "hook_beta")]
    m = delta_attention(*x, window=(QUERY, QUERY + 1))
    contrib = (m.weights[0, 0, HEAD].abs() * x[2][0, :, :, HEAD].norm(dim=-1)).sum(-1)[: QUERY - 1]  # older tokens
    assert SOURCE in contrib.topk(3).indices.tolist()
    weakest = int(contrib.argmin())

    tokens = ids.numpy()
    labels = np.full_like(tokens, IGNORE_INDEX)
    labels[0, :-1] = tokens[0, 1:]
    with torch.no_grad():
        base = F.log_softmax(model(ids).logits.float(), -1)[0, QUERY]
    labels[0, QUERY] = int(base.argmax())  # accuracy at the query: does the model keep its own prediction?
    assert chr(int(base.argmax())) == ")"
    out = {}
    for name, src in (("top", SOURCE), ("weakest", weakest)):
        edit = intervene.Edit("erase", LAYER, HEAD, None, position=src)
        with nn_model.trace(ids):
            intervene._apply(nn_model, [edit], {}, gated=False)
            logits = nn_model.output.logits.save()
        kl: dict = {}
        acc, _, right, _ = intervene.evaluate(model, tokens, labels, [edit], {}, nn_model=nn_model, kl=kl)
        out[name] = (F.log_softmax(logits.detach().float(), -1)[0, QUERY], kl["sum_by_pos"][QUERY], right[QUERY])
    top, weak = out["top"], out["weakest"]
    assert chr(int(top[0].argmax())) == "." and top[2] == 0  # the prediction changed (accuracy at QUERY: 1 -> 0)
    assert int(weak[0].argmax()) == int(base.argmax()) and weak[2] == 1
    assert top[1] > 0.1 and top[1] > 100 * weak[1]  # KL(base || edited) at the query


def test_cli_runs_surgery_and_reports_kl(tmp_path):
    import json

    from typer.testing import CliRunner

    from deltalab.app.cli import app
    from deltalab.models import DeltaProductForCausalLM, ModelConfig, save_checkpoint
    from deltalab.probes.synthetic import write_synthetic_store

    store = write_synthetic_store(tmp_path / "s.zarr", n_seq=2, length=24, seed=3)
    cfg = ModelConfig(model_type="gated_deltaproduct", vocab_size=8, hidden_size=32, num_hidden_layers=2,
                      num_heads=4, head_dim=8, expand_v=1.0, num_householder=2, use_forget_gate=True,
                      use_output_gate=False, use_short_conv=False, allow_neg_eigval=True)
    save_checkpoint(DeltaProductForCausalLM(cfg).eval(), tmp_path / "ckpt")
    res = CliRunner().invoke(app, ["probe", "intervene", "--store", str(store), "--checkpoint", str(tmp_path / "ckpt"),
                                   "--erase", "0:1@5", "--write", "0:2@6=3:0", "--scale-decay", "0:0:4@2=0",
                                   "--json", "--no-write"])
    assert res.exit_code == 0, res.output
    recs = json.loads(res.stdout)
    assert [r["intervention"] for r in recs] == ["baseline", "erase", "write", "scale_decay"]
    assert recs[0]["kl"] == 0 and all(r["kl"] > 0 for r in recs[1:])
    assert (recs[1]["position"], recs[2]["source"], recs[3]["channel"]) == (5, 3, 4)
    res = CliRunner().invoke(app, ["probe", "intervene", "--store", str(store), "--checkpoint", str(tmp_path / "ckpt"),
                                   "--erase", "0:1@99"])
    assert res.exit_code == 2 and "token 99 out of range" in res.stderr
