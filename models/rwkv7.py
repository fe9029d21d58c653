"""RWKV-7 ("Goose"), fla 0.6.0's `rwkv7` model type, top to bottom, with every recurrence input on a hook point.

Per layer and head the time mixer runs the generalised delta rule (kernels.dplr.dispatch)
    H_t = (diag(exp g_t) + b_t a_t^T) H_{t-1} + k_t v_t^T,   o_t = H_t^T r_t   (scale 1),
with a = -kappa, b = kappa * a_rwkv: diag(w) minus a rank-one removal along the unit key kappa, at per-channel
strength a_rwkv in (0, 1). Parameter names and shapes are fla's (config.json + model.safetensors load unchanged).

Hooks below `layers.{i}.attn`, in the order they run: hook_q (receptance r), hook_beta (a_rwkv [B,T,H,dk]),
hook_kappa (the unit removal key), hook_k (the key after RWKV-7's k <- k (1 + (a_rwkv - 1) k_a), the key the
recurrence writes), hook_v (after the first-layer value residual), hook_g (log w per key channel), hook_state
(chunk-start states + final), hook_o (the recurrence output, before the GroupNorm). Each hook's output is what
the layer goes on with: an edit of hook_beta changes both the key update and the removal strength.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from deltalab.kernels.constants import IGNORE_INDEX
from deltalab.kernels.dplr.dispatch import dplr_forward
from deltalab.models.cache import LayerCache, RecurrentCache, dplr_step
from deltalab.models.config import ModelConfig
from deltalab.models.generate import Generates
from deltalab.models.hooks import HookPoint
from deltalab.models.lm import CausalLMOutput
from deltalab.models.replay import check_state_shape, replay_patched

W_SCALE = math.exp(-0.5)
"""log w = -exp(-0.5) * sigmoid(.): each channel keeps at least exp(-0.607) = 0.545 of its state per token."""


def token_shift(x: torch.Tensor) -> torch.Tensor:
    """x_{t-1} - x_t with x_{-1} = 0 (fla's token_shift delta)."""
    return F.pad(x, (0, 0, 1, -1)) - x


def cached_token_shift(x: torch.Tensor, cache: LayerCache | None, name: str) -> torch.Tensor:
    """token_shift(x) continued from a decoding cache: x_{-1} is the last input the cache holds under `name`
    ([B, 1, D], zero at a sequence's start), which becomes x's last token."""
    if cache is None:
        return token_shift(x)
    previous = cache.shift.get(name)
    previous = x.new_zeros(x.shape[0], 1, x.shape[2]) if previous is None else previous.to(x.dtype)
    cache.shift[name] = x[:, -1:]
    return torch.cat([previous, x[:, :-1]], 1) - x


class LoRA(nn.Module):
    """fla's LoRA: lora.2(act(lora.0(x))), a bias on the up projection unless `bias=False`."""

    def __init__(self, dim_in: int, dim_out: int, rank: int, activation: str | None, bias: bool = True) -> None:
        super().__init__()
        act = {None: nn.Identity(), "tanh": nn.Tanh(), "sigmoid": nn.Sigmoid()}[activation]
        self.lora = nn.Sequential(nn.Linear(dim_in, rank, bias=False), act, nn.Linear(rank, dim_out, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lora(x)


class RWKV7Attention(nn.Module):
    """Time mixer: token-shift lerps -> r, w, k, v, a, g -> generalised delta rule -> GroupNorm -> bonus -> gate."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        D, H = config.hidden_size, config.num_heads
        self.num_heads, self.head_k_dim, self.head_v_dim = H, config.head_k_dim, config.head_v_dim
        value_dim = H * self.head_v_dim
        for name in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):  # per-channel token-shift mixes
            setattr(self, name, nn.Parameter(torch.zeros(1, 1, D)))
        self.k_k = nn.Parameter(torch.zeros(D))  # removal-key scale: kappa = normalize(k * k_k)
        self.k_a = nn.Parameter(torch.zeros(D))  # how much a_rwkv shrinks the written key
        self.r_k = nn.Parameter(torch.zeros(H, self.head_k_dim))  # bonus weights
        self.r_proj = nn.Linear(D, D, bias=False)
        self.k_proj = nn.Linear(D, D, bias=False)
        self.v_proj = nn.Linear(D, value_dim, bias=False)
        self.o_proj = nn.Linear(value_dim, D, bias=False)
        self.w_lora = LoRA(D, D, config.decay_low_rank_dim, "tanh")
        if layer_idx != 0:
            self.v_lora = LoRA(D, value_dim, config.v_low_rank_dim, None)
        self.a_lora = LoRA(D, D, config.a_low_rank_dim, None)
        self.g_lora = LoRA(D, value_dim, config.gate_low_rank_dim, "sigmoid", bias=False)
        self.g_norm = nn.GroupNorm(H, value_dim, eps=self.head_k_dim * config.norm_eps)  # fla: eps = dk * norm_eps

        self.hook_q = HookPoint()
        self.hook_beta = HookPoint()
        self.hook_kappa = HookPoint()
        self.hook_k = HookPoint()
        self.hook_v = HookPoint()
        self.hook_g = HookPoint()
        self.hook_state = HookPoint()
        self.hook_o = HookPoint()

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:2], self.num_heads, -1)

    def _replay(self, q, k, v, a, b, g, o: torch.Tensor, states: torch.Tensor, hooked: torch.Tensor,
                version: int, initial_state: torch.Tensor | None = None, with_final: bool = False,
                clean: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Outputs after an edit of `hook_state` (as models.attention's `_replay`): the recurrence restarts from
        each patched chunk-start state; unpatched sequences and chunks keep their outputs (`models.replay`).
        `initial_state`, `with_final` and `clean` serve a decoding cache (its state before, the state carried on,
        and the unedited states of a step's own recurrence)."""
        check_state_shape(states, hooked)
        if clean is None:
            clean = states if states._version == version else \
                dplr_forward(q, k, v, a, b, g, scale=1.0, initial_state=initial_state)[2]

        def step(rows: torch.Tensor, t: slice, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            o_c, state, _ = dplr_forward(q[rows, t], k[rows, t], v[rows, t], a[rows, t], b[rows, t], g[rows, t],
                                         scale=1.0, initial_state=state)
            return o_c, state

        return replay_patched(o, clean, hooked, q.shape[1], step, with_final)

    def forward(self, x: torch.Tensor, v_first: torch.Tensor | None,
                cache: LayerCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, D] (after attn_norm) -> (output [B, T, D], v_first: layer 0's values, for the later layers).
        With a decoding cache the token shift and the state continue from it (one token: the O(1) step)."""
        cfg, B, T = self.config, x.shape[0], x.shape[1]
        delta = cached_token_shift(x, cache, "attn")
        xr, xw, xk, xv, xa, xg = (x + delta * mix for mix in (self.x_r, self.x_w, self.x_k, self.x_v, self.x_a,
                                                                self.x_g))
        r = self.hook_q(self._heads(self.r_proj(xr)))
        a_rwkv = self.hook_beta(self._heads(self.a_lora(xa).sigmoid()))
        k = self._heads(self.k_proj(xk))
        kk = k * self._heads(self.k_k.view(1, 1, -1))
        if cfg.fuse_norm:  # fla's l2_norm kernel
            kappa = kk * torch.rsqrt((kk.float() * kk.float()).sum(-1, keepdim=True) + 1e-6).to(kk.dtype)
        else:
            kappa = F.normalize(kk, dim=-1, p=2.0)
        kappa = self.hook_kappa(kappa)
        k = self.hook_k(k * (1 + (a_rwkv - 1) * self._heads(self.k_a.view(1, 1, -1))))
        v = self._heads(self.v_proj(xv))
        if self.layer_idx != 0:  # value residual: lerp towards layer 0's values
            v = torch.lerp(v, v_first, self._heads(self.v_lora(xv).sigmoid()))
        v = self.hook_v(v)
        if self.layer_idx == 0:
            v_first = v
        g = self.hook_g(-W_SCALE * self._heads(self.w_lora(xw).float().sigmoid()))
        a, b = -kappa, kappa * a_rwkv
        h0 = None if cache is None else cache.state
        if cache is not None and T == 1:
            o, final, states = dplr_step(r, k, v, a, b, g, 1.0, h0)
        else:
            o, final, states = dplr_forward(r, k, v, a, b, g, scale=1.0, initial_state=h0)
        version = states._version  # bumped by an in-place edit through nnsight
        hooked = self.hook_state(states)
        if hooked is not states or states._version != version:
            clean = None
            if cache is not None and T == 1 and states._version != version:  # edited in place: the step's own
                clean = dplr_step(r, k, v, a, b, g, 1.0, h0)[2]
            o = self._replay(r, k, v, a, b, g, o, states, hooked, version, h0, cache is not None, clean)
            if cache is not None:
                o, final = o
        if cache is not None:
            cache.state = final
        o = self.hook_o(o.to(x.dtype))
        o = self.g_norm(o.reshape(B * T, -1)).view(B, T, self.num_heads, -1)
        bonus = (r * k * self.r_k).sum(-1, keepdim=True) * v  # the current token's own value, read directly
        o = (o + bonus).reshape(B, T, -1) * self.g_lora(xg)
        return self.o_proj(o), v_first


class RWKV7FeedForward(nn.Module):
    """Channel mixer: value(relu(key(x + shift * x_k))^2)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.x_k = nn.Parameter(torch.zeros(config.hidden_size))
        self.key = nn.Linear(config.hidden_size, config.mlp_size, bias=False)
        self.value = nn.Linear(config.mlp_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        h = self.key(x + cached_token_shift(x, cache, "ffn") * self.x_k)
        return self.value(F.relu(h.float()).square().to(x.dtype))


class RWKV7Block(nn.Module):
    """x + attn(attn_norm(x)), then + ffn(ffn_norm(.)); layer 0 first LayerNorms the embeddings (`pre_norm`).

    hook_resid_pre is the stream the block adds to: after pre_norm on layer 0, the block input elsewhere.
    """

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        D, eps, bias = config.hidden_size, config.norm_eps, config.norm_bias
        if config.norm_first and layer_idx == 0:
            self.pre_norm = nn.LayerNorm(D, eps=eps, bias=bias)
        self.attn_norm = nn.LayerNorm(D, eps=eps, bias=bias)
        self.attn = RWKV7Attention(config, layer_idx)
        self.ffn_norm = nn.LayerNorm(D, eps=eps, bias=bias)
        self.ffn = RWKV7FeedForward(config)
        self.hook_resid_pre = HookPoint()
        self.hook_resid_mid = HookPoint()
        self.hook_resid_post = HookPoint()

    def forward(self, x: torch.Tensor, v_first: torch.Tensor | None,
                cache: LayerCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if hasattr(self, "pre_norm"):
            x = self.pre_norm(x)
        x = self.hook_resid_pre(x)
        if cache is None:
            mixed, v_first = self.attn(self.attn_norm(x), v_first)
        else:
            mixed, v_first = self.attn(self.attn_norm(x), v_first, cache)
        x = self.hook_resid_mid(x + mixed)
        ffn = self.ffn(self.ffn_norm(x)) if cache is None else self.ffn(self.ffn_norm(x), cache)
        return self.hook_resid_post(x + ffn), v_first


class RWKV7ForCausalLM(Generates, nn.Module):
    """fla's RWKV7ForCausalLM with deltalab's top-level module names (`layers.3.attn.hook_beta`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        D = config.hidden_size
        self.embeddings = nn.Embedding(config.vocab_size, D, config.pad_token_id)
        self.layers = nn.ModuleList(RWKV7Block(config, i) for i in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(D, eps=config.norm_eps, bias=config.norm_bias)
        self.lm_head = nn.Linear(D, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embeddings.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """A random init for training from scratch, close in spirit to fla's (tiny embeddings, decays spread
        over channels, zero output projections), not bit-for-bit."""
        c = self.config
        nn.init.uniform_(self.embeddings.weight, -1e-4, 1e-4)
        nn.init.orthogonal_(self.lm_head.weight, gain=0.5 * math.sqrt(max(c.vocab_size / c.hidden_size, 1.0)))
        n = max(c.num_hidden_layers, 2)
        for i, block in enumerate(self.layers):
            att, ratio = block.attn, 1.0 - i / n
            ddd = torch.arange(c.hidden_size) / c.hidden_size
            for name, power in (("x_r", 0.2), ("x_w", 0.9), ("x_k", 0.7), ("x_v", 0.7), ("x_a", 0.9), ("x_g", 0.2)):
                getattr(att, name).copy_((1 - ddd.pow(power * ratio)).view(1, 1, -1))
            att.k_k.fill_(0.85)
            att.k_a.fill_(1.0)
            att.r_k.fill_(-0.04)
            for lin in (att.r_proj, att.k_proj, att.v_proj):
                nn.init.orthogonal_(lin.weight, gain=0.1 if lin is att.k_proj else 1.0)
            att.o_proj.weight.zero_()
            loras = [att.w_lora, att.a_lora, att.g_lora] + ([att.v_lora] if hasattr(att, "v_lora") else [])
            for lora in loras:
                nn.init.zeros_(lora.lora[0].weight)
                nn.init.orthogonal_(lora.lora[2].weight, gain=0.1)
                if lora.lora[2].bias is not None:
                    nn.init.zeros_(lora.lora[2].bias)
            att.w_lora.lora[2].bias.copy_(-6 + 6 * ddd.pow(1 + (i / max(n - 1, 1)) ** 0.3) + 0.5)
            att.a_lora.lora[2].bias.fill_(-0.19)
            if hasattr(att, "v_lora"):
                att.v_lora.lora[2].bias.fill_(0.73)
            block.ffn.x_k.copy_(1 - ddd.pow(ratio**4))
            nn.init.orthogonal_(block.ffn.key.weight)
            block.ffn.value.weight.zero_()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                cache: RecurrentCache | None = None) -> CausalLMOutput:
        """Logits of every position, and the mean next-token loss when `labels` are given.

        Args:
            input_ids (torch.Tensor): token ids `[B, T]` (int64).
            labels (torch.Tensor | None): targets `[B, T]`, aligned with the positions (no shift: position t's
                label is the token it should predict); IGNORE_INDEX positions are skipped.
            cache (RecurrentCache | None): a decoding cache (`models.cache`): continue from it and update it in
                place (generation).

        Returns:
            CausalLMOutput: logits `[B, T, vocab_size]` in the model's dtype, and loss (a float32 scalar) or None.
        """
        x, v_first = self.embeddings(input_ids), None
        for i, block in enumerate(self.layers):
            x, v_first = block(x, v_first) if cache is None else block(x, v_first, cache.layers[i])
        logits = self.lm_head(self.norm(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
        return CausalLMOutput(logits=logits, loss=loss)

    def summary(self) -> str:
        """One paragraph a researcher reads first."""
        c = self.config
        n_params = sum(p.numel() for p in self.parameters())
        return (f"rwkv7 (generalised delta rule, diag + rank-one transitions): {c.num_hidden_layers} layer(s), "
                f"{c.num_heads} heads, dk={c.head_k_dim} dv={c.head_v_dim}, hidden={c.hidden_size}, "
                f"vocab={c.vocab_size}, low-rank w/a/v/g={c.decay_low_rank_dim}/{c.a_low_rank_dim}/"
                f"{c.v_low_rank_dim}/{c.gate_low_rank_dim}; {n_params / 1e6:.2f}M parameters")
