"""In-memory probe runs on the first few sequences of a store, for pages whose probe has not been run yet.

Nothing is written to the store; the dashboard labels these views as previews and shows the command
that computes the real results over every sequence.
"""

from __future__ import annotations

from contextlib import nullcontext
from types import ModuleType

import xarray as xr

BUDGET = 256 * 2**20
"""Bytes of store data a preview holds at once."""


def compute(module: ModuleType, ds: xr.Dataset) -> xr.Dataset:
    """`module.run(ds)` with a small memory budget, loaded into memory (lazy parts computed).

    BLAS/OpenMP run single-threaded here: previews are many tiny linear-algebra calls (PCA of a few
    thousand keys, 3 x 3 principal angles), where thread start-up costs more than it gains, and the server
    shares its cores with every other session.
    """
    with _single_threaded_blas() if getattr(module, "NAME", "") not in NO_BLAS else nullcontext():
        result = module.run(ds, budget=BUDGET)
        return result.dataset.compute()


NO_BLAS = {"betas"}
"""Probes whose previews call no BLAS (histograms and means): they skip the thread limit."""


_CONTROLLER: list = []


def _single_threaded_blas():
    """BLAS/OpenMP limited to one thread. The controller scans the loaded libraries once (0.15 s); each
    `threadpool_limits()` call would rescan them."""
    try:
        from threadpoolctl import ThreadpoolController  # installed with scikit-learn
    except ImportError:  # pragma: no cover - then BLAS keeps its own thread count
        return nullcontext()
    if not _CONTROLLER:
        _CONTROLLER.append(ThreadpoolController())
    return _CONTROLLER[0].limit(limits=1)
