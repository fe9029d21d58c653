"""deltalab's hook points and kernel in place of a transformers Gated DeltaNet kernel call.

`DeltaRuleHooks` receives exactly what the transformers layer passes to its kernel
(q, k [B,T,Hk,dk], v [B,T,Hv,dv], g, beta [B,T,Hv]), routes every intermediate through a
HookPoint with deltalab's shapes (n_h = 1), runs `kernels.delta_product_forward` (chunk-boundary
states for free, Triton on CUDA) and returns what the transformers kernel returns (o, final state).
"""

from __future__ import annotations

import torch
from torch import nn

from deltalab.kernels.delta_rule.dispatch import delta_product_forward
from deltalab.kernels.delta_rule.naive import l2_normalize
from deltalab.models.attention import DeltaProductAttention
from deltalab.models.hooks import HookPoint

_replay = DeltaProductAttention._replay
"""deltalab's hook_state replay (it reads only its arguments): edited chunk-start states restart the recurrence."""


def key_head_of(num_k_heads: int, num_v_heads: int) -> list[int]:
    """Key head read by each value head (transformers' grouped value attention: consecutive groups)."""
    group = num_v_heads // num_k_heads
    return [j // group for j in range(num_v_heads)]


class DeltaRuleHooks(nn.Module):
    """`layers.{i}.attn`: hook_q/k/v/beta/g/state/o around one linear layer's recurrence.

    Shapes (n_h = 1): hook_q [B,T,Hk,dk] and hook_k [B,T,1,Hk,dk] (L2-normalised in float32, then in the
    model's dtype, as deltalab's own layers), hook_v [B,T,1,Hv,dv], hook_beta [B,T,1,Hv] (float32, as the layer
    computed it, x2 in OLMo-Hybrid), hook_g [B,T,Hv] ([B,T,Hv,dk] for Kimi Delta Attention), hook_state
    [B,NC,Hv,dk,dv] (chunk starts + final), hook_o [B,T,Hv,dv]. Writes to any of them change the layer; an
    edited chunk-start state restarts the recurrence from that chunk (deltalab's replay). The final state handed
    back to the layer's cache is hook_state's last entry, or after an edit the state the edited recurrence ends
    in (an edit of the last entry itself wins).
    """

    def __init__(self, layer_idx: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 channel_gate: bool = False) -> None:
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"layer {layer_idx}: {num_v_heads} value heads are not a multiple of "
                             f"{num_k_heads} key heads")
        self.layer_idx = layer_idx
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.channel_gate = channel_gate
        self.hook_q = HookPoint()
        self.hook_k = HookPoint()
        self.hook_v = HookPoint()
        self.hook_beta = HookPoint()
        self.hook_g = HookPoint()
        self.hook_state = HookPoint()
        self.hook_o = HookPoint()

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                use_qk_l2norm_in_kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Same contract as transformers' `torch_chunk_gated_delta_rule` (o in query's dtype)."""
        out_dtype = query.dtype
        B, T = value.shape[:2]
        want = (B, T, self.num_v_heads) + ((self.head_k_dim,) if self.channel_gate else ())
        if tuple(g.shape) != want:
            kind = "per-channel [B,T,H,dk]" if self.channel_gate else "scalar [B,T,H]"
            raise ValueError(f"layer {self.layer_idx}: gate g has shape {tuple(g.shape)}, the config's {kind} gate "
                             f"needs {want}: the layer and its config disagree")
        q, k = query, key
        if use_qk_l2norm_in_kernel:  # in float32, as transformers and fla do; back to the model's dtype, so
            # bf16 models run the Triton kernel's half-precision products (float32 ones are several times slower)
            q, k = l2_normalize(q.float()).to(out_dtype), l2_normalize(k.float()).to(out_dtype)
        q = self.hook_q(q)
        k = self.hook_k(k.unsqueeze(2))
        v = self.hook_v(value.unsqueeze(2))
        beta = self.hook_beta(beta.float().unsqueeze(2))
        g = self.hook_g(g.float())
        q_run, k_run = q, k  # the kernels read key head j // (Hv / Hk) for value head j themselves
        v_run, scale = v.to(q_run.dtype), self.head_k_dim**-0.5
        o, _, states = delta_product_forward(q_run, k_run, v_run, beta, g, scale=scale, initial_state=initial_state)
        version = states._version  # bumped by an in-place edit (nnsight's `hook_state.output[...] = x`)
        hooked = self.hook_state(states)
        final = hooked[:, -1]
        if hooked is not states or states._version != version:  # the cache carries the edited dynamics on
            o, final = _replay(None, q_run, k_run, v_run, beta, g, scale, initial_state, o, states, hooked, version,
                               True)
        o = self.hook_o(o.to(out_dtype))
        return o, (final if output_final_state else None)
