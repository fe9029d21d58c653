"""Your own input from several threads at once: the background warm-up, a click on Run and a second tab all trace
the same model. nnsight routes a module's calls to whichever trace on it is running and hands values over by
greenlet switches, so two traces at once used to fail ("parent cannot be on a different thread", a value "not
cached"); every traced forward now runs on one model thread."""

from __future__ import annotations

import threading

import numpy as np

from deltalab.app.dash import own_input
from tests.app.stores import tiny_checkpoint


def test_runs_from_several_threads_at_once_all_succeed_and_agree(tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "s4-tiny")
    attrs = {"model_config": {"vocab_size": 24}, "data_spec": "S4:length=8"}
    enc = own_input.encode(" ".join(str(i % 24) for i in range(96)), attrs)
    model = own_input.get_model(ckpt, "cpu")
    expected = own_input.run(model, enc, attrs)
    results, errors = [], []
    start = threading.Barrier(3)

    def work() -> None:
        start.wait()
        try:
            for _ in range(3):
                results.append(own_input.run(own_input.get_model(ckpt, "cpu"), enc, attrs))
        except Exception as err:  # noqa: BLE001 - collected and reported by the assertion
            errors.append(repr(err))

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and len(results) == 9
    for ds in results:
        for var in ("k", "beta", "loss"):
            np.testing.assert_array_equal(ds[var].values, expected[var].values)
