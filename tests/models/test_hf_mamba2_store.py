"""A Mamba-2 hybrid through the commands: `deltalab info`, `deltalab capture` (q, k, v, g, state, no beta) and the
probes that apply (keys, decays); the stored states are the float64 recurrence of the stored inputs."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from typer.testing import CliRunner  # noqa: E402

from deltalab import store  # noqa: E402
from deltalab.app.cli import app  # noqa: E402
from deltalab.kernels.ssd.naive import naive_ssd  # noqa: E402
from tests.models.hf_tiny import save_char_tokenizer  # noqa: E402
from tests.models.mamba2_tiny import save_tiny  # noqa: E402
from tests.models.oracles import fro  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = save_tiny("bamba", tmp_path_factory.mktemp("bamba"))
    save_char_tokenizer(path)
    text = path.parent / "text.txt"
    text.write_text("\n".join(f"the fox number {i} runs over the lazy dog and far away again" for i in range(6)))
    return path


@pytest.fixture(scope="module")
def captured(folder):
    out = folder.parent / "m2.zarr"
    res = CliRunner().invoke(app, ["capture", str(folder), "--data", f"text:{folder.parent / 'text.txt'}:length=70",
                                   "--out", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    return out


def test_info(folder):
    res = CliRunner().invoke(app, ["info", str(folder)])
    assert res.exit_code == 0, res.output
    assert "Bamba (bamba)" in res.output and "3 Mamba-2 (SSD, no removal) [0, 1, 3]" in res.output
    assert "2 group(s) / 4 heads, dk=d_state=8 dv=head_dim=16" in res.output


def test_capture_holds_the_recurrence(captured):
    ds = store.open(captured)
    assert {"q", "k", "v", "g", "state"} <= set(ds.data_vars) and "beta" not in ds.data_vars
    assert ds.attrs["model_config"]["removal"] is False and list(ds.layer.values) == [0, 1, 3]
    row = ds.isel(seq=0, layer=1)
    q, k, v, g, states = (torch.from_numpy(row[n].values) for n in ("q", "k", "v", "g", "state"))
    _, at64 = naive_ssd(q[None, :64], k[None, :64, 0], v[None, :64, 0], g[None, :64])
    _, final = naive_ssd(q[None], k[None, :, 0], v[None, :, 0], g[None])
    assert fro(states[1], at64[0]) < 1e-5 and fro(states[-1], final[0]) < 1e-5


def test_beta_asked_for_is_refused(folder, tmp_path):
    res = CliRunner().invoke(app, ["capture", str(folder), "--data", f"text:{folder.parent / 'text.txt'}:length=70",
                                   "--out", str(tmp_path / "x.zarr"), "--hooks", "tokens,q,beta", "--no-progress"])
    assert res.exit_code == 2 and "no removal and no beta" in res.output
    assert not (tmp_path / "x.zarr").exists()


@pytest.mark.parametrize("probe", ["keys", "decays"])
def test_probes_that_apply_run(captured, probe):
    res = CliRunner().invoke(app, ["probe", probe, "--store", str(captured)])
    assert res.exit_code == 0, res.output
    assert probe in store.list_results(captured)
    results = store.open_results(captured, probe)
    assert results.sizes.get("layer", 3) == 3  # one entry per Mamba-2 layer where the result is per layer


def test_a_hybrid_without_mamba_layers_is_refused(tmp_path):
    """A Bamba config whose every layer is softmax attention: one line naming the problem, exit code 2."""
    import transformers as tf

    from tests.models.mamba2_tiny import ATTN, COMMON, MAMBA

    torch.manual_seed(0)
    config = tf.BambaConfig(**COMMON, **ATTN, **MAMBA, attn_layer_indices=[0, 1, 2, 3])
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    for command in (["info", str(tmp_path)], ["capture", str(tmp_path), "--data", "S4:length=8,samples=2",
                                               "--out", str(tmp_path / "x.zarr"), "--no-progress"]):
        res = CliRunner().invoke(app, command)
        assert res.exit_code == 2, res.output
        line = res.output.strip()
        assert "\n" not in line and "no linear_attention layer" in line and "Mamba-2 layers" in line
    assert not (tmp_path / "x.zarr").exists()
