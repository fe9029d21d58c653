"""Float64 oracle for the exact attention map of delta-rule layers: transitions multiplied out densely.

Number the Householder sub-steps u = (s, j), flat index s * n_h + j. Per value head the transition of
sub-step u is the dense dk x dk matrix
    A_u = a_u (I - b_u k_u k_u^T)                      scalar gate (a_u = exp(g_s) at j = 0, else 1)
    A_u = (I - b_u k_u k_u^T) diag(exp g_s)            per-channel gate (at j = 0; j > 0 has no decay)
and H_u = A_u H_{u-1} + b_u k_u v_u^T.  With Phi(t, u) = A_{e_t} ... A_{u+1} (e_t = t n_h + n_h - 1,
the sub-step after which token t's query reads the state) the recurrence unrolls to
    o_t = scale H_0^T Phi(t, -1)^T q_t + sum_{u <= e_t} alpha_{t,u} v_u,
    alpha_{t,u} = scale b_u q_t^T Phi(t, u) k_u.
Nothing clever happens here: every A_u is built as a matrix and the query row r^T = q_t^T Phi(t, u) is
multiplied out one transition at a time, backwards from e_t. Cost O(T * T n_h * dk^2) per head: small
shapes only. Same shapes and layout as `kernels.attention.chunk.delta_attention` (see there).
"""

from __future__ import annotations

import torch

from deltalab.kernels.delta_rule.naive import l2_normalize


def _expand_keys(x: torch.Tensor, n_value_heads: int, head_dim: int) -> torch.Tensor:
    """Key-head tensor -> value-head tensor: value head h reads key head h // (Hv / Hk)."""
    groups = n_value_heads // x.shape[head_dim]
    return x.repeat_interleave(groups, dim=head_dim)


def transitions(k: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None, n_value_heads: int) -> torch.Tensor:
    """Dense transitions A_u as [B, T, n_h, Hv, dk, dk] (keys already on value heads or expanded here)."""
    k = _expand_keys(k, n_value_heads, 3)
    B, T, n_h, H, K = k.shape
    eye = torch.eye(K, dtype=k.dtype, device=k.device)
    A = eye - beta[..., None, None] * k[..., :, None] * k[..., None, :]
    if g is not None:
        if g.dim() == 3:  # scalar gate: a (I - b k k^T)
            A[:, :, 0] = A[:, :, 0] * g.exp()[..., None, None]
        else:  # per-channel: (I - b k k^T) diag(exp g), i.e. column c scaled by exp(g_c)
            A[:, :, 0] = A[:, :, 0] * g.exp()[..., None, :]
    return A


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    normalize_qk: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (alpha [B, T, Hv, T, n_h], initial-state term [B, T, Hv, dv]), in float64.

    alpha[b, t, h, s, j] is the signed weight of v_{s,j} in o_t (zero for s > t); the initial-state
    term is scale H_0^T Phi(t, -1)^T q_t (zero without an initial state).
    """
    q, k, v, beta = (x.double() for x in (q, k, v, beta))
    g = None if g is None else g.double()
    if normalize_qk:
        q, k = l2_normalize(q), l2_normalize(k)
    B, T, n_h, Hv, V = v.shape
    K = q.shape[-1]
    scale = K**-0.5 if scale is None else scale
    q = _expand_keys(q, Hv, 2)
    kx = _expand_keys(k, Hv, 3)
    A = transitions(kx, beta, g, Hv)  # [B, T, n_h, Hv, K, K]
    alpha = torch.zeros(B, T, Hv, T, n_h, dtype=torch.float64)
    init = torch.zeros(B, T, Hv, V, dtype=torch.float64)
    for t in range(T):
        r = q[:, t]  # [B, Hv, K], the row q_t^T Phi(t, u) as u walks back
        for s in range(t, -1, -1):
            for j in range(n_h - 1, -1, -1):
                alpha[:, t, :, s, j] = scale * beta[:, s, j] * (r * kx[:, s, j]).sum(-1)
                r = torch.einsum("bhk,bhkl->bhl", r, A[:, s, j])
        if initial_state is not None:
            init[:, t] = scale * torch.einsum("bhk,bhkv->bhv", r, initial_state.double())
    return alpha, init


def naive_gla_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    normalize_qk: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated-linear-attention approximation: Phi replaced by the product of the decays alone.

    alpha~_{t,u} = scale b_u q_t^T diag(exp(sum of log-gates over tokens s' in (s, t])) k_u for u = (s, j);
    same layout as `naive_attention`. Exact when the Householder factors act as the identity on the keys.
    """
    q, k, v, beta = (x.double() for x in (q, k, v, beta))
    if normalize_qk:
        q, k = l2_normalize(q), l2_normalize(k)
    B, T, n_h, Hv, V = v.shape
    K = q.shape[-1]
    scale = K**-0.5 if scale is None else scale
    q, k = _expand_keys(q, Hv, 2), _expand_keys(k, Hv, 3)
    if g is None:
        logd = torch.zeros(B, T, Hv, 1, dtype=torch.float64)
    else:
        logd = g.double() if g.dim() == 4 else g.double()[..., None]
    alpha = torch.zeros(B, T, Hv, T, n_h, dtype=torch.float64)
    init = torch.zeros(B, T, Hv, V, dtype=torch.float64)
    for t in range(T):
        for s in range(t + 1):
            decay = logd[:, s + 1 : t + 1].sum(1).exp()  # tokens after s up to t; the write at s is not decayed
            dots = ((q[:, t] * decay)[:, None] * k[:, s]).sum(-1)  # [B, n_h, Hv]
            alpha[:, t, :, s] = (scale * beta[:, s] * dots).transpose(1, 2)
        if initial_state is not None:
            r = q[:, t] * logd[:, : t + 1].sum(1).exp()
            init[:, t] = scale * torch.einsum("bhk,bhkv->bhv", r, initial_state.double())
    return alpha, init


def naive_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    normalize_qk: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, T, Hv, dv], final state [B, Hv, dk, dv]) of the recurrence itself, in float64.

    Grouped heads, scalar or per-channel gates.
    The oracle the attention identity is checked against; for scalar gates and Hk = Hv it is
    `kernels.delta_rule.naive.naive_delta_product` (tested).
    """
    q, k, v, beta = (x.double() for x in (q, k, v, beta))
    g = None if g is None else g.double()
    if normalize_qk:
        q, k = l2_normalize(q), l2_normalize(k)
    B, T, n_h, Hv, V = v.shape
    K = q.shape[-1]
    scale = K**-0.5 if scale is None else scale
    q, k = _expand_keys(q, Hv, 2), _expand_keys(k, Hv, 3)
    state = torch.zeros(B, Hv, K, V, dtype=torch.float64) if initial_state is None else initial_state.double()
    out = []
    for t in range(T):
        if g is not None:
            state = state * (g[:, t].exp()[..., None, None] if g.dim() == 3 else g[:, t].exp()[..., None])
        for j in range(n_h):
            kk, vv, bb = k[:, t, j], v[:, t, j], beta[:, t, j]
            residual = vv - torch.einsum("bhkv,bhk->bhv", state, kk)
            state = state + bb[..., None, None] * kk[..., :, None] * residual[..., None, :]
        out.append(scale * torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(out, 1), state
