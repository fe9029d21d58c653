"""store.plan: a capture is planned (every argument checked, nothing written), then executed."""

from __future__ import annotations

import pytest
import torch

from deltalab import store
from deltalab.models import DeltaProductForCausalLM, save_checkpoint
from deltalab.store.capture import execute
from deltalab.store.plan import CaptureError, CapturePlan, plan_capture
from tests.store.test_capture import tiny_config

SPEC = "S4:length=70,samples=6,seed=1"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.manual_seed(0)
    return save_checkpoint(DeltaProductForCausalLM(tiny_config()), tmp_path_factory.mktemp("ckpt") / "gdp")


def test_the_plan_writes_nothing_and_execute_writes_its_attrs(ckpt, tmp_path):
    out = tmp_path / "s.zarr"
    plan = plan_capture(ckpt, SPEC, out, hooks="tokens,k,beta,state", layers="1", batch_size=4, progress=False,
                        state_every=2, command_line=["planned"])
    assert isinstance(plan, CapturePlan) and not out.exists()
    assert plan.layers == [1] and plan.batch_size == 4 and {"tokens", "k", "beta", "state"} <= set(plan.variables)
    assert "q" not in plan.variables and "o" not in plan.variables
    assert plan.sizes["chunk"] == 2 and plan.attrs["chunk_size"] == 128  # 70 tokens, chunks of 2 * 64
    summary = execute(plan)
    assert summary["written"] == 6 and summary["complete"] == 6
    attrs = store.read_attrs(out)
    for key in ("hooks", "variables", "layers", "batch_size", "sizes", "chunk_size", "command_line", "dtype"):
        assert attrs[key] == plan.attrs[key], key
    assert store.open(out)["state"].sizes["layer"] == 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(state_every=0), "--state-every must be >= 1"),
    (dict(batch_size=0), "--batch-size must be >= 1"),
    (dict(layers="5"), "layer 5 is out of range"),
    (dict(dtype="float8"), "--dtype 'float8' is not supported"),
    (dict(hooks="tokens,beta", state_every=2), "no states are captured"),
])
def test_a_bad_argument_fails_in_the_plan_before_the_store_exists(ckpt, tmp_path, kwargs, message):
    out = tmp_path / "s.zarr"
    with pytest.raises(CaptureError, match=message):
        plan_capture(ckpt, SPEC, out, progress=False, **kwargs)
    assert not out.exists()
