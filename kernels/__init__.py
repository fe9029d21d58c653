"""Math on tensors only: recurrences, chunked forms, Triton kernels, spectra and state ranks.

The names below load on first use (PEP 562), so `from kernels.constants import CHUNK_SIZE` does not
import torch: the store schema, probes and dashboard stay quick to import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deltalab.kernels.delta_rule.chunk import chunk_delta_product
    from deltalab.kernels.delta_rule.dispatch import delta_product_forward
    from deltalab.kernels.delta_rule.naive import naive_delta_product
    from deltalab.kernels.dplr.chunk import chunk_dplr
    from deltalab.kernels.dplr.dispatch import dplr_forward
    from deltalab.kernels.dplr.naive import naive_dplr
    from deltalab.kernels.ranks.chunk import state_rank_metrics, state_ranks
    from deltalab.kernels.spectra.householder import householder_spectra

_HOMES = {
    "chunk_delta_product": "deltalab.kernels.delta_rule.chunk",
    "chunk_dplr": "deltalab.kernels.dplr.chunk",
    "delta_product_forward": "deltalab.kernels.delta_rule.dispatch",
    "dplr_forward": "deltalab.kernels.dplr.dispatch",
    "householder_spectra": "deltalab.kernels.spectra.householder",
    "naive_dplr": "deltalab.kernels.dplr.naive",
    "naive_delta_product": "deltalab.kernels.delta_rule.naive",
    "state_rank_metrics": "deltalab.kernels.ranks.chunk",
    "state_ranks": "deltalab.kernels.ranks.chunk",
}
"""Public name -> the module defining it."""

__all__ = [
    "chunk_delta_product",
    "chunk_dplr",
    "delta_product_forward",
    "dplr_forward",
    "householder_spectra",
    "naive_delta_product",
    "naive_dplr",
    "state_rank_metrics",
    "state_ranks",
]


def __getattr__(name: str) -> Any:
    """Import a public name's module on first access (PEP 562)."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
