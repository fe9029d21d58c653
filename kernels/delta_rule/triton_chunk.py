"""Triton chunked (WY/UT) forward of the gated delta product: output, final and chunk-boundary states.

Same contract as `kernels.delta_rule.chunk.chunk_delta_product`: q, k with Hk key heads and v, beta, g with Hv value
heads (value head j reads key head j // (Hv/Hk) in every kernel), dk <= 256, dv <= 512, and packed batches
(`cu_seqlens`: chunks never straddle two sequences; a table maps each global chunk to its sequence). A chunk is 64
tokens, i.e. L = 64 * n_h Householder sub-steps, split into n_h blocks of 64 sub-steps. Kernels:

1. `_tri_kernel` (persistent, parallel over blocks): T_aa = (I + A_aa)^-1 of each 64-sub-step block,
   A_ij = beta_i e^{Gamma_i - Gamma_j} k_i.k_j (j < i), from four 16x16 forward substitutions merged
   by block rows; also the reciprocal key norms. With `LaunchConfig.tri_split` (the default; any n_h) two
   kernels instead, as fla splits it: `_kkt_kernel` (A in fp32, one program per block and value head) and
   `_tri_inverse_kernel` (16x16 diagonal inverses merged by 16x16 block products), writing the same T.
   `_kkt_kernel` also forms the intra-chunk attention q K^T * decay * mask once a chunk (`out_aqk`), and with
   `state_from_v` on the keys path the row scales and Gamma, so that `_wu_kernel` is not launched.
2. `_wu_kernel` (parallel over chunks): each block's WY factors W_a = T_aa X_a, U_a = T_aa Y_a,
   X = diag(beta e^{Gamma - Gamma_a}) K, Y = diag(beta) V (Gamma_a: the log-decay at the block start).
3. `_state_kernel` (sequential over chunks and their blocks, parallel over sequence * head * value tiles):
   the boundary states S_c and the pseudo-values D_a = U_a - W_a S_a, S_a the state at block a's start.
   (An earlier version solved the whole 64 n_h-sub-step chunk as one WY system, so that the blocks of a
   chunk shared S_c; its cross-block substitution made `_wu_kernel` 2.7x fla's on an H100 at n_h = 3.)
4. `_output_kernel` (parallel over chunks): o = scale (e^Gamma q S_c + (q K^T * decay * mask) D); D holds
   each sub-step's true pseudo-value, so one chunk-level formula covers all its blocks.

1-2 live in `triton_prep`, 3 in `triton_state`, 4 in `triton_output`, shared helpers in `triton_common`; this module
holds the launch choices (`LaunchConfig`, `default_config`) and the forward: `_Phases` allocates the intermediates and
launches the kernels as prep (1-2), state (3) and output (4).

With normalize_qk=True (default False), q and k are L2-normalised in-kernel through per-row reciprocal norms.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
from triton.runtime.errors import OutOfResources

try:  # host-side tensor descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: pointer stores only
    TensorDescriptor = None

from deltalab.kernels.delta_rule.naive import CHUNK_SIZE, check_inputs
from deltalab.kernels.delta_rule.triton_output import _output_kernel
from deltalab.kernels.delta_rule.triton_prep import _kkt_kernel, _tri_kernel, _wu_kernel, launch_inverse
from deltalab.kernels.delta_rule.triton_state import _state_kernel
from deltalab.kernels.triton_utils import BLOCK, _interpreting, _num_sms, _pow2


@dataclass(frozen=True)
class LaunchConfig:
    """Launch choices; None fields pick the default for the shape (see `default_config`).

    Defaults from `python -m benchmarks.fwd_tune` on an H100 (B=8, T=8192): wu_warps 4 beat 8 at every point (4.33 vs
    4.54 ms at n_h=3); 4 tri or 8 state warps, or 64-wide output tiles, were slower.
    """

    state_bv: int | None = None  # value tile of the sequential kernel
    tri_warps: int = 2
    wu_warps: int = 4
    wu_bv: int = 128  # value tile of the WY kernel (U = T Y tile by tile)
    state_warps: int = 4
    state_stages: int = 2
    out_warps: int = 4
    out_bv: int = 128
    out_bk: int = 64  # key block of the output kernel's loop (the whole of dk at once: 1.7x fla's time at dk 256)
    # pipeline stages of the output kernel's key-block loop. Pipelined, that loop miscompiles (Triton 3.9, H200,
    # scripts/lean_check.py): at n_h = 1 with bf16 boundary states, 2 or 3 stages gave o off by 50-90% (fp32
    # states too at 2 stages, dk/dv = 256/512); 1 stage, or one key block, is bit-identical across both dtypes
    out_stages: int = 1
    # the output kernel loads the next key block's tiles before this block's products (a pipeline by hand, in
    # registers, not the compiler's); default_config turns it on where dk spans several key blocks
    out_prefetch: bool = False
    # the kkt kernel (the WY kernel without tri_split) forms the intra-chunk attention q K^T * decay * mask once a chunk
    # (Aqk, in the inputs' dtype, as the output's product rounds it anyway) and the output kernel reads it: q K^T is
    # not formed once a value tile, and the key-block loop holds only q S_c (no [64, 64] accumulator a WY block)
    out_aqk: bool = False
    # L2 eviction hints for the traffic read back only after the kernel that writes it ends: the sequential kernel
    # stores the chunk states and D evict-first (its later steps' keys stay in L2), the output kernel loads the chunk
    # states evict-first (q and K, which the other value tiles read again, stay)
    state_evict_first: bool = False
    out_evict_first: bool = False
    # n_h = 1 with out_aqk and tri_split: an odd chunk's output program reads the previous chunk's state and adds that
    # chunk's share through q K'^T from the kkt kernel (Aqp), so the sequential kernel stores only even chunks' states
    # when nobody returns them. A first form (its own key loop in the output kernel) lost: the state kernel gained
    # 0.03-0.10 ms, the output kernel lost 0.13 (H200, kernels/NOTES.md); this one adds one A D product there and
    # won (GDN default 1.03-1.06x): default_config's wherever out_aqk is at n_h = 1
    out_pair: bool = False
    # the sequential kernel forms W S as T (diag(c) (K S)) from the keys it loads for the state update and the
    # block's 64 x 64 T, instead of reading W (64 x dk a block; the WY kernel then writes no W): fewer bytes a step
    # (dk 256: 32 + 8 KB against 64 KB), one more 64-deep product in the step's chain; default_config's choice
    state_keys_ws: bool = False
    # the sequential kernel forms U = T diag(beta) V from v itself instead of reading U, so the WY kernel writes no U
    # (dv x 2 bytes a sub-step written and read back); with state_keys_ws, D = T (diag(beta) V - diag(c) (K S)) is
    # one product with T, as many as before, and the WY kernel is not launched (the kkt kernel writes the row scales)
    state_from_v: bool = False
    # the sequential kernel stores the chunk states and the final state through tensor descriptors (TMA on Hopper)
    # instead of pointer tensors held in registers across its loop (the spills it was built against, 848 -> 320 bytes
    # a thread at GDN default, were an offline compile's without the pointer alignment a launch gives; with it, ptxas
    # sm_90 (Triton 3.6) spills 8 -> 8 bytes, and none either way with state_t_full). Taken where dk is a power
    # of two and dv rows are 16-byte multiples, on sm_90+ or in the interpreter (`_Phases.tma`). Off: H200, o + final
    # against the pointer stores (fourteenth session), 0.56-0.59x at B = 1 (GDN default state kernel 0.941 -> 2.054
    # ms), 0.99-1.02x at 8 x 4096 and packed; o, the final and the chunk states bit-identical
    state_tma: bool = False
    # registers a thread of the sequential kernel (Triton's maxnreg; None: the compiler's choice, 255 at dk 256): 168
    # lets three 4-warp programs share an SM instead of two (GDN default 8 x 4096: 768 programs in 2 waves, not 3).
    # Lost on an H200 (fourteenth session, o + final): GDN default 0.76-0.83x (state kernel 0.717 -> 1.051 ms at
    # 8 x 4096), with state_tma 0.56-0.82x, Qwen3-Next 0.94x, DeltaProduct n_h = 2 0.80x
    state_maxnreg: int | None = None
    # the sequential kernel holds the state transposed, S^T [value tile, dk], so that each product of the step takes
    # its left operand from registers (S^T K^T, X^T T^T, D^T K) and nothing computed is stored to shared memory
    # within the step's chain (`_state_block_t`); not with fuse_output or state_tma. Lost on an H200 (fifteenth session,
    # with state_t_full, o + final): GDN default 0.73x at 1x32768 (64 wide 0.45x, at 8 warps 0.60x), 0.86-0.89x at
    # 8x4096, packed 0.86x (64 wide 1.03x against the masked T, i.e. below state_t_full alone); Qwen3-Next 0.98-1.00x;
    # DeltaProduct n_h = 2 0.89-0.90x (64 wide 0.96-1.06x)
    state_trans: bool = False
    # the inverse kernel writes zeros above T's diagonal, so the sequential kernel loads T without a mask, which is
    # what lets Triton pipeline that load (cp.async a stage ahead): a mask that varies along a row is not (tri_split;
    # the one-kernel `_tri_kernel` writes the zeros anyway). H200, o + final against the masked load (fifteenth
    # session, scripts/config_ab.py, o bit-identical): GDN default 8x4096 1.10x (state kernel 0.718 -> 0.613 ms),
    # packed 1.09x; Qwen3-Next 1.02-1.03x; DeltaProduct n_h = 2 1.11-1.12x; B = 1 (the W path reads no T) 1.00x
    state_t_full: bool = True
    # n_h > 1: the sequential kernel takes a block's starting log decay G from the previous block's G' (the same row of
    # gcum, carried in the loop; 0 at a chunk's first block) instead of loading it: that masked scalar load stayed
    # synchronous inside the loop (aligned TTGIR, sm_90, Triton 3.6, n_h = 3), while G' is prefetched a stage ahead.
    # H200 (sixteenth session, scripts/grid_ab.py, o bit-identical): state kernel 0.406 -> 0.396 ms at B=1 T=8192 H=8
    # n_h=2, 0.607 -> 0.590 at n_h=3, 0.812 -> 0.803 at B=8 n_h=3 (1.00-1.02x in all)
    state_g0_ahead: bool = True
    # the WY kernel loads T unmasked too (the inverse kernel then writes zeros above T's diagonal wherever the WY kernel
    # runs): its masked [64, 64] load is one 2-byte load an element, the unmasked one vectorises. H200 (sixteenth
    # session, scripts/config_ab.py, o bit-identical): Qwen3-Next 1x32768 WY kernel 0.351 -> 0.327 ms (1.01x), GDN
    # default 1x32768 1.00x
    wu_t_full: bool = True
    tri_programs_per_sm: int = 8
    fuse_output: bool | None = None  # the state kernel writes o (no output kernel); None: default_config's
    # programs of the sequential kernel that share an SM's shared memory when its pipeline stages are sized; None:
    # all of them, ceil(programs / SMs), which gives packed batches of many short documents one stage (experiment)
    resident_per_sm: int | None = None
    # T = (I + A)^-1 by two kernels, as fla splits it: `_kkt_kernel` (A, fp32, one program per block and value head,
    # key blocks of kkt_bk) then `_tri_inverse_kernel` (16 x 16 diagonal inverses merged by block products), instead
    # of the persistent `_tri_kernel`; every n_h. H100 (scripts/tri_split_ab.py, inverse at 1 warp): GDN default
    # 1x32768 kkt 0.060 + inverse 0.024 ms against _tri_kernel's 0.178, Qwen3-Next 0.202 + 0.118 against 0.709
    tri_split: bool = True
    kkt_warps: int = 4
    kkt_bk: int = 64
    kkt_stages: int = 2
    # grouped heads (Hv / Hk a power of two): one kkt program serves the value heads of a key head, forming K K^T and
    # q K^T once for them (they differ in beta and gates only) instead of once per value head. H200, Qwen3-Next (two
    # value heads a key head), o + final against one head a program (fifteenth session, scripts/config_ab.py, o
    # bit-identical): 1.01x at 1x32768, 8x4096 and packed (kkt kernel 0.169 -> 0.148, 0.172 -> 0.156, 0.174 -> 0.162 ms)
    kkt_group: bool = True
    inv_warps: int = 1  # the inverse's 16 x 16 tiles in one warp: no cross-warp reductions (2 warps: 0.095 / 0.505 ms
    # at the shapes above, 4 warps 0.18 / 0.99); fp32 inputs take 2 (ptxas sm_90: 824 bytes of spills at 1)


MAX_K, MAX_V = 256, 512  # head dims the Triton path takes (dispatch falls back beyond)
MAX_NH = 3  # Householder steps a token: the output kernel keeps one q K^T accumulator per step


def default_config(B: int, H: int, V: int, n_h: int = 1, K: int = 128, half_states: bool = True) -> LaunchConfig:
    """Value tiles of the sequential kernel: 32, or 64 for dk <= 128 and n_h <= 2 once sequences * value
    heads give about a program per SM (W and K are re-read per tile). The output kernel stays separate: fusing
    it into the sequential kernel measured 0.9-1.1x at the real-model shapes on an H100 (kernels/NOTES.md).
    Never 16 with dk = 128 (nor 32 with dk = 256 unsplit): on an H100 (Triton 3.6) the compiled state kernel
    with 16-wide tiles faulted (n_h = 3) or returned wrong states (n_h = 1) at B = 8, T >= 1024, while the
    interpreter and T = 300 agreed with the reference; see tests/kernels/test_triton_chunk.py.
    B counts sequences (of a packed batch too), H value heads; half_states: the chunk states the output kernel reads
    are in the inputs' half dtype (no boundary states returned), not fp32.
    """
    n_sm = _num_sms()
    bv = 32
    if K <= 128 and B * H * triton.cdiv(V, 64) >= (0.9 if n_h <= 2 else 2.0) * n_sm:
        bv = 64
    # Pipeline stages of the sequential kernel sized for one program a SM: three while the programs number at most
    # 8 a SM, else two. H200, o + final: GDN default (dk, dv = 256, 512) 1x32768 1.885 -> 1.816 ms, 8x4096 1.793 ->
    # 1.582, packed (3,072 short programs, two stages) 2.492 -> 2.244; Qwen3-Next (16/32 heads of 128) 1x32768 2.511
    # -> 2.238, 8x4096 2.189 -> 2.050, packed 2.264 -> 2.135 (benchmarks.kernels --sweep, sixth session)
    # dk <= 128 with n_h > 1 took LaunchConfig's plain defaults (two stages, 64-wide output key blocks) until the
    # sixteenth session: with the kernels as they are now the rules below won at every grid point tried (H200,
    # scripts/grid_ab.py, ours with fp32 boundary states, H = 8, dk = dv = 128, gate off unless said): B=1 T=8192
    # n_h=2 0.568 -> 0.484 ms, n_h=3 0.827 -> 0.676; B=8 T=8192 n_h=2 1.690 -> 1.498 (W path, three stages; 1.425 on
    # the keys path, two), n_h=3 gate on 2.508 -> 1.984 (keys path, U from v)
    # q K^T from the kkt kernel (out_aqk) at dk > 128, where the output kernel would form it once per value tile and
    # n_h times a key-block loop: H100, o + final against forming it there (eleventh session, scripts/config_ab.py):
    # DeltaProduct n_h = 3 8x4096 1.10x, 1x32768 1.07x (output kernel 1.223 -> 0.676 ms, kkt 0.164 -> 0.345);
    # GDN default 1.02x / 1.01x. At dk = 128 the kkt kernel's cost about doubles and outweighs the output kernel's gain:
    # Qwen3-Next 0.92-0.93x (kkt 0.200 -> 0.435 ms); grid points H = 8, n_h = 2, 3 0.97-1.00x (scripts/grid_ab.py)
    aqk = K > 128
    programs = B * H * triton.cdiv(V, bv)
    stages = 3 if programs <= 8 * n_sm else 2
    # Four where at most half the SMs have a program and dk <= 128 (a stage's tiles take ~40 KB): H200, ours with fp32
    # boundary states, H = 8, dk = dv = 128, 32 programs (sixteenth session, scripts/grid_ab.py, o bit-identical): B=1
    # T=8192 n_h=2 state kernel 0.333 -> 0.326 ms, n_h=3 0.460 -> 0.436 (1.01x / 1.04x in all)
    if K <= 128 and 2 * programs <= n_sm:
        stages = 4
    # More programs than SMs: W S from the keys and T (state_keys_ws), at two stages. H100, o + final against the
    # W path (tenth session, scripts/config_ab.py): GDN default 8x4096 1.03x, packed 1.12x; Qwen3-Next 8x4096 1.06x,
    # packed 1.08x; DeltaProduct n_h = 2 / 3 8x4096 1.02x / 1.04x, packed 1.17x / 1.21x; at three stages 0.85-0.93x
    # where two won, and at B = 1 (one program a SM, the step's latency binds) 0.80-0.84x at either
    keys_ws = programs > n_sm
    if keys_ws:
        stages = 2
    # On the keys path U from v (state_from_v): D = T (diag(beta) V - diag(c) (K S)) in the sequential kernel, which
    # holds its time, and no WY kernel at all. H100, o + final against reading U (twelfth session,
    # scripts/config_ab.py): GDN default 8x4096 1.11x, Qwen3-Next 8x4096 1.15x, DeltaProduct n_h = 3 8x4096 1.13x.
    # At B = 1 (the W path) not: the keys path with it measured 0.90-0.91x at 1x32768, and the W path with it
    # miscompiles at 32-wide value tiles and two or more stages (scripts/fromv_check.py), so such tiles run there at
    # one stage (`_Phases.state`)
    # dk <= 128: the output kernel takes dk in one key block (no loop: Qwen3-Next 2.511 -> 2.452 ms at 1x32768);
    # more key blocks load one ahead at n_h = 1 (out_prefetch: GDN default 1x32768 output kernel 0.669 -> 0.561 ms,
    # H100; at n_h = 3, with three q K^T accumulators live, 1.225 -> 3.174 ms at 8x4096, so not there)
    out_bk = _pow2(K) if K <= 128 else LaunchConfig.out_bk
    # The output kernel loads the chunk states evict-first at dk <= 128 (one key block). H200, o + final (thirteenth
    # session, scripts/config_ab.py): Qwen3-Next output kernel 0.498 -> 0.480 ms at 1x32768, 0.495 -> 0.476 at
    # 8x4096, 0.502 -> 0.487 packed (1.01-1.02x in all); at GDN default (four key blocks) 0.340 -> 0.353, so not
    # there. Evict-first stores in the state kernel moved nothing (+-1%), so they stay off
    # Output chunk pairs wherever q K^T comes from the kkt kernel (out_pair, n_h = 1): the sequential kernel stores
    # every other state when nobody returns them. H200, o + final against the default (fourteenth session,
    # scripts/config_ab.py): GDN default 1x32768 1.06x (state kernel 1.051 -> 0.939 ms, output 0.341 -> 0.313, kkt
    # 0.119 -> 0.141), 8x4096 1.04x, packed 1.03x; the kkt kernel at 8 warps lost it (0.95-1.01x)
    # dv 512: the output kernel in two 256-wide value tiles (q, Aqk and the key loop's loads shared by twice the
    # columns). H200, o + final against 128 (fourteenth session, scripts/config_ab.py, o bit-identical at every real
    # row): GDN default 8x4096 output kernel 0.312 -> 0.293 ms (1.02x), DeltaProduct n_h = 2 packed 1.07x. Not with
    # fp32 chunk states (boundary states returned): GDN default 8x4096 1.556 -> 2.193 ms there
    out_bv = 256 if V > 256 and half_states else LaunchConfig.out_bv
    return LaunchConfig(
        state_bv=min(bv, _pow2(V)), fuse_output=False, resident_per_sm=1, state_stages=stages, out_bk=out_bk,
        out_bv=out_bv,
        state_keys_ws=keys_ws, state_from_v=keys_ws, out_prefetch=K > out_bk and n_h == 1, out_aqk=aqk,
        out_evict_first=K <= 128, out_pair=aqk and n_h == 1,
    )


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
    if not (q.is_cuda or _interpreting()):
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


_VARLEN_CACHE: list[tuple[torch.Tensor, int, torch.device, tuple]] = []  # most recent first
_VARLEN_CACHE_SIZE = 8


def _varlen_tables(cu_seqlens: torch.Tensor, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """(cu int32, sequence of each global chunk, first global chunk of each sequence [N+1], sequences
    longest first, total chunks). Building them syncs with the GPU (the grids need the chunk count), so the
    tables of the last few cu_seqlens tensors are kept, keyed by the tensor itself (held, so its identity
    cannot pass to another) and its in-place version: every layer of a packed forward reuses them."""
    for i, (t, version, d, tables) in enumerate(_VARLEN_CACHE):
        if t is cu_seqlens and version == cu_seqlens._version and d == dev:
            _VARLEN_CACHE.insert(0, _VARLEN_CACHE.pop(i))
            return tables
    cu = cu_seqlens.to(device=dev, dtype=torch.int32)
    n_chunks = (cu.diff() + CHUNK_SIZE - 1) // CHUNK_SIZE
    coff = torch.nn.functional.pad(n_chunks.cumsum(0), (1, 0)).to(torch.int32)
    nct = int(coff[-1])  # one host sync: the grids need it
    seq = torch.arange(n_chunks.numel(), device=dev, dtype=torch.int32)
    cidx = seq.repeat_interleave(n_chunks, output_size=nct)
    order = torch.argsort(n_chunks, descending=True, stable=True).to(torch.int32)
    tables = (cu, cidx, coff, order, nct)
    _VARLEN_CACHE.insert(0, (cu_seqlens, cu_seqlens._version, dev, tables))
    del _VARLEN_CACHE[_VARLEN_CACHE_SIZE:]
    return tables


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
        cu, cidx, coff, order, NCT = _varlen_tables(cu_seqlens, dev)
    else:
        cu = cidx = coff = order = None
        NCT = B * triton.cdiv(T, CHUNK_SIZE)
    NBND = NCT + N  # boundary rows: each sequence's chunk starts and its final state
    interp = _interpreting()
    F32 = interp or dtype == torch.float32  # fp32 operands in tl.dot (the interpreter's bf16 dot is wrong)
    PREC = "ieee" if dtype == torch.float32 else "tf32"
    d = default_config(N, HV, V, n_h, K, half_states=not output_boundary_states and dtype != torch.float32)
    given = config or d
    cfg = replace(
        given,
        state_bv=given.state_bv or d.state_bv,
        fuse_output=d.fuse_output if given.fuse_output is None else given.fuse_output,
    )
    if cfg.state_bv < 32 and V > 16 and not interp:
        raise ValueError(f"state_bv={cfg.state_bv} miscompiles on CUDA (see default_config); use 32, 64 or 128")
    fuse = bool(cfg.fuse_output)
    store_bnd = output_boundary_states or not fuse  # the output kernel reads them
    # states nobody returns are kept in the inputs' half dtype: the output kernel rounds them to it for its product
    # anyway, so o is bit-identical and their traffic halves (fp32 states dominate it at dk, dv = 256, 512)
    bnd_dtype = torch.float32 if output_boundary_states or F32 else dtype
    bnd = torch.empty(NBND if store_bnd else 0, HV, K, V, dtype=bnd_dtype, device=dev)
    ht = torch.empty(N, HV, K, V, dtype=torch.float32, device=dev) if output_final_state else None
    o = torch.empty(B, T, HV, V, dtype=dtype, device=dev)
    fixed = dict(cfg=cfg, scale=scale, normalize_qk=normalize_qk, F32=F32, PREC=PREC, interp=interp,
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
                 normalize_qk: bool, F32: bool, PREC: str, interp: bool, boundaries_returned: bool = True) -> None:
        T, cu, cidx, coff, order, NCT, N = tables
        HK, K = q.shape[2], q.shape[3]
        n_h, HV, V = k.shape[2], v.shape[3], v.shape[-1]
        self.q, self.k, self.v, self.beta, self.g, self.h0, self.o, self.ht, self.bnd = q, k, v, beta, g, h0, o, ht, bnd
        self.cfg, self.scale, self.norm, self.interp, self.PREC = cfg, scale, normalize_qk, interp, PREC
        self.N, self.NCT, self.V, self.K, self.HV, self.n_h = N, NCT, V, K, HV, n_h
        self.order = order
        self.common = dict(HK=HK, HV=HV, NH=n_h, K=K, IS_VARLEN=cu is not None, F32=F32, PREC=PREC)
        self.seq_args = (T, cu, cidx, coff, NCT)
        self.BK, self.BVF = _pow2(K), _pow2(V)
        self.BV = min(cfg.state_bv, self.BVF)
        self.fuse = bool(cfg.fuse_output)
        self.keys_ws = bool(cfg.state_keys_ws)
        self.from_v = bool(cfg.state_from_v)
        # the keys path with U from v needs of the WY kernel only Gamma and the row scales: the kkt kernel writes them
        self.scales_in_kkt = self.keys_ws and self.from_v and cfg.tri_split
        self.aqk = self.fuse or bool(cfg.out_aqk)  # the intra-chunk attention from the kkt (else the WY) kernel
        self.pair = bool(cfg.out_pair) and n_h == 1 and self.aqk and cfg.tri_split and not self.fuse
        self.bnd_every = 2 if self.pair and not boundaries_returned else 1  # (the output kernel reads even ones only)
        self.tma = bool(cfg.state_tma) and not self.fuse and _tma_takes(K, V, bnd, dev=q.device, interp=interp)
        self.trans = bool(cfg.state_trans) and not self.fuse and not self.tma
        self.t_full = bool(cfg.state_t_full) and (self.keys_ws or self.from_v)  # (only then does it read T)
        self.wu_t_full = bool(cfg.wu_t_full) and cfg.tri_split and not self.scales_in_kkt  # (the WY kernel runs)
        dtype, dev, f32 = q.dtype, q.device, torch.float32
        rows = NCT * n_h * BLOCK  # sub-step rows per value head
        self.Ti = torch.empty(HV, rows, BLOCK, dtype=dtype, device=dev)
        self.rstd = torch.empty(HV, rows, dtype=f32, device=dev)
        self.W = torch.empty(HV, 0 if self.keys_ws else rows, K, dtype=dtype, device=dev)  # keys_ws: no W
        self.wsc = torch.empty(HV, rows if self.keys_ws else 0, dtype=f32, device=dev)
        self.U = torch.empty(HV, 0 if self.from_v else rows, V, dtype=dtype, device=dev)
        self.D = None if self.fuse else torch.empty(HV, rows, V, dtype=dtype, device=dev)
        self.Aqk = torch.empty(HV, NCT * BLOCK, n_h * BLOCK, dtype=dtype, device=dev) if self.aqk else None
        self.Aqp = torch.empty(HV, NCT * BLOCK, BLOCK, dtype=dtype, device=dev) if self.pair else None  # odd chunks
        self.gcum = torch.empty(HV, rows, dtype=f32, device=dev)

    def prep(self) -> None:
        """Key norms, T = (I + A)^-1 per 64-row block, W (or the row scales), U (unless from v), Gamma, Aqk."""
        cfg, common, NCT = self.cfg, self.common, self.NCT
        if NCT == 0:
            return
        q, k, v, beta, g = self.q, self.k, self.v, self.beta, self.g
        n_jobs = self.HV * NCT * self.n_h
        if cfg.tri_split:  # A (fp32: T is as exact as the one-kernel path's), then its inverse
            # three or more kkt stages with n_h > 1 on packed sequences: o off by 3.2e-2 / 3.5e-2 from two stages (two
            # runs, DeltaProduct n_h = 2 packed, H200, Triton 3.6, fourteenth session; bit-identical at the eleven
            # other real rows), so two there whatever is asked
            kkt_stages = min(cfg.kkt_stages, 2) if self.n_h > 1 and self.common["IS_VARLEN"] else cfg.kkt_stages
            A = torch.empty(self.HV, NCT * self.n_h * BLOCK, BLOCK, dtype=torch.float32, device=q.device)
            kg = _kkt_heads(cfg, self.common["HK"], self.HV)
            _kkt_kernel[(n_jobs // kg,)](
                q, k, beta, g, A, self.Aqk, self.Aqp, self.rstd, self.gcum, self.wsc, *self.seq_args,
                BK=self.BK, BKC=min(_pow2(cfg.kkt_bk), self.BK), USE_G=g is not None, NORM=self.norm,
                STORE_AQK=self.aqk, STORE_SCALES=self.scales_in_kkt, PAIR=self.pair, KG=kg, num_warps=cfg.kkt_warps,
                num_stages=kkt_stages, **common,
            )  # fmt: skip
            launch_inverse(A, self.Ti, n_jobs, cfg.inv_warps, self.PREC, upper_zeros=self.t_full or self.wu_t_full)
        else:
            n_prog = min(n_jobs, 3 if self.interp else _num_sms() * cfg.tri_programs_per_sm)
            scratch = torch.empty(n_prog, BLOCK, BLOCK, dtype=torch.float32, device=q.device)
            _tri_kernel[(n_prog,)](
                k, beta, g, self.Ti, self.rstd, scratch, *self.seq_args, n_jobs,
                BK=self.BK, USE_G=g is not None, NORM=self.norm, num_warps=cfg.tri_warps, **common,
            )  # fmt: skip
        if not self.scales_in_kkt:
            _wu_kernel[(NCT, self.HV)](
                q, k, v, beta, g, self.Ti, self.W, self.U, self.Aqk, self.gcum, self.rstd, self.wsc, *self.seq_args,
                V=self.V, BK=self.BK, BV=min(cfg.wu_bv, self.BVF), USE_G=g is not None, NORM=self.norm,
                STORE_AQK=self.aqk and not cfg.tri_split, KEYS_WS=self.keys_ws, STORE_U=not self.from_v,
                T_FULL=self.wu_t_full,
                num_warps=cfg.wu_warps, **common,
            )  # fmt: skip

    def state(self) -> None:
        """The sequential kernel: boundary states, D, the final state (and o when fused)."""
        BK, BV = self.BK, self.BV
        BKH = BK // 2 if BK > 128 else BK
        consts = dict(
            V=self.V, BKH=BKH, SPLIT=BKH < BK, BV=BV, HAS_H0=self.h0 is not None, STORE_FINAL=self.ht is not None,
            STORE_BND=self.bnd.shape[0] > 0, FUSE_O=self.fuse, NORM=self.norm, KEYS_WS=self.keys_ws,
            FROM_V=self.from_v, EVICT=self.cfg.state_evict_first, BND_EVERY=self.bnd_every, TRANS=self.trans,
            T_FULL=self.t_full, G0_AHEAD=bool(self.cfg.state_g0_ahead), USE_G=self.g is not None,
            **self.common,
        )  # fmt: skip
        # one block's W (or T), K and U tiles per pipeline stage (and q and A when fused)
        t_tile = 64 if self.keys_ws or self.from_v else 0  # T's 64 x 64
        w_tile = 0 if self.keys_ws else BK
        smem = 64 * (w_tile + t_tile + BK + BV + (BK + 64 if self.fuse else 0)) * self.q.element_size()
        T, cu, _, coff, NCT = self.seq_args
        args = (self.q, self.k, self.v, self.beta, self.W, self.U, self.D, self.Aqk, self.gcum, self.rstd, self.Ti,
                self.wsc, self.bnd, self.ht, self.h0, self.o, T, cu, coff, self.order, NCT, self.scale)  # fmt: skip
        # U from v on the W path: wrong (or NaN) o and states at BV 32 and 2-3 stages on an H100, right at one stage
        # and at BV 64 at any (scripts/fromv_check.py, twelfth session; the interpreter agrees at all), so one there.
        # With T loaded unmasked (state_t_full) it was right at 2-3 stages on an H200 (scripts/fromv_guard_ab.py,
        # fifteenth session) but slower at the one shape that would take it, so the guard stays
        one_stage = self.from_v and not self.keys_ws and BV < 64
        cfg = replace(self.cfg, state_stages=1) if one_stage else self.cfg
        # U from v at BV 32 and 8 warps: NaN o (keys path, GDN default and DeltaProduct n_h = 2 at 8 x 4096) and an
        # illegal memory access (packed) on an H200 (thirteenth session); 4 warps, the default, is GPU-tested
        if self.from_v and BV < 64 and cfg.state_warps > 4:
            cfg = replace(cfg, state_warps=4)
        if self.tma:  # states as [states * heads * dk, dv] rows, a [dk half, value tile] box each store
            consts.update(TMA=True, bnd_desc=_rows_desc(self.bnd, BKH, BV), ht_desc=_rows_desc(self.ht, BKH, BV))
        _launch(_state_kernel, (triton.cdiv(self.V, BV), self.N * self.HV), cfg, args, consts, smem)

    def output(self) -> None:
        """o = scale (e^G q S_c + A D) per chunk (nothing when the state kernel wrote o)."""
        if self.NCT == 0 or self.fuse:
            return
        cfg = self.cfg
        obv = min(cfg.out_bv, self.BVF)
        _output_kernel[(triton.cdiv(self.V, obv), self.NCT, self.HV)](
            self.q, self.k, self.D, self.Aqk, self.Aqp, self.gcum, self.rstd, self.bnd, self.o, *self.seq_args,
            self.scale,
            V=self.V, BK=min(_pow2(cfg.out_bk), self.BK), BV=obv, NORM=self.norm, num_warps=cfg.out_warps,
            num_stages=cfg.out_stages, PREFETCH=cfg.out_prefetch, AQK=self.aqk, EVICT=cfg.out_evict_first,
            PAIR=self.pair, USE_G=self.g is not None,
            **self.common,
        )  # fmt: skip


def _kkt_heads(cfg: LaunchConfig, HK: int, HV: int) -> int:
    """Value heads a kkt program serves: the whole group of a key head with `kkt_group` where Hv / Hk is a power
    of two (the kernel takes them as one [64, KG] tile), else one."""
    group = HV // HK
    return group if cfg.kkt_group and group > 1 and group & (group - 1) == 0 else 1


def _tma_takes(K: int, V: int, bnd: torch.Tensor, *, dev: torch.device, interp: bool) -> bool:
    """Whether the state kernel's stores can go through tensor descriptors: a box of dk's key rows must not run into
    the next head's (dk a power of two), dv rows 16-byte multiples (bf16 states and fp32 final), Hopper or later."""
    if TensorDescriptor is None or K != _pow2(K) or (V * bnd.element_size()) % 16 or V % 4:
        return False
    return interp or (dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (9, 0))


def _rows_desc(x: torch.Tensor | None, rows: int, cols: int):
    """A tensor descriptor over x [..., dv] as 2-D rows (None for None or an empty x: nothing stored)."""
    if x is None or x.numel() == 0:
        return None
    return TensorDescriptor.from_tensor(x.view(-1, x.shape[-1]), [rows, cols])


SMEM_PER_SM = 225 * 1024  # shared memory a sequential kernel's resident programs may take (H100/H200: 227 KiB)


def _launch(kernel, grid, cfg: LaunchConfig, args: tuple, consts: dict, smem_per_stage: int) -> None:
    """Launch a sequential kernel so that all its programs are resident at once (one wave): as many
    pipeline stages as the shared memory of ceil(programs / SMs) programs per SM allows, at least one."""
    per_sm = -(-grid[0] * grid[1] // _num_sms())
    resident = getattr(cfg, "resident_per_sm", None)  # (KdaConfig has none)
    if resident is not None:
        per_sm = min(per_sm, resident)
    stages = max(1, min(cfg.state_stages, SMEM_PER_SM // max(per_sm * smem_per_stage, 1)))
    maxnreg = getattr(cfg, "state_maxnreg", None)
    if maxnreg is not None:
        consts = dict(consts, maxnreg=maxnreg)
    try:
        kernel[grid](*args, num_warps=cfg.state_warps, num_stages=stages, **consts)
    except OutOfResources:
        if stages == 1:
            raise
        kernel[grid](*args, num_warps=cfg.state_warps, num_stages=1, **consts)
