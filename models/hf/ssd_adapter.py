"""deltalab's hook points and kernel in place of a transformers Mamba-2 (SSD) chunk-scan call.

The Mamba-2 mixers of the six transformers families (mamba2, bamba, falcon_h1, granitemoehybrid, nemotron_h,
zamba2) call the module global `mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, D, dt_bias, ...)`.
`SSDHooks` receives that call, discretises as transformers does (dt = clamp(softplus(dt + dt_bias))), and
names SSD's roles as a delta-rule layer without removal: query C, key B, value dt * x, log decay dt * A. It runs
`kernels.ssd.chunk_ssd` (scale 1), adds the D skip after `hook_o`, and returns what transformers returns.
The short convolution before and the gated norm after stay in the transformers mixer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deltalab.kernels.ssd.chunk import chunk_ssd
from deltalab.models.hf.route import PackedSequencesError
from deltalab.models.hooks import HookPoint
from deltalab.models.replay import check_state_shape, replay_patched


class SSDHooks(nn.Module):
    """`layers.{i}.attn`: hook_q/k/v/g/state/o around one Mamba-2 layer's SSD (no hook_beta: SSD has no removal
    and writes each token whole).

    Shapes (n_h = 1, float32 as transformers computes the scan): hook_q [B,T,G,N] (C; G = n_groups key heads,
    N = d_state = dk), hook_k [B,T,1,G,N] (B), hook_v [B,T,1,H,P] (dt * x; P = head_dim = dv), hook_g [B,T,H]
    (dt * A, the per-head log decay), hook_state [B,NC,H,N,P] (before each CHUNK_SIZE-token chunk, then the final
    state; transformers' cache holds its transpose [B,H,P,N]), hook_o [B,T,H,P] (C_t^T h_t, before the D skip).
    Writes to any of them change the layer; an edited chunk-start state restarts the recurrence from that chunk.
    """

    def __init__(self, layer_idx: int, num_groups: int, num_heads: int, state_size: int, head_dim: int) -> None:
        super().__init__()
        if num_heads % num_groups:
            raise ValueError(f"layer {layer_idx}: {num_heads} heads are not a multiple of {num_groups} groups")
        self.layer_idx = layer_idx
        self.num_k_heads, self.num_v_heads = num_groups, num_heads
        self.head_k_dim, self.head_v_dim = state_size, head_dim
        self.hook_q = HookPoint()
        self.hook_k = HookPoint()
        self.hook_v = HookPoint()
        self.hook_g = HookPoint()
        self.hook_state = HookPoint()
        self.hook_o = HookPoint()

    def route_call(self, call: dict[str, Any]) -> Any:
        """Take the bound arguments of transformers' `mamba2_chunk_scan` (models.hf.route)."""
        extra = call.get("kwargs", {})
        if any(extra.get(name) is not None for name in ("seq_idx", "cu_seqlens")):
            raise PackedSequencesError("packed sequences (seq_idx, cu_seqlens) cannot pass deltalab's hooks: "
                                       "pass one sequence per row with an attention mask")
        if extra.get("z") is not None:
            raise ValueError(f"layer {self.layer_idx}: a gate z inside the scan is not hooked by deltalab "
                             "(transformers passes z=None and gates in its norm)")
        return self(call["hidden_states"], call["dt"], call["A"], call["B"], call["C"], D=call.get("D"),
                    dt_bias=call.get("dt_bias"), initial_states=call.get("initial_states"),
                    dt_softplus=bool(call.get("dt_softplus", False)),
                    dt_limit=call.get("dt_limit", (0.0, float("inf"))),
                    return_final_states=bool(call.get("return_final_states", False)))

    def forward(self, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                initial_states: torch.Tensor | None = None, dt_softplus: bool = False,
                dt_limit: tuple[float, float] = (0.0, float("inf")),
                return_final_states: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Same contract as transformers' `mamba2_chunk_scan`: x [B,T,H,P], dt [B,T,H], A [H], B, C [B,T,G,N],
        D [H], dt_bias [H], initial_states [B,H,P,N]; returns y [B,T,H,P] float32 (and the final state [B,H,P,N])."""
        want = (x.shape[0], x.shape[1], self.num_k_heads, self.head_k_dim)
        if tuple(B.shape) != want or tuple(x.shape[2:]) != (self.num_v_heads, self.head_v_dim):
            raise ValueError(f"layer {self.layer_idx}: scan inputs x {tuple(x.shape)}, B {tuple(B.shape)} do not "
                             f"match the config's {self.num_v_heads} heads of {self.head_v_dim}, "
                             f"{self.num_k_heads} groups of state {self.head_k_dim}: the layer and its config disagree")
        if dt_bias is not None:  # discretisation in transformers' order and dtypes
            dt = dt + dt_bias.to(dt.dtype)
        if dt_softplus:
            dt = F.softplus(dt)
        dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1]).float()
        x = x.float()
        q = self.hook_q(C.float())
        k = self.hook_k(B.float().unsqueeze(2))
        v = self.hook_v((x * dt[..., None]).unsqueeze(2))
        g = self.hook_g(A.float() * dt)
        start = None if initial_states is None else initial_states.float().transpose(-1, -2)
        o, _, states = chunk_ssd(q, k[:, :, 0], v[:, :, 0], g, initial_state=start)
        version = states._version
        hooked = self.hook_state(states)
        if hooked is not states or states._version != version:
            o = self._replay(q, k, v, g, start, o, states, hooked, version)
        y = self.hook_o(o)
        if D is not None:  # the D skip, outside the recurrence (transformers adds it inside its scan)
            y = y + D.float()[:, None] * x
        if return_final_states:
            return y, hooked[:, -1].transpose(-1, -2).contiguous()
        return y

    @staticmethod
    def _replay(q, k, v, g, start, o, states, hooked, version) -> torch.Tensor:
        """Outputs after an edit of hook_state (models.replay): the recurrence restarts from each patched start."""
        check_state_shape(states, hooked)
        clean = states if states._version == version else chunk_ssd(q, k[:, :, 0], v[:, :, 0], g,
                                                                     initial_state=start)[2]

        def step(rows: torch.Tensor, t: slice, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            o_c, state, _ = chunk_ssd(q[rows, t], k[rows, t, 0], v[rows, t, 0], g[rows, t], initial_state=state)
            return o_c, state

        return replay_patched(o, clean, hooked, q.shape[1], step)
