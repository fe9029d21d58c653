"""Math on tensors only: recurrences, chunked forms, Triton kernels, spectra and state ranks."""

from kernels.chunk import chunk_delta_product
from kernels.dispatch import delta_product_forward
from kernels.naive import naive_delta_product
from kernels.ranks import state_rank_metrics, state_ranks
from kernels.spectra import householder_spectra

__all__ = [
    "chunk_delta_product",
    "delta_product_forward",
    "householder_spectra",
    "naive_delta_product",
    "state_rank_metrics",
    "state_ranks",
]
