"""Math on tensors only: recurrences, chunked forms, Triton kernels, spectra and state ranks."""

from kernels.chunk import chunk_delta_product
from kernels.dispatch import delta_product_forward
from kernels.naive import naive_delta_product

__all__ = ["delta_product_forward", "naive_delta_product", "chunk_delta_product"]
