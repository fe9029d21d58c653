"""Triton chunked (WY/UT) forward of the gated delta product: output, final and chunk-boundary states.

Same contract as `kernels.delta_rule.chunk.chunk_delta_product`: q, k with Hk key heads and v, beta, g with Hv value
heads (value head j reads key head j // (Hv/Hk) in every kernel), dk <= 256, dv <= 512, and packed batches
(`cu_seqlens`: chunks never straddle two sequences; a table maps each global chunk to its sequence). A chunk is 64
tokens, i.e. L = 64 * n_h Householder sub-steps, split into n_h blocks of 64 sub-steps. Kernels:

1. `kkt_kernel` (one program per block and value head, or per key head's group of value heads): A_ij =
   beta_i e^{Gamma_i - Gamma_j} k_i.k_j (j < i) in fp32 and the reciprocal key norms; with `out_aqk` also the
   intra-chunk attention q K^T * decay * mask once a chunk, and on the keys path the row scales and Gamma.
   `_tri_inverse_kernel` (`launch_inverse`) then forms T_aa = (I + A_aa)^-1 of each block from 16x16 diagonal
   inverses merged by 16x16 block products, with zeros above the diagonal.
2. `wu_kernel` (parallel over chunks; the W path only): each block's WY factors W_a = T_aa X_a, U_a = T_aa Y_a,
   X = diag(beta e^{Gamma - Gamma_a}) K, Y = diag(beta) V (Gamma_a: the log-decay at the block start).
3. `state_kernel` (sequential over chunks and their blocks, parallel over sequence * head * value tiles):
   the boundary states S_c and the pseudo-values D_a = U_a - W_a S_a, S_a the state at block a's start; on the
   keys path D_a = T_aa (diag(beta) V_a - diag(c) (K_a S_a)) from the keys and v it loads anyway.
4. `output_kernel` (parallel over chunks): o = scale (e^Gamma q S_c + (q K^T * decay * mask) D); D holds
   each sub-step's true pseudo-value, so one chunk-level formula covers all its blocks.

1-2 live in `triton_prep`, 3 in `triton_state`, 4 in `triton_output`, shared helpers in `kernels.triton_utils`; this
module holds the launch choices (`LaunchConfig`, `default_config`) and the forward: `_Phases` allocates the
intermediates and launches the kernels as prep (1-2), state (3) and output (4).

With normalize_qk=True (default False), q and k are L2-normalised in-kernel through per-row reciprocal norms.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton

from deltalab.kernels.delta_rule.naive import CHUNK_SIZE, check_inputs
from deltalab.kernels.delta_rule.triton_output import output_kernel
from deltalab.kernels.delta_rule.triton_prep import kkt_kernel, launch_inverse, wu_kernel
from deltalab.kernels.delta_rule.triton_state import state_kernel
from deltalab.kernels.triton_utils import BLOCK, interpreting, launch_resident, num_sms, pow2, varlen_tables

WU_WARPS = 4  # warps of the WY kernel (8 were slower at every grid point)
WU_BV = 128  # value tile of the WY kernel (U = T Y tile by tile)
STATE_WARPS = 4  # warps of the sequential kernel (8 slower; with 32-wide tiles on the keys path they gave NaN o)
STATE_RESIDENT_PER_SM = 1  # its pipeline stages are sized for one program a SM
OUT_WARPS = 4  # warps of the output kernel
OUT_STAGES = 1  # the output kernel's key-block loop unpipelined: 2-3 stages miscompiled it (o off by 50-90%)
KKT_WARPS = 4  # warps of the kkt kernel (8 lost)
KKT_BK = 64  # key block of the kkt kernel's products
KKT_STAGES = 2  # its pipeline stages (3 gave o off by 3.5e-2 at n_h = 2 on packed sequences: a miscompile)
INV_WARPS = 1  # the inverse's 16 x 16 tiles in one warp, no cross-warp reductions (`launch_inverse`: 2 for fp32)


@dataclass(frozen=True)
class LaunchConfig:
    """What `default_config` chooses per shape (None fields: its choice); a config passed to `triton_delta_product`
    overrides it, for tests and tuning."""

    state_bv: int | None = None  # value tile of the sequential kernel: 64 where the programs fill the SMs, else 32
    state_stages: int = 2  # its pipeline stages: more while few programs share an SM (latency-bound steps)
    # the keys path: the sequential kernel forms W S = T diag(c) (K S) and U = T diag(beta) V from the keys and v it
    # loads, so no WY kernel runs; wins where its programs outnumber the SMs, loses at one program a SM
    state_keys_ws: bool = False
    out_bk: int = 64  # key block of the output kernel's loop: all of dk <= 128 at once, 64 beyond
    out_bv: int = 128  # its value tile: 256 at dv = 512 with half-precision chunk states (q and Aqk read half as often)
    out_prefetch: bool = False  # the next key block's tiles loaded before this one's products (n_h = 1, dk > 128)
    out_aqk: bool = False  # q K^T * decay * mask from the kkt kernel once a chunk (dk > 128), not once a value tile
    out_evict_first: bool = False  # chunk states loaded evict-first by the output kernel (dk <= 128: one key block)
    # n_h = 1 with out_aqk: an odd chunk's output reads the previous chunk's state and adds that chunk's share through
    # q K'^T from the kkt kernel, so the sequential kernel stores only every other state when nobody returns them
    out_pair: bool = False


MAX_K, MAX_V = 256, 512  # head dims the Triton path takes (dispatch falls back beyond)
MAX_NH = 3  # Householder steps a token: the output kernel keeps one q K^T accumulator per step


def default_config(B: int, H: int, V: int, n_h: int = 1, K: int = 128, half_states: bool = True) -> LaunchConfig:
    """The launch choices for a shape; B counts sequences (of a packed batch too), H value heads; half_states: the
    chunk states the output kernel reads are in the inputs' half dtype (no boundary states returned), not fp32.

    Never 16-wide value tiles with dk = 128 (nor 32 with dk = 256 unsplit): the compiled state kernel with 16-wide
    tiles faulted (n_h = 3) or returned wrong states (n_h = 1) at B = 8, T >= 1024, while the interpreter and
    T = 300 agreed with the reference; see tests/kernels/test_triton_chunk.py.
    """
    n_sm = num_sms()
    bv = 32
    # 64-wide value tiles for dk <= 128 and n_h <= 2 once sequences * value heads give about a program per SM
    # (W and K are re-read per tile)
    if K <= 128 and B * H * triton.cdiv(V, 64) >= (0.9 if n_h <= 2 else 2.0) * n_sm:
        bv = 64
    # q K^T from the kkt kernel where the output kernel would form it once per value tile and n_h times a key-block
    # loop (dk > 128); at dk = 128 the kkt kernel's extra cost outweighs the output kernel's gain
    aqk = K > 128
    programs = B * H * triton.cdiv(V, bv)
    # sequential-kernel stages: three while the programs number at most 8 a SM, four where at most half the SMs
    # have one and dk <= 128 (a stage's tiles take ~40 KB), two on the keys path
    stages = 3 if programs <= 8 * n_sm else 2
    if K <= 128 and 2 * programs <= n_sm:
        stages = 4
    # the keys path where the programs outnumber the SMs (at one program a SM the step's latency binds, and there
    # it lost 0.80-0.91x)
    keys_ws = programs > n_sm
    if keys_ws:
        stages = 2
    # dk <= 128: the output kernel takes dk in one key block (no loop); more key blocks load one ahead at n_h = 1
    # (with n_h = 3 q K^T accumulators live the prefetch lost 2.6x)
    out_bk = pow2(K) if K <= 128 else LaunchConfig.out_bk
    # dv 512: two 256-wide output value tiles, where the chunk states are half precision (with fp32 ones it lost)
    out_bv = 256 if V > 256 and half_states else LaunchConfig.out_bv
    return LaunchConfig(
        state_bv=min(bv, pow2(V)), state_stages=stages, state_keys_ws=keys_ws, out_bk=out_bk, out_bv=out_bv,
        out_prefetch=K > out_bk and n_h == 1, out_aqk=aqk, out_evict_first=K <= 128, out_pair=aqk and n_h == 1,
    )  # fmt: skip


def unsupported_reason(q: torch.Tensor, v: torch.Tensor, chunk_size: int = CHUNK_SIZE) -> str | None:
    """Why the Triton path would not take these (valid) inputs, or None when it does."""
    K, V, n_h = q.shape[-1], v.shape[-1], v.shape[2] if v.dim() == 5 else 1
    if n_h > MAX_NH:
        return f"n_h={n_h} (the Triton forward takes n_h <= {MAX_NH})"
    if chunk_size != CHUNK_SIZE:
        return f"chunk_size={chunk_size} (the Triton forward uses {CHUNK_SIZE})"
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {q.dtype} (bf16, fp16 or fp32)"
    if K > MAX_K or V > MAX_V:
        return f"dk={K}, dv={V} (the Triton forward takes dk <= {MAX_K}, dv <= {MAX_V})"
    if not (q.is_cuda or interpreting()):
        return "tensors not on CUDA"
    return None


def _check(q, k, v, beta, g, initial_state, chunk_size, cu_seqlens) -> int:
    """The shared contract (kernels.delta_rule.naive.check_inputs), then what this path takes; returns N sequences."""
    N = check_inputs(q, k, v, beta, g, initial_state, cu_seqlens)[0]
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"the Triton forward uses chunk_size={CHUNK_SIZE}; use chunk_delta_product for {chunk_size}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"q dtype {q.dtype} unsupported: pass bf16, fp16 or fp32 (chunk_delta_product for fp64)")
    why = unsupported_reason(q, v, chunk_size)
    if why is not None:
        raise ValueError(f"the Triton forward does not take {why}; use chunk_delta_product")
    return N


def triton_delta_product(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
    normalize_qk: bool = False,
    output_final_state: bool = True,
    output_boundary_states: bool = True,
    config: LaunchConfig | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Return (o [B,T,Hv,V] in q's dtype, final states [N,Hv,K,V] fp32, boundary states [B,NB,Hv,K,V] fp32).

    Forward only; shapes and the packed (cu_seqlens) boundary layout as `kernels.delta_rule.naive`. Without cu_seqlens
    NB = ceil(T/64) + 1: boundary c is the state before token 64c, the last is the final state. q and k
    keep their Hk heads (value head j reads key head j // (Hv/Hk) in the kernels). bf16/fp16 inputs run the
    matrix products in half precision with fp32 accumulation.
    """
    N = _check(q, k, v, beta, g, initial_state, chunk_size, cu_seqlens)
    B, T, HK, K = q.shape
    n_h, HV, V = k.shape[2], v.shape[3], v.shape[-1]
    dtype = q.dtype
    q, k, v = q.contiguous(), k.to(dtype).contiguous(), v.to(dtype).contiguous()
    beta = beta.contiguous()
    g = g.contiguous() if g is not None else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    scale = K**-0.5 if scale is None else float(scale)
    dev = q.device
    varlen = cu_seqlens is not None
    if varlen:
        cu, cidx, coff, order, NCT = varlen_tables(cu_seqlens, dev)
    else:
        cu = cidx = coff = order = None
        NCT = B * triton.cdiv(T, CHUNK_SIZE)
    NBND = NCT + N  # boundary rows: each sequence's chunk starts and its final state
    interp = interpreting()
    F32 = interp or dtype == torch.float32  # fp32 operands in tl.dot (the interpreter's bf16 dot is wrong)
    PREC = "ieee" if dtype == torch.float32 else "tf32"
    d = default_config(N, HV, V, n_h, K, half_states=not output_boundary_states and dtype != torch.float32)
    cfg = replace(config, state_bv=config.state_bv or d.state_bv) if config is not None else d
    if cfg.state_bv < 32 and V > 16 and not interp:
        raise ValueError(f"state_bv={cfg.state_bv} miscompiles on CUDA (see default_config); use 32, 64 or 128")
    # states nobody returns are kept in the inputs' half dtype: the output kernel rounds them to it for its product
    # anyway, so o is bit-identical and their traffic halves (fp32 states dominate it at dk, dv = 256, 512)
    bnd_dtype = torch.float32 if output_boundary_states or F32 else dtype
    bnd = torch.empty(NBND, HV, K, V, dtype=bnd_dtype, device=dev)
    ht = torch.empty(N, HV, K, V, dtype=torch.float32, device=dev) if output_final_state else None
    o = torch.empty(B, T, HV, V, dtype=dtype, device=dev)
    fixed = dict(cfg=cfg, scale=scale, normalize_qk=normalize_qk, F32=F32, PREC=PREC,
                 boundaries_returned=output_boundary_states)
    run = _Phases(q, k, v, beta, g, h0, o, ht, bnd, (T, cu, cidx, coff, order, NCT, N), **fixed)
    run.prep()
    run.state()
    run.output()
    bnd_out = bnd.view(1 if varlen else B, -1, HV, K, V) if output_boundary_states else None
    return o, ht, bnd_out


class _Phases:
    """The forward's kernels for one batch in three phases: prep (A, T = (I + A)^-1,
    the WY factors and the intra-chunk attention), the sequential state kernel, and the output kernel. Allocates the
    intermediates; writes o, ht and bnd, which the caller gives."""

    def __init__(self, q, k, v, beta, g, h0, o, ht, bnd, tables: tuple, *, cfg: LaunchConfig, scale: float,
                 normalize_qk: bool, F32: bool, PREC: str, boundaries_returned: bool = True) -> None:
        T, cu, cidx, coff, order, NCT, N = tables
        HK, K = q.shape[2], q.shape[3]
        n_h, HV, V = k.shape[2], v.shape[3], v.shape[-1]
        self.q, self.k, self.v, self.beta, self.g, self.h0, self.o, self.ht, self.bnd = q, k, v, beta, g, h0, o, ht, bnd
        self.cfg, self.scale, self.norm, self.PREC = cfg, scale, normalize_qk, PREC
        self.N, self.NCT, self.V, self.K, self.HV, self.n_h = N, NCT, V, K, HV, n_h
        self.order = order
        self.common = dict(HK=HK, HV=HV, NH=n_h, K=K, IS_VARLEN=cu is not None, F32=F32, PREC=PREC)
        self.seq_args = (T, cu, cidx, coff, NCT)
        self.BK, self.BVF = pow2(K), pow2(V)
        self.BV = min(cfg.state_bv, self.BVF)
        self.keys_ws = bool(cfg.state_keys_ws)  # (the kkt kernel then writes the row scales and Gamma; no WY kernel)
        self.aqk = bool(cfg.out_aqk)  # the intra-chunk attention from the kkt kernel
        self.pair = bool(cfg.out_pair) and n_h == 1 and self.aqk
        self.bnd_every = 2 if self.pair and not boundaries_returned else 1  # (the output kernel reads even ones only)
        dtype, dev, f32 = q.dtype, q.device, torch.float32
        rows = NCT * n_h * BLOCK  # sub-step rows per value head
        self.Ti = torch.empty(HV, rows, BLOCK, dtype=dtype, device=dev)
        self.rstd = torch.empty(HV, rows, dtype=f32, device=dev)
        self.W = torch.empty(HV, 0 if self.keys_ws else rows, K, dtype=dtype, device=dev)  # keys path: no W
        self.wsc = torch.empty(HV, rows if self.keys_ws else 0, dtype=f32, device=dev)
        self.U = torch.empty(HV, 0 if self.keys_ws else rows, V, dtype=dtype, device=dev)  # keys path: no U
        self.D = torch.empty(HV, rows, V, dtype=dtype, device=dev)
        self.Aqk = torch.empty(HV, NCT * BLOCK, n_h * BLOCK, dtype=dtype, device=dev) if self.aqk else None
        self.Aqp = torch.empty(HV, NCT * BLOCK, BLOCK, dtype=dtype, device=dev) if self.pair else None  # odd chunks
        self.gcum = torch.empty(HV, rows, dtype=f32, device=dev)

    def prep(self) -> None:
        """Key norms, A, T = (I + A)^-1 per 64-row block, Aqk, then W and U (W path) or the row scales (keys path)."""
        NCT = self.NCT
        if NCT == 0:
            return
        q, k, v, beta, g = self.q, self.k, self.v, self.beta, self.g
        n_jobs = self.HV * NCT * self.n_h
        A = torch.empty(self.HV, NCT * self.n_h * BLOCK, BLOCK, dtype=torch.float32, device=q.device)  # fp32: exact T
        kg = _kkt_heads(self.common["HK"], self.HV)
        kkt_kernel[(n_jobs // kg,)](
            q, k, beta, g, A, self.Aqk, self.Aqp, self.rstd, self.gcum, self.wsc, *self.seq_args,
            BK=self.BK, BKC=min(pow2(KKT_BK), self.BK), USE_G=g is not None, NORM=self.norm,
            STORE_AQK=self.aqk, STORE_SCALES=self.keys_ws, PAIR=self.pair, KG=kg, num_warps=KKT_WARPS,
            num_stages=KKT_STAGES, **self.common,
        )  # fmt: skip
        launch_inverse(A, self.Ti, n_jobs, INV_WARPS, self.PREC)
        if not self.keys_ws:
            wu_kernel[(NCT, self.HV)](
                k, v, beta, g, self.Ti, self.W, self.U, self.gcum, self.rstd, *self.seq_args,
                V=self.V, BK=self.BK, BV=min(WU_BV, self.BVF), USE_G=g is not None, NORM=self.norm,
                num_warps=WU_WARPS, **self.common,
            )  # fmt: skip

    def state(self) -> None:
        """The sequential kernel: boundary states, D and the final state."""
        BK, BV = self.BK, self.BV
        BKH = BK // 2 if BK > 128 else BK
        consts = dict(
            V=self.V, BKH=BKH, SPLIT=BKH < BK, BV=BV, HAS_H0=self.h0 is not None, STORE_FINAL=self.ht is not None,
            STORE_BND=self.bnd.shape[0] > 0, KEYS_WS=self.keys_ws, BND_EVERY=self.bnd_every, USE_G=self.g is not None,
            **self.common,
        )  # fmt: skip
        # one block's T, K and v tiles per pipeline stage on the keys path, its W, K and U tiles on the W path
        smem = 64 * ((64 if self.keys_ws else BK) + BK + BV) * self.q.element_size()
        T, cu, _, coff, NCT = self.seq_args
        args = (self.k, self.v, self.beta, self.W, self.U, self.D, self.gcum, self.rstd, self.Ti, self.wsc, self.bnd,
                self.ht, self.h0, T, cu, coff, self.order, NCT)  # fmt: skip
        launch_resident(state_kernel, (triton.cdiv(self.V, BV), self.N * self.HV), args, consts, smem,
                        stages=self.cfg.state_stages, warps=STATE_WARPS, resident_per_sm=STATE_RESIDENT_PER_SM)

    def output(self) -> None:
        """o = scale (e^G q S_c + A D) per chunk."""
        if self.NCT == 0:
            return
        cfg = self.cfg
        obv = min(cfg.out_bv, self.BVF)
        output_kernel[(triton.cdiv(self.V, obv), self.NCT, self.HV)](
            self.q, self.k, self.D, self.Aqk, self.Aqp, self.gcum, self.rstd, self.bnd, self.o, *self.seq_args,
            self.scale,
            V=self.V, BK=min(pow2(cfg.out_bk), self.BK), BV=obv, NORM=self.norm, num_warps=OUT_WARPS,
            num_stages=OUT_STAGES, PREFETCH=cfg.out_prefetch, AQK=self.aqk, EVICT=cfg.out_evict_first,
            PAIR=self.pair, USE_G=self.g is not None,
            **self.common,
        )  # fmt: skip


def _kkt_heads(HK: int, HV: int) -> int:
    """Value heads a kkt program serves: the whole group of a key head where Hv / Hk is a power of two (the kernel
    takes them as one [64, KG] tile; K K^T and q K^T are formed once for them), else one."""
    group = HV // HK
    return group if group > 1 and group & (group - 1) == 0 else 1
