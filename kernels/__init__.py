"""Math on tensors only: recurrences, chunked forms, Triton kernels, spectra and state ranks.

The names below load on first use (PEP 562), so `from kernels.constants import CHUNK_SIZE` does not
import torch: the store schema, probes and dashboard stay quick to import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kernels.chunk import chunk_delta_product
    from kernels.dispatch import delta_product_forward
    from kernels.dplr import dplr_forward
    from kernels.dplr_chunk import chunk_dplr
    from kernels.dplr_naive import naive_dplr
    from kernels.naive import naive_delta_product
    from kernels.ranks import state_rank_metrics, state_ranks
    from kernels.spectra import householder_spectra

_HOMES = {
    "chunk_delta_product": "kernels.chunk",
    "chunk_dplr": "kernels.dplr_chunk",
    "delta_product_forward": "kernels.dispatch",
    "dplr_forward": "kernels.dplr",
    "householder_spectra": "kernels.spectra",
    "naive_dplr": "kernels.dplr_naive",
    "naive_delta_product": "kernels.naive",
    "state_rank_metrics": "kernels.ranks",
    "state_ranks": "kernels.ranks",
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
