"""Numbers the math and the data fix; torch-free, so the store schema, probes and dashboard import them cheaply."""

CHUNK_SIZE = 64
"""Tokens per recurrence chunk: the chunked forms carry the state across chunks of this many tokens, and the
`state` hook holds the state before tokens 0, 64, 128, ... plus the final state."""

SECULAR_PRECISIONS = ("float64", "float32")
"""Precisions of the secular-equation solves (`kernels.spectra.dplr`, `kernels.linalg.triton_secular`, the spectra
probe): float64 is the exact default, float32 the fast path for transitions of bf16/fp16/fp32 models."""

SECULAR_ITERATIONS = 64
"""Cap on the secular-equation steps per eigenvalue (`kernels.spectra.dplr` and the Triton solver
`kernels.linalg.triton_secular`); the roots converge in 3-12 middle-way steps, so the cap only stops a runaway."""

IGNORE_INDEX = -100
"""Label of a position with no target (Hugging Face's convention): the loss and every metric skip it. It lives here,
at the bottom of the stack, because both the task generators and the models' losses speak it."""
