"""The attention benchmark's peers compute the same map, and its table marks the extrapolated columns."""

from __future__ import annotations

import pytest
import torch

from benchmarks.attention import dense_phi_rows, make_inputs, table
from deltalab.kernels.attention.naive import naive_attention


@pytest.mark.parametrize("gate", ["scalar", "channel"])
def test_dense_phi_rows_equal_the_oracle(gate):
    q, k, v, beta, g = (t.double() for t in make_inputs(12, 2, gate, "cpu"))
    alpha, _ = naive_attention(q, k, v, beta, g)
    got = dense_phi_rows(q, k, beta, g, [5, 11])
    assert torch.allclose(got, alpha[0, [5, 11], 0], rtol=1e-10, atol=1e-14)


def test_table_names_every_row_and_marks_extrapolation():
    import benchmarks.attention as ba

    rows = [dict(T=64, n_h=n_h, gate=gate, device="cpu", max_rel_err_vs_fp64=1e-7,
                 **{key: 1.0 for key, _ in ba.COLUMNS}) for n_h in (1, 2) for gate in ("scalar", "channel")]
    text = table(rows)
    assert text.count("\n") == len(rows) + 2 and "| 64 | 2 | channel |" in text
    assert "fp64 oracle*" in text and "dense Phi*" in text and "extrapolated" in text
