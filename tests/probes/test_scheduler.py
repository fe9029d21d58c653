"""`deltalab probe NAME --scheduler ADDRESS`: a probe's blocks run on a dask.distributed cluster (here an
in-process one reached by its address) and write the same results as the default threaded run; an unreachable
address fails in one line and writes nothing."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from deltalab.app.cli import app
from deltalab.probes.results import list_results, read_results
from deltalab.probes.synthetic import write_synthetic_store

distributed = pytest.importorskip("distributed")


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    return write_synthetic_store(tmp_path_factory.mktemp("sched") / "s.zarr", n_seq=6, length=96, gated=True)


def _run(store, *args: str) -> None:
    res = CliRunner().invoke(app, ["probe", *args, "--store", str(store)])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("probe", ["erank", "spectra"])
def test_probe_on_a_cluster_equals_the_threaded_run(synthetic, probe):
    _run(synthetic, probe, "--name", f"{probe}-threads", "--memory-budget", "64KB")  # several blocks
    with distributed.LocalCluster(processes=False, n_workers=2, threads_per_worker=1, dashboard_address=None) as c:
        _run(synthetic, probe, "--name", f"{probe}-cluster", "--memory-budget", "64KB",
             "--scheduler", c.scheduler_address)
        assert c.scheduler.task_prefixes  # the graph ran on the cluster, not on dask's local threads
    a, b = read_results(synthetic, f"{probe}-threads"), read_results(synthetic, f"{probe}-cluster")
    assert set(a.data_vars) == set(b.data_vars) and b.attrs["complete"]
    for v in a.data_vars:
        np.testing.assert_array_equal(np.asarray(a[v].values), np.asarray(b[v].values), err_msg=v)
    assert b.attrs["params"]["scheduler"] == c.scheduler_address


def test_unreachable_scheduler_fails_in_one_line(synthetic):
    before = set(list_results(synthetic))
    res = CliRunner().invoke(app, ["probe", "betas", "--store", str(synthetic), "--name", "nowhere",
                                   "--scheduler", "tcp://127.0.0.1:9"])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--scheduler tcp://127.0.0.1:9: cannot reach a dask scheduler there" in lines[0]
    assert set(list_results(synthetic)) == before
