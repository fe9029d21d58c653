"""A transformers Gated DeltaNet model with deltalab's hook points at deltalab's names.

`HookedHFModel` wraps the transformers causal LM (`.hf`) and exposes `layers.{i}` with i the
model's real layer index: linear layers carry `attn.hook_q/k/v/beta/g/state/o` (the kernel call
is rerouted to models.hf.adapter.DeltaRuleHooks); where the model keeps a single residual stream,
every layer carries `hook_resid_pre/post` and linear layers `hook_resid_mid`, attached with
module hooks on the decoder layer. nnsight sees them all: `NNsight(model).layers[3].attn.hook_beta`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from deltalab.models.hf.adapter import DeltaRuleHooks
from deltalab.models.hf.config import HFModelConfig
from deltalab.models.hf.families import Family
from deltalab.models.hf.route import attach, install_router
from deltalab.models.hf.ssd_adapter import SSDHooks
from deltalab.models.hooks import HookPoint
from deltalab.models.lm import IGNORE_INDEX


class LayerHooks(nn.Module):
    """`layers.{i}`: the attn hooks (linear layers) and the residual hooks (single-stream models)."""

    def __init__(self, config: HFModelConfig, layer_idx: int, mixer: str = "linear_attn",
                 resid_mid: bool = True) -> None:
        super().__init__()
        self.layer_idx, self.mixer = layer_idx, mixer
        self.linear = layer_idx in config.delta_layers
        self.residual = config.single_residual
        self.ssd = not config.removal
        if self.linear and self.ssd:
            self.attn = SSDHooks(layer_idx, config.num_key_heads, config.num_heads, config.head_k_dim,
                                 config.head_v_dim)
        elif self.linear:
            self.attn = DeltaRuleHooks(layer_idx, config.num_key_heads, config.num_heads, config.head_k_dim,
                                       config.head_v_dim, channel_gate=config.gate == "channel")
        self.mid = self.residual and self.linear and resid_mid
        if self.residual:
            self.hook_resid_pre = HookPoint()
            self.hook_resid_post = HookPoint()
            if self.mid:
                self.hook_resid_mid = HookPoint()
        self._pre: torch.Tensor | None = None

    def attach(self, decoder_layer: nn.Module) -> list[Any]:
        """Install this layer's hooks on the transformers decoder layer; returns the handles."""
        handles: list[Any] = []
        mixer = None
        if self.linear:
            mixer = ssd_mixer(decoder_layer, self.layer_idx) if self.ssd else getattr(decoder_layer, self.mixer)
            handles += attach(mixer, self.attn)
        if not self.residual:
            return handles
        handles.append(decoder_layer.register_forward_pre_hook(self._resid_pre, with_kwargs=True))
        handles.append(decoder_layer.register_forward_hook(self._resid_post))
        if self.mid:  # decoder layer: x + linear_attn(norm(x)), so mid = pre + attn output
            handles.append(mixer.register_forward_hook(self._resid_mid))
        return handles

    def _resid_pre(self, _mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            x = self.hook_resid_pre(args[0])
            args = (x, *args[1:])
        else:
            x = kwargs["hidden_states"] = self.hook_resid_pre(kwargs["hidden_states"])
        self._pre = x
        return args, kwargs

    def _resid_mid(self, _mod: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor | None:
        pre, self._pre = self._pre, None
        pre = pre.to(out.device)  # a model spread over GPUs: the pre-hook saw the input before it moved
        new = self.hook_resid_mid(pre + out)
        # Where the hook left mid as it was, the layer keeps its own output (bit for bit); elsewhere it
        # adds new - pre to the residual. Elementwise, so in-place writes count and nothing waits on the GPU.
        return torch.where(new == pre + out, out, new - pre)

    def _resid_post(self, _mod: nn.Module, _args: Any, out: torch.Tensor | tuple) -> torch.Tensor | tuple:
        self._pre = None
        if isinstance(out, tuple):  # (hidden states, attention weights) in some hybrids
            return (self.hook_resid_post(out[0]), *out[1:])
        return self.hook_resid_post(out)


def ssd_mixer(decoder_layer: nn.Module, layer_idx: int) -> nn.Module:
    """The Mamba-2 mixer inside a decoder layer: the module owning `A_log`, `dt_bias` and `D` (the attribute is
    `mixer`, `mamba` or `mamba_decoder.mamba` depending on the family)."""
    for module in decoder_layer.modules():
        if all(isinstance(getattr(module, n, None), nn.Parameter) for n in ("A_log", "dt_bias", "D")):
            return module
    raise ValueError(f"decoder layer {layer_idx} ({type(decoder_layer).__name__}) holds no Mamba-2 mixer "
                     "(no module with A_log, dt_bias and D): the config's layer types and the model disagree")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a transformers causal LM or vision-language model."""
    for path in ("model.layers", "model.language_model.layers", "language_model.layers", "backbone.layers", "layers"):
        mod: Any = model
        for part in path.split("."):
            mod = getattr(mod, part, None)
            if mod is None:
                break
        if isinstance(mod, nn.ModuleList):
            return mod
    raise ValueError(f"{type(model).__name__} has no decoder layers at model.layers or "
                     "model.language_model.layers: it is not a supported transformers model")


class HookedHFModel(nn.Module):
    """`model(input_ids, attention_mask=None).logits`, with deltalab's hooks on every linear layer."""

    def __init__(self, hf_model: nn.Module, family: Family) -> None:
        super().__init__()
        self.hf = hf_model
        self.family = family
        self.config = HFModelConfig.from_hf(hf_model.config, family)
        layers = decoder_layers(hf_model)
        if len(layers) != self.config.num_hidden_layers:
            raise ValueError(f"{len(layers)} decoder layers but num_hidden_layers={self.config.num_hidden_layers}")
        install_router(family.module, family.kernels)
        self.layers = nn.ModuleList(LayerHooks(self.config, i, family.mixer, family.resid_mid)
                                    for i in range(self.config.num_hidden_layers))
        self._handles = [h for hooks, layer in zip(self.layers, layers) for h in hooks.attach(layer)]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        """The transformers forward, without a cache unless `use_cache=True` is passed.

        `labels` follow deltalab (aligned with positions, IGNORE_INDEX ignored), not transformers' shift.
        """
        kwargs.setdefault("use_cache", False)
        out = self.hf(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        if labels is not None:
            out.loss = nn.functional.cross_entropy(out.logits.float().flatten(0, 1), labels.flatten(),
                                                   ignore_index=IGNORE_INDEX)
        return out

    def generate(self, input_ids: torch.Tensor | None = None, **kwargs: Any) -> Any:
        """transformers' `generate` on the wrapped model, through deltalab's hooks: every option (max_new_tokens,
        do_sample, temperature, top_k, top_p, attention_mask, generation_config, streamer, ...) passes through,
        and its cache (`use_cache`, on by default) carries the hooked layers' final states."""
        return self.hf.generate(input_ids=input_ids, **kwargs)

    def detach_hooks(self) -> nn.Module:
        """Remove every hook and return the untouched transformers model."""
        for h in self._handles:
            h.remove()
        self._handles = []
        return self.hf

    def summary(self) -> str:
        """One paragraph a researcher reads first."""
        return summary_line(self.config, sum(p.numel() for p in self.hf.parameters()))


def summary_line(c: HFModelConfig, n_params: int) -> str:
    """`deltalab info`'s paragraph for a transformers Gated DeltaNet model (n_params: the checkpoint's, which
    includes a vision tower that the text model deltalab runs leaves out)."""
    full = c.num_hidden_layers - len(c.delta_layers)
    if not c.removal:
        return (f"{c.family} ({c.model_type}) eigenvalues exp(dt*A) in (0,1): {c.num_hidden_layers} layer(s), "
                f"{len(c.delta_layers)} Mamba-2 (SSD, no removal) {c.delta_layers}, {full} without; "
                f"{c.num_key_heads} group(s) / {c.num_heads} heads, dk=d_state={c.head_k_dim} "
                f"dv=head_dim={c.head_v_dim}, hidden={c.hidden_size}, vocab={c.vocab_size}; "
                f"{n_params / 1e6:.2f}M parameters")
    eig = "[-1,1]" if c.allow_neg_eigval else "[0,1]"
    return (f"{c.family} ({c.model_type}) eigenvalues {eig}: {c.num_hidden_layers} layer(s), "
            f"{len(c.delta_layers)} {'Kimi Delta Attention' if c.gate == 'channel' else 'Gated DeltaNet'} "
            f"{c.delta_layers}, {full} attention; "
            f"{c.num_key_heads} key / {c.num_heads} value heads, dk={c.head_k_dim} dv={c.head_v_dim}, "
            f"hidden={c.hidden_size}, vocab={c.vocab_size}; {n_params / 1e6:.2f}M parameters")
