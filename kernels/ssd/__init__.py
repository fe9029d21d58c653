"""Gated linear attention with one scalar decay per head and no removal (Mamba-2's SSD): the float64 oracle, the
chunked PyTorch form and the exact attention (semiseparable) matrix.

`S_t = exp(g_t) S_{t-1} + k_t v_t^T`, `o_t = scale * S_t^T q_t`: the gated delta rule with its removal term
`-beta k k^T S` dropped and the write taken whole (beta cannot express this, since it scales removal and write).
"""
