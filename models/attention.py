"""The gated delta product token mixer, with every intermediate passing through a hook point.

One module covers fla's GatedDeltaProduct, DeltaNet (n_h = 1, no gate) and GatedDeltaNet
(n_h = 1, gate); parameter names and shapes are fla's. Every hook's output is what the layer goes on
with, so overwriting one through nnsight changes the layer; `hook_state` (the chunk-start states) is
honoured by replaying the recurrence from the edited states (see `_replay`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from deltalab.kernels.delta_rule.dispatch import delta_product_forward
from deltalab.kernels.delta_rule.naive import l2_normalize
from deltalab.models.cache import LayerCache, delta_rule_step
from deltalab.models.config import ModelConfig
from deltalab.models.hooks import HookPoint
from deltalab.models.layers import GatedRMSNorm, RMSNorm, ShortConvolution
from deltalab.models.replay import check_state_shape, replay_patched


class DeltaProductAttention(nn.Module):
    """q, k, v, beta (and g) -> chunked gated delta product -> norm (gated) -> o_proj.

    Grouped value heads (gated_deltanet's `num_v_heads`): q, k have `num_heads` key heads, v, beta, g, o and
    the state `num_v_heads` value heads; value head j reads key head j // (num_v_heads / num_heads).
    """

    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        D, H, Hv, n_h = config.hidden_size, config.num_key_heads, config.num_value_heads, config.num_householder
        self.num_heads, self.num_v_heads, self.num_householder = H, Hv, n_h  # key heads, value heads (fla's names)
        self.head_k_dim, self.head_v_dim = config.head_k_dim, config.head_v_dim
        key_dim, value_dim = H * self.head_k_dim, Hv * self.head_v_dim

        self.q_proj = nn.Linear(D, key_dim, bias=False)
        self.k_proj = nn.Linear(D, key_dim * n_h, bias=False)
        self.v_proj = nn.Linear(D, value_dim * n_h, bias=False)
        if config.use_beta:
            self.b_proj = nn.Linear(D, Hv * n_h, bias=False)
        self.channel_gate = config.model_type == "kda"
        if self.channel_gate:  # fla's KimiDeltaAttention: a low-rank projection to one log decay per key channel
            self.f_proj = nn.Sequential(nn.Linear(D, self.head_v_dim, bias=False),
                                        nn.Linear(self.head_v_dim, Hv * self.head_k_dim, bias=False))
            self.A_log = nn.Parameter(torch.empty(Hv))
            self.dt_bias = nn.Parameter(torch.empty(Hv * self.head_k_dim))
            self.reset_gate_parameters()
        elif config.use_forget_gate:
            self.a_proj = nn.Linear(D, Hv, bias=False)
            self.A_log = nn.Parameter(torch.empty(Hv))
            self.dt_bias = nn.Parameter(torch.empty(Hv))
            self.reset_gate_parameters()
        if config.use_short_conv:
            qk_act = "silu" if config.qk_activation == "silu" else None
            self.q_conv1d = ShortConvolution(key_dim, config.conv_size, config.conv_bias, qk_act)
            self.k_conv1d = ShortConvolution(key_dim * n_h, config.conv_size, config.conv_bias, qk_act)
            self.v_conv1d = ShortConvolution(value_dim * n_h, config.conv_size, config.conv_bias, "silu")
        if self.channel_gate:  # kda's output gate is low-rank too, with a bias
            self.g_proj = nn.Sequential(nn.Linear(D, self.head_v_dim, bias=False),
                                        nn.Linear(self.head_v_dim, value_dim, bias=True))
            self.o_norm = GatedRMSNorm(self.head_v_dim, config.norm_eps, "sigmoid")
        elif config.use_output_gate:
            self.g_proj = nn.Linear(D, value_dim, bias=False)
            self.o_norm = GatedRMSNorm(self.head_v_dim, config.norm_eps, config.output_gate_activation)
        else:
            self.o_norm = RMSNorm(self.head_v_dim, config.norm_eps, dtype=torch.float32)
        self.o_proj = nn.Linear(value_dim, D, bias=False)

        self.hook_q = HookPoint()
        self.hook_k = HookPoint()
        self.hook_v = HookPoint()
        self.hook_beta = HookPoint()
        self.hook_g = HookPoint()
        self.hook_state = HookPoint()
        self.hook_o = HookPoint()

    def reset_gate_parameters(self) -> None:
        """fla's forget-gate init: A ~ U(1, 16) (stored as log), dt ~ logU(1e-3, 0.1) (inverse softplus)."""
        with torch.no_grad():
            H = self.num_v_heads
            self.A_log.copy_(torch.log(torch.empty(H).uniform_(1, 16)))
            n = self.dt_bias.numel()
            dt = torch.exp(torch.rand(n) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def _qkv(self, x: torch.Tensor, cache: LayerCache | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projections, short conv (or SiLU), head split and query/key activation + normalisation; with a
        decoding cache the convolutions continue from (and update) its last inputs."""
        cfg, B, T = self.config, x.shape[0], x.shape[1]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if cfg.use_short_conv and cache is not None:
            q, cache.conv["q"] = self.q_conv1d.step(q, cache.conv.get("q"))
            k, cache.conv["k"] = self.k_conv1d.step(k, cache.conv.get("k"))
            v, cache.conv["v"] = self.v_conv1d.step(v, cache.conv.get("v"))
        elif cfg.use_short_conv:
            q, k, v = self.q_conv1d(q), self.k_conv1d(k), self.v_conv1d(v)
        else:
            if cfg.qk_activation == "silu":
                q, k = F.silu(q), F.silu(k)
            v = F.silu(v)
        q = q.view(B, T, self.num_heads, self.head_k_dim)
        k = k.view(B, T, self.num_householder, self.num_heads, self.head_k_dim)
        v = v.view(B, T, self.num_householder, self.num_v_heads, self.head_v_dim)
        if cfg.qk_activation == "relu":
            q, k = q.relu(), k.relu()
        elif cfg.qk_activation == "elu":
            q, k = F.elu(q) + 1, F.elu(k) + 1
        if cfg.qk_norm == "l2":
            q, k = l2_normalize(q.float()).to(q.dtype), l2_normalize(k.float()).to(k.dtype)
        elif cfg.qk_norm == "sum":
            q, k = F.normalize(q, p=1, dim=-1, eps=1e-6), F.normalize(k, p=1, dim=-1, eps=1e-6)
        return q, k, v

    def _replay(self, q, k, v, beta, g, scale: float, initial_state: torch.Tensor | None, o: torch.Tensor,
                states: torch.Tensor, hooked: torch.Tensor, version: int, with_final: bool = False,
                clean: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Outputs after an intervention on `hook_state` ([B, NC + 1, H, dk, dv]: the state before each chunk
        of CHUNK_SIZE tokens, then the final state).

        An entry that differs from what the layer computed is a patch: the recurrence restarts from the
        patched state at that chunk start, and later chunk starts carry the patched dynamics forward (unless
        they are patched too). Sequences without a patch, and a patched one's chunks before its first patch,
        keep their outputs bit for bit (`models.replay`); the final state feeds no output. Only this path
        pays for the replay: without an intervention the forward is unchanged. `with_final`: also return the
        state a decoding cache carries on (`models.replay.replay_patched`); `clean`: the unedited states when the
        caller recomputed them (a decoding step's own recurrence), else they come from `states` or the chunked form.
        """
        check_state_shape(states, hooked)
        if clean is not None:
            pass
        elif states._version == version:  # replaced, not edited in place: `states` still holds the clean values
            clean = states
        else:
            _, _, clean = delta_product_forward(q, k, v, beta, g, scale=scale, initial_state=initial_state)

        def step(rows: torch.Tensor, t: slice, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            gate = None if g is None else g[rows, t]
            o_c, state, _ = delta_product_forward(q[rows, t], k[rows, t], v[rows, t], beta[rows, t], gate,
                                                  scale=scale, initial_state=state)
            return o_c, state

        return replay_patched(o, clean, hooked, q.shape[1], step, with_final)

    def forward(self, x: torch.Tensor, initial_state: torch.Tensor | None = None,
                cache: LayerCache | None = None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]. With a decoding cache (`models.cache`) the layer starts from its state and
        conv inputs and leaves the new ones there; one token takes the O(1) recurrent step."""
        cfg, B, T = self.config, x.shape[0], x.shape[1]
        q, k, v = self._qkv(x, cache)
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        if cfg.use_beta:
            beta = self.b_proj(x).float().sigmoid().view(B, T, self.num_householder, self.num_v_heads)
        else:
            beta = x.new_ones(B, T, self.num_householder, self.num_v_heads, dtype=torch.float32)
        if cfg.allow_neg_eigval:
            beta = beta * 2.0
        beta = self.hook_beta(beta)
        g = None
        if self.channel_gate:  # g [B, T, Hv, dk]
            f = self.f_proj(x).float().view(B, T, self.num_v_heads, self.head_k_dim)
            f = f + self.dt_bias.float().view(self.num_v_heads, self.head_k_dim)
            a = self.A_log.float().exp()[:, None]
            g = cfg.lower_bound * torch.sigmoid(a * f) if cfg.lower_bound is not None else -a * F.softplus(f)
            g = self.hook_g(g)
        elif cfg.use_forget_gate:
            g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias)
            g = self.hook_g(g)
        scale = self.head_k_dim**-0.5
        if cache is not None:
            initial_state = cache.state
        if cache is not None and T == 1:
            o, final, states = delta_rule_step(q, k, v, beta, g, scale, initial_state)
        else:
            o, final, states = delta_product_forward(q, k, v, beta, g, scale=scale, initial_state=initial_state)
        version = states._version  # bumped by an in-place edit (nnsight's `hook_state.output[...] = x`)
        hooked = self.hook_state(states)
        if hooked is not states or states._version != version:
            clean = None
            if cache is not None and T == 1 and states._version != version:  # edited in place: the step's own
                clean = delta_rule_step(q, k, v, beta, g, scale, initial_state)[2]  # states, not the chunked form's
            o = self._replay(q, k, v, beta, g, scale, initial_state, o, states, hooked, version, cache is not None,
                             clean)
            if cache is not None:
                o, final = o
        if cache is not None:
            cache.state = final
        o = self.hook_o(o.to(x.dtype))
        if cfg.use_output_gate:
            gate = self.g_proj(x).view(B, T, self.num_v_heads, self.head_v_dim)
            o = self.o_norm(o, gate)
        else:
            o = self.o_norm(o)
        return self.o_proj(o.reshape(B, T, -1))

