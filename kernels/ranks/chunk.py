"""State ranks over time, rebuilt chunk by chunk from the chunk-boundary states.

For every token (or every Householder sub-step) and head: entropy effective rank exp(-sum p log p) with
p = sigma / sum sigma (DeltaProduct paper), stable rank ||H||_F^2 / ||H||_2^2 and rank utilisation
stable rank / min(dk, dv) (state-reduction paper), and the Frobenius, spectral and nuclear norms.

Per-token states of a whole sequence are never held: chunk c is replayed from its start state
(boundary c = the state before token c * C) token by token, the states of a group of chunks are turned
into metrics in a batch and dropped. Singular values: on the CPU from the float64 Gram matrix
(sigma_i = sqrt(lambda_i(H H^T)), absolute error ~1e-8 sigma_max); on CUDA from `kernels.linalg.triton_svd`
(float32 bidiagonalisation + bisection, one program per matrix, error ~1e-7 sigma_max), or from the
float64 Gram through cuSOLVER's batched XsyevBatched (`kernels.linalg.cusolver_eigh`; torch.linalg.eigh loops
over matrices larger than 32). Every metric matches a float64 SVD to ~1e-5 relative, also for the
rank-deficient states of early tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from deltalab.kernels.delta_rule.naive import CHUNK_SIZE, l2_normalize
from deltalab.kernels.linalg import cusolver_eigh

METHODS = ("auto", "gram64", "triton", "svd", "svd64")
# What "auto" picks on CUDA. Measured on a Hopper GPU (benchmarks.kernels_analysis, dk = dv = 128): the Triton kernel
# 3.8 us per matrix, cuSOLVER XsyevBatched on the float64 Gram 9.7 us, torch.linalg.eigvalsh 581 us,
# torch.linalg.svdvals 5.8 ms.
CUDA_METHOD = "triton"
TRITON_MAX_DIM = 128
BACKENDS = ("auto", "cusolver", "torch")
SOLVER_BATCH = 8192  # matrices per eigensolver call


class RankMetrics(NamedTuple):
    """Per-state metrics, each [B, T, H] (or [B, T, n_h, H] per sub-step)."""

    erank: torch.Tensor
    stable_rank: torch.Tensor
    rank_utilisation: torch.Tensor
    frobenius: torch.Tensor
    spectral: torch.Tensor
    nuclear: torch.Tensor


def metrics_from_singular_values(sigma: torch.Tensor, frobenius: torch.Tensor | None = None) -> RankMetrics:
    """Metrics [...] from singular values [..., r] (any order, r = min(dk, dv)).

    A zero state has erank 0 and stable rank 0 (not NaN). frobenius defaults to sqrt(sum sigma^2).
    """
    sigma = sigma.clamp(min=0)
    nuclear = sigma.sum(-1)
    spectral = sigma.amax(-1)
    fro = sigma.square().sum(-1).sqrt() if frobenius is None else frobenius.to(sigma.dtype)
    nonzero = nuclear > 0
    p = sigma / torch.where(nonzero, nuclear, torch.ones_like(nuclear))[..., None]
    entropy = -torch.special.xlogy(p, p).sum(-1)
    erank = torch.where(nonzero, entropy.exp(), torch.zeros_like(entropy))
    stable = torch.where(
        spectral > 0,
        fro.square() / torch.where(spectral > 0, spectral, torch.ones_like(spectral)).square(),
        torch.zeros_like(fro),
    )
    return RankMetrics(erank, stable, stable / sigma.shape[-1], fro, spectral, nuclear)


def _gram(states: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The smaller Gram matrix of [..., K, V] states: H H^T if K <= V else H^T H."""
    h = states.to(dtype)
    return h @ h.transpose(-1, -2) if h.shape[-2] <= h.shape[-1] else h.transpose(-1, -2) @ h


def check_choice(method: str, backend: str) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; pass one of {', '.join(METHODS)}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; pass one of {', '.join(BACKENDS)}")


def resolve_method(method: str, device: torch.device, shape: tuple[int, int] | None = None) -> str:
    """'auto' -> CUDA_METHOD on CUDA for states [K, V] up to TRITON_MAX_DIM a side, else 'gram64' (also on the
    CPU): the Triton kernel pads both sides to the next power of two of the larger one, so OLMo-Hybrid's 96 x 192
    states would run as 256 x 256 matrices (about 3 ms each on Hopper) where the 96 x 96 Gram costs microseconds."""
    if method != "auto":
        return method
    if device.type != "cuda" or (shape is not None and max(shape) > TRITON_MAX_DIM):
        return "gram64"
    return CUDA_METHOD


NON_FINITE_STATES = ("ranks: a state holds NaN or inf (non-finite keys, values, betas, gates or stored states); check "
                     "the model's activations before computing ranks")


def _eigh(a: torch.Tensor, backend: str) -> torch.Tensor:
    """Batched symmetric eigenvalues: cuSOLVER's batched solver on CUDA (auto), else torch.linalg."""
    if backend == "cusolver" or (backend == "auto" and a.is_cuda and cusolver_eigh.available()):
        return cusolver_eigh.batched_eigh(a)[0]
    return torch.linalg.eigvalsh(a)


def singular_values(states: torch.Tensor, method: str = "auto", backend: str = "auto") -> torch.Tensor:
    """Singular values [..., min(K, V)] (unordered) of states [..., K, V].

    auto: gram64 on the CPU, CUDA_METHOD on CUDA (gram64 where a side exceeds TRITON_MAX_DIM).
    gram64: sqrt of the eigenvalues of the float64 Gram matrix; error ~sqrt(eps64) sigma_max ~1e-8
    sigma_max. (A float32 Gram would give sqrt(eps32) ~3e-4 sigma_max: erank off by percents on
    low-rank states, so it is not offered.)
    triton: `kernels.linalg.triton_svd` (float32 bidiagonalisation + bisection in one kernel; error ~eps32
    sigma_max).
    svd / svd64: torch.linalg.svdvals in float32 / float64 (the authors' way; slow on GPUs).
    backend: where the Gram eigenproblem runs: auto = cuSOLVER's batched solver on CUDA, torch otherwise
    (torch.linalg.eigh loops over matrices larger than 32 on CUDA: hundreds of times slower).
    """
    check_choice(method, backend)
    lead, (K, V) = states.shape[:-2], states.shape[-2:]
    method = resolve_method(method, states.device, (K, V))
    flat = states.reshape(-1, K, V)
    outs = []
    for i in range(0, flat.shape[0], SOLVER_BATCH):
        h = flat[i : i + SOLVER_BATCH]
        if method == "svd":
            s = torch.linalg.svdvals(h.float())
        elif method == "svd64":
            s = torch.linalg.svdvals(h.double())
        elif method == "triton":
            from deltalab.kernels.linalg.triton_svd import svdvals

            s = svdvals(h)
        else:  # gram64
            try:
                s = _eigh(_gram(h, torch.float64), backend).clamp(min=0).sqrt()
            except torch.linalg.LinAlgError:  # LAPACK fails on NaN or inf: say which input, not its error code
                if not bool(torch.isfinite(h).all()):
                    raise ValueError(NON_FINITE_STATES) from None
                raise
        outs.append(s)
    return torch.cat(outs).reshape(*lead, -1)


def state_metrics(states: torch.Tensor, method: str = "auto", backend: str = "auto") -> RankMetrics:
    """RankMetrics [...] of a batch of states [..., K, V] (float64 metrics)."""
    sigma = singular_values(states, method, backend).double()
    fro = torch.linalg.matrix_norm(states).double()
    return metrics_from_singular_values(sigma, fro)


def _replay(
    start: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None,
    substeps: bool = False,
) -> torch.Tensor:
    """`replay_chunks` laid out [L', N, H, K, V] (contiguous): two batched GEMMs per sub-step, the state
    written straight into its output slot."""
    N, L, n_h, H = beta.shape
    K, V = k.shape[-1], v.shape[-1]
    M, dtype = N * H, k.dtype
    kk = k.permute(1, 2, 0, 3, 4).reshape(L, n_h, M, 1, K)
    vv = v.permute(1, 2, 0, 3, 4).reshape(L, n_h, M, 1, V)
    bk = (beta[..., None] * k).permute(1, 2, 0, 3, 4).reshape(L, n_h, M, K, 1)
    if g is None:
        gate = None
    elif g.dim() == 3:  # scalar gate [N, L, H]
        gate = g.exp().to(dtype).permute(1, 0, 2).reshape(L, M, 1, 1)
    else:  # per-channel gate [N, L, H, K]: decays the state's key rows
        gate = g.exp().to(dtype).permute(1, 0, 2, 3).reshape(L, M, K, 1)
    out = torch.empty(L * (n_h if substeps else 1), N, H, K, V, dtype=dtype, device=k.device)
    state = start.to(dtype).reshape(M, K, V)
    idx = 0
    for t in range(L):
        if gate is not None:
            state = state * gate[t]  # out of place: the previous state is stored in `out`
        for j in range(n_h):
            residual = torch.baddbmm(vv[t, j], kk[t, j], state, alpha=-1)  # v^T - k^T S  [M, 1, V]
            if substeps or j == n_h - 1:
                state = torch.baddbmm(state, bk[t, j], residual, out=out[idx].view(M, K, V))
                idx += 1
            else:
                state = torch.baddbmm(state, bk[t, j], residual)  # S + b k (v - S^T k)^T
    return out


def replay_chunks(
    start: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None,
    substeps: bool = False,
) -> torch.Tensor:
    """States after every token (or sub-step) of a group of chunks, each replayed from its start state.

    start [N, H, K, V]; k [N, L, n_h, H, K]; v [N, L, n_h, H, V]; beta [N, L, n_h, H]; g [N, L, H] (scalar),
    [N, L, H, K] (per key channel) or None.
    Returns [N, L, H, K, V] (or [N, L * n_h, H, K, V], sub-step j of token t at t * n_h + j), a view.
    Matrix products run in full float32 (TF32 is switched off for the call).
    """
    with full_precision():
        return _replay(start, k, v, beta, g, substeps).movedim(0, 1)


class full_precision:
    """Context: float32 matmuls in full precision (TF32 would cost ~1e-3 relative on the states)."""

    def __enter__(self) -> None:
        self._saved = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")

    def __exit__(self, *exc: object) -> None:
        torch.set_float32_matmul_precision(self._saved)


def state_rank_metrics(
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None,
    boundary_states: torch.Tensor | None,
    *,
    initial_state: torch.Tensor | None = None,
    substeps: bool = False,
    chunk_size: int = CHUNK_SIZE,
    normalize_k: bool = False,
    method: str = "auto",
    backend: str = "auto",
    max_states: int | None = None,
    progress: bool = False,
    every: int = 1,
) -> RankMetrics:
    """Rank metrics of the state after every token (or sub-step), for every batch entry and head.

    k [B,T,n_h,H,K], v [B,T,n_h,H,V], beta [B,T,n_h,H], g [B,T,H] | None as given to the kernels;
    boundary_states [B,NC,H,K,V] as they return them (boundary c = state before token c * chunk_size,
    NC >= ceil(T / chunk_size)); None: computed here with the chunked forward from initial_state.
    Chunks are replayed in groups of about `max_states` states (default 32768 on CUDA, 8192 otherwise),
    in float32 (float64 if the states are float64); method/backend as in `singular_values`.
    `every=N` ranks only the state after tokens N-1, 2N-1, ... (the others are NaN): the SVDs, the costly part,
    shrink N-fold, for capture-time reductions that must keep pace with the forward.
    Returns RankMetrics of [B,T,H] ([B,T,n_h,H] with substeps).
    """
    if every < 1 or (every > 1 and substeps):
        raise ValueError(f"every={every}: pass a positive token stride (and substeps=False when it is above 1)")
    if k.dim() != 5 or beta.shape != k.shape[:4] or v.shape[:4] != k.shape[:4]:
        raise ValueError(
            f"expected k [B,T,n_h,H,K], v [B,T,n_h,H,V], beta [B,T,n_h,H]; got {tuple(k.shape)}, "
            f"{tuple(v.shape)}, {tuple(beta.shape)}"
        )
    B, T, n_h, H, K = k.shape
    V = v.shape[-1]
    C = chunk_size
    n_chunks = -(-T // C)
    if boundary_states is None:
        boundary_states = _boundaries(k, v, beta, g, initial_state, C, normalize_k)
    if boundary_states.dim() != 5 or boundary_states.shape[0] != B or boundary_states.shape[2:] != (H, K, V):
        raise ValueError(
            f"expected boundary_states [B,NC,H,K,V] = [{B},NC,{H},{K},{V}], got {tuple(boundary_states.shape)}"
        )
    if boundary_states.shape[1] < n_chunks:
        raise ValueError(
            f"boundary_states has {boundary_states.shape[1]} chunk states, T={T} needs "
            f"{n_chunks} (one per {C} tokens); pass the kernel's boundary states and chunk_size"
        )
    if g is not None and g.shape not in ((B, T, H), (B, T, H, K)):
        raise ValueError(f"expected g [B,T,H] = {(B, T, H)} or per-channel [B,T,H,K], got {tuple(g.shape)}")
    check_choice(method, backend)
    if every > 1 and every % C == 0 and boundary_states.shape[1] > T // C:
        return ranks_at_boundaries(boundary_states, T, C, every, method, backend)
    dtype = torch.float64 if boundary_states.dtype == torch.float64 else torch.float32
    k, v, beta = k.to(dtype), v.to(dtype), beta.to(dtype)
    if normalize_k:
        k = l2_normalize(k)
    pad = n_chunks * C - T
    if pad:
        k, v, beta = (torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) for x in (k, v, beta))
        g = None if g is None else torch.nn.functional.pad(g, (0, 0) * (g.dim() - 2) + (0, pad))
    # [B, NCh, C, ...] with the batch folded into the chunk axis: chunks are independent once started.
    k = k.reshape(B * n_chunks, C, n_h, H, K)
    v = v.reshape(B * n_chunks, C, n_h, H, V)
    beta = beta.reshape(B * n_chunks, C, n_h, H)
    g = None if g is None else g.to(dtype).reshape(B * n_chunks, C, *g.shape[2:])
    starts = boundary_states[:, :n_chunks].reshape(B * n_chunks, H, K, V)

    per_chunk = C * (n_h if substeps else 1) * H
    if max_states is None:
        max_states = 32768 if k.is_cuda else 8192
    group = max(1, max_states // per_chunk)
    out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    out = torch.empty(len(RankMetrics._fields), B * n_chunks, per_chunk, dtype=out_dtype, device=k.device)
    ranges = range(0, B * n_chunks, group)
    if progress:
        from tqdm.auto import tqdm

        ranges = tqdm(ranges, desc="state ranks", unit="group")
    with full_precision():
        for c0 in ranges:
            c1 = min(B * n_chunks, c0 + group)
            states = _replay(
                starts[c0:c1], k[c0:c1], v[c0:c1], beta[c0:c1], None if g is None else g[c0:c1], substeps
            )  # [L', n, H, K, V]
            if every > 1:  # states after tokens t with (t + 1) % every == 0, t global within the sequence
                t = (torch.arange(c0, c1, device=k.device) % n_chunks)[:, None] * C + torch.arange(C, device=k.device)
                keep = ((t + 1) % every == 0) & (t < T)  # [L', C]
                part = torch.full((len(RankMetrics._fields), c1 - c0, C, H), float("nan"), dtype=out_dtype,
                                  device=k.device)
                if bool(keep.any()):
                    picked = states.transpose(0, 1)[keep]  # states are [C, L', H, K, V]: time first
                    part[:, keep] = torch.stack(state_metrics(picked, method, backend)).to(out_dtype)
                out[:, c0:c1] = part.reshape(len(part), c1 - c0, per_chunk)
            else:
                m = torch.stack(state_metrics(states, method, backend))  # [6, L', n, H]
                out[:, c0:c1] = m.permute(0, 2, 1, 3).reshape(len(m), c1 - c0, per_chunk).to(out_dtype)
            del states
    steps = n_h if substeps else 1
    out = out.reshape(len(RankMetrics._fields), B, n_chunks * C, steps, H)[:, :, :T]
    if not substeps:
        out = out[:, :, :, 0]
    return RankMetrics(*out.unbind(0))


def ranked_boundaries(T: int, C: int, every: int) -> list[int] | None:
    """The chunk-boundary states `every`-strided ranks read (boundary c = state after token c C - 1), or None
    when `every` is not a multiple of the chunk size (every chunk is then replayed from its start state)."""
    if every <= 1 or every % C:
        return None
    return [end // C for end in range(every, T + 1, every)]


def ranks_at_boundaries(boundary_states: torch.Tensor, T: int, C: int, every: int, method: str,
                         backend: str, picked: bool = False) -> RankMetrics:
    """`every` a multiple of the chunk size: the states after tokens every-1, 2 every-1, ... are chunk-boundary
    states (boundary c = state after token c C - 1), so nothing is replayed; only their SVDs run. `picked`: the
    states are only those boundaries, in order (`ranked_boundaries`: what a capture keeps for its reductions)."""
    B, _, H = boundary_states.shape[:3]
    ends = torch.arange(every, T + 1, every, device=boundary_states.device)  # t + 1 of the ranked tokens
    if picked and boundary_states.shape[1] != len(ends):
        raise ValueError(f"picked boundary states: expected {len(ends)} (T={T}, every={every}), got "
                         f"{boundary_states.shape[1]}")
    dtype = torch.float64 if boundary_states.dtype == torch.float64 else torch.float32
    out = torch.full((len(RankMetrics._fields), B, T, H), float("nan"), dtype=dtype, device=boundary_states.device)
    if len(ends):
        states = boundary_states if picked else boundary_states[:, ends // C]
        with full_precision():
            m = torch.stack(state_metrics(states.to(dtype), method, backend))  # [6, B, n, H]
        out[:, :, ends - 1] = m.to(dtype)
    return RankMetrics(*out.unbind(0))


def _boundaries(
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    chunk_size: int,
    normalize_k: bool,
) -> torch.Tensor:
    """Chunk-boundary states from the chunked PyTorch forward (queries do not affect states)."""
    from deltalab.kernels.delta_rule.chunk import chunk_delta_product

    B, T, _, H, K = k.shape
    dtype = torch.float64 if k.dtype == torch.float64 else torch.float32
    q = torch.zeros(B, T, H, K, dtype=dtype, device=k.device)
    with torch.no_grad():
        _, _, bounds = chunk_delta_product(
            q,
            k.to(dtype),
            v.to(dtype),
            beta.to(dtype),
            None if g is None else g.to(dtype),
            initial_state=initial_state,
            chunk_size=chunk_size,
            normalize_qk=normalize_k,
        )
    return bounds


class NamedTensors(dict):
    """A dict of named tensors whose entries also read as attributes (out["erank"] or out.erank)."""

    def __getattr__(self, name: str) -> torch.Tensor:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def state_ranks(
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None,
    boundary_states: torch.Tensor | None,
    **kwargs,
) -> NamedTensors:
    """`state_rank_metrics` (same arguments, `kwargs` passed on) as a dict of named tensors, one per RankMetrics
    field ({"erank": [B, T, H], "stable_rank": [B, T, H], ...}; [B, T, n_h, H] with substeps=True)."""
    return NamedTensors(state_rank_metrics(k, v, beta, g, boundary_states, **kwargs)._asdict())
