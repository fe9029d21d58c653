"""A probed store of the fla-written tiny RWKV-7 fixture (tests/fixtures/fla/rwkv7_fused: 2 layers, 4 heads of
dk = dv = 16), captured and probed through the CLI, for the probe and dashboard tests."""

from __future__ import annotations

from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "fla" / "rwkv7_fused"
HOOKS = "tokens,labels,loss,q,k,v,beta,g,state,o"


def probed_rwkv7_store(base: Path, spec: str, probes: dict[str, list[str]], checkpoint: Path = FIXTURE,
                       extra: tuple[str, ...] = ()) -> Path:
    """`checkpoint` captured over `spec` with every hook into base/s.zarr through the CLI, and probed with `probes`
    (name -> extra arguments); each step must succeed."""
    from typer.testing import CliRunner

    from deltalab.app.cli import app

    out = base / "s.zarr"
    res = CliRunner().invoke(app, ["capture", str(checkpoint), "--data", spec, "--out", str(out), "--hooks", HOOKS,
                                   "--no-progress", *extra])
    assert res.exit_code == 0, res.output
    for probe, args in probes.items():
        res = CliRunner().invoke(app, ["probe", probe, "--store", str(out), *args])
        assert res.exit_code == 0, (probe, res.output)
    return out
