"""The residual stream of one forward pass, taken apart: what every sublayer writes, every head's share of it,
and the read-out (final norm + unembedding) that turns a residual into logits.

One layout covers every model family deltalab loads: its own DeltaProductForCausalLM (fla checkpoints, hybrids
with softmax attention), RWKV7ForCausalLM, and the transformers hybrids behind models.hf.HookedHFModel. A layer is
`resid_post = resid_pre + write(mixer) + write(mlp)`, where `write` is the sublayer's output, or that output
through a post-norm where the architecture has one (OLMo-Hybrid's softmax-attention layers). A mixer's output is
`out_proj(z) [+ bias]`, so its heads' shares are exact: head h writes `W_o[:, h block] z_h`.

`capture_stream(model, input_ids)` runs the model once with forward hooks (no nnsight: nothing is edited) and
returns a `Stream`; `ReadOut` is the final norm and unembedding, applied for real (the logit lens) or with the
norm's scale frozen at the run's own value (direct logit attribution, TransformerLens's convention).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from deltalab.probes.core import ProbeError

HOOKS_DELTA = ("hook_q", "hook_k", "hook_v", "hook_beta", "hook_g", "hook_kappa", "hook_o")
"""Recurrence inputs and output of a delta-rule layer kept for the source split (those the layer has)."""

POST_NORMS = {"olmo_hybrid": {"attention": ("post_attention_layernorm", "post_feedforward_layernorm")}}
"""Transformers families whose layers of a kind normalise a sublayer's output before the residual add:
model type -> layer kind -> (mixer post-norm, mlp post-norm) attribute names on the decoder layer."""


@dataclass
class Sublayer:
    """One writer into the residual stream.

    `kind`: delta_rule, attention, mlp or moe. `out_proj`: the linear map whose input holds the heads (mixers),
    `num_heads` how many blocks that input splits into; `post_norm`: the module between the output and the
    residual add (None: the output is added as it is); `hooks`: the delta-rule hook points (attn module).
    """

    layer: int
    name: str
    kind: str
    module: nn.Module
    out_proj: nn.Linear | None = None
    num_heads: int = 0
    post_norm: nn.Module | None = None
    hooks: nn.Module | None = None
    rwkv: bool = False


@dataclass
class Layout:
    """Where a model keeps its residual stream: per-layer hook points, the sublayers, the read-out modules."""

    family: str
    num_layers: int
    resid_pre: list[nn.Module]
    resid_post: list[nn.Module]
    sublayers: list[Sublayer]
    final_norm: nn.Module
    unembed: nn.Linear
    vocab_size: int
    tied: bool = False


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple | list) else out


def _unembedding(model: nn.Module) -> nn.Linear:
    head = getattr(model, "lm_head", None)
    if head is None and hasattr(model, "get_output_embeddings"):
        head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ProbeError(f"{type(model).__name__} has no output head (lm_head): the lens and attribution read the "
                         "residual through the unembedding; load a causal-LM checkpoint (with lm_head or tied "
                         "embeddings)")
    return head


def layout_of(model: nn.Module) -> Layout:
    """The Layout of a deltalab model, an RWKV-7 model or a HookedHFModel; ProbeError for anything else."""
    from deltalab.models.attention import DeltaProductAttention
    from deltalab.models.rwkv7 import RWKV7Attention

    if hasattr(model, "hf") and hasattr(model, "family"):
        return _hf_layout(model)
    layers = getattr(model, "layers", None)
    if layers is None or not hasattr(model, "norm"):
        raise ProbeError(f"{type(model).__name__} is not a model deltalab reads (no layers/norm): load it with "
                         "deltalab.models.load_checkpoint")
    subs: list[Sublayer] = []
    for i, block in enumerate(layers):
        attn = block.attn
        if isinstance(attn, DeltaProductAttention):
            subs.append(Sublayer(i, "mixer", "delta_rule", attn, attn.o_proj, attn.num_v_heads, hooks=attn))
        elif isinstance(attn, RWKV7Attention):
            subs.append(Sublayer(i, "mixer", "delta_rule", attn, attn.o_proj, attn.num_heads, hooks=attn, rwkv=True))
        else:
            subs.append(Sublayer(i, "mixer", "attention", attn, attn.o_proj, attn.num_heads))
        mlp = block.mlp if hasattr(block, "mlp") else block.ffn
        subs.append(Sublayer(i, "mlp", "mlp", mlp))
    head = _unembedding(model)
    emb = getattr(model, "embeddings", None)
    return Layout(model.config.model_type, len(layers), [b.hook_resid_pre for b in layers],
                  [b.hook_resid_post for b in layers], subs, model.norm, head, head.out_features,
                  tied=emb is not None and head.weight is emb.weight)


def _hf_layout(model: nn.Module) -> Layout:
    from deltalab.models.hf.hooked import decoder_layers

    cfg = model.config
    if not cfg.single_residual:
        raise ProbeError(f"{cfg.family} keeps several residual streams (hyper-connections): the lens and attribution "
                         "read a single stream; use a model with one residual stream")
    hf = model.hf
    layers = decoder_layers(hf)
    base = getattr(hf, "model", hf)
    norm = getattr(base, "norm", None) or getattr(getattr(base, "language_model", None), "norm", None)
    if norm is None:
        raise ProbeError(f"{type(hf).__name__} has no final norm at model.norm: not a supported causal LM")
    post = POST_NORMS.get(cfg.model_type, {})
    subs: list[Sublayer] = []
    for i, layer in enumerate(layers):
        linear = i in cfg.delta_layers
        mixer = getattr(layer, model.family.mixer if linear else "self_attn")
        proj = getattr(mixer, "o_proj", None) or getattr(mixer, "out_proj", None)
        kind = "delta_rule" if linear else "attention"
        heads = cfg.num_heads if linear else int(getattr(mixer, "num_heads", 0) or
                                                  cfg.hf_config.get("num_attention_heads") or
                                                  hf.config.get_text_config().num_attention_heads)
        names = post.get(kind if kind == "attention" else "linear", (None, None))
        m_post, f_post = (getattr(layer, n) if n else None for n in names)
        subs.append(Sublayer(i, "mixer", kind, mixer, proj, heads, m_post,
                             hooks=model.layers[i].attn if linear else None))
        mlp = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None) or layer.feed_forward
        moe = hasattr(mlp, "experts") or "moe" in type(mlp).__name__.lower()
        subs.append(Sublayer(i, "mlp", "moe" if moe else "mlp", mlp, post_norm=f_post))
    head = _unembedding(hf)
    emb = hf.get_input_embeddings() if hasattr(hf, "get_input_embeddings") else None
    return Layout(cfg.model_type, len(layers), [h.hook_resid_pre for h in model.layers],
                  [h.hook_resid_post for h in model.layers], subs, norm, head, head.out_features,
                  tied=emb is not None and head.weight is getattr(emb, "weight", None))


@dataclass
class SublayerRun:
    """What one sublayer did in the run: output [B, T, D], residual write [B, T, D], out_proj input z
    [B, T, H * d] (mixers), the delta-rule hooks' outputs by name, and RWKV-7's output gate [B, T, H * dv]."""

    output: torch.Tensor
    write: torch.Tensor
    z: torch.Tensor | None = None
    delta: dict[str, torch.Tensor] = field(default_factory=dict)
    gate: torch.Tensor | None = None


@dataclass
class Stream:
    """One forward pass: input_ids [B, T], logits [B, T, V], resid_pre / resid_post per layer [B, T, D],
    final [B, T, D] (the final norm's input), and a SublayerRun per Sublayer of the layout (same order)."""

    layout: Layout
    input_ids: torch.Tensor
    logits: torch.Tensor
    resid_pre: list[torch.Tensor]
    resid_post: list[torch.Tensor]
    final: torch.Tensor
    runs: list[SublayerRun]


@torch.no_grad()
def capture_stream(model: nn.Module, input_ids: torch.Tensor, delta_inputs: bool = False) -> Stream:
    """Run `model(input_ids)` once and keep the residual stream and every sublayer's write (see Stream).

    input_ids [B, T] int64. delta_inputs also keeps the delta-rule layers' hook outputs (q, k, v, beta, g, kappa,
    o) for the source split, and RWKV-7's output gate.
    """
    layout = layout_of(model)
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= layout.vocab_size):
        raise ProbeError(f"token ids reach {int(input_ids.max())} (min {int(input_ids.min())}) but the model's "
                         f"vocabulary has {layout.vocab_size}: pass ids in 0..{layout.vocab_size - 1}")
    saved: dict[Any, Any] = {}
    handles = []

    def keep(key: Any, pre: bool = False):
        def hook(_m, args, out=None):
            saved[key] = (args[0] if args else None) if pre else _first(out)
        return hook

    for i in range(layout.num_layers):
        handles.append(layout.resid_pre[i].register_forward_hook(keep(("pre", i))))
        handles.append(layout.resid_post[i].register_forward_hook(keep(("post", i))))
    for j, sub in enumerate(layout.sublayers):
        handles.append(sub.module.register_forward_hook(keep(("out", j))))
        if sub.post_norm is not None:
            handles.append(sub.post_norm.register_forward_hook(keep(("write", j))))
        if sub.out_proj is not None:
            handles.append(sub.out_proj.register_forward_pre_hook(keep(("z", j), pre=True)))
        if delta_inputs and sub.hooks is not None:
            for name in HOOKS_DELTA:
                if hasattr(sub.hooks, name):
                    handles.append(getattr(sub.hooks, name).register_forward_hook(keep((name, j))))
            if sub.rwkv:
                handles.append(sub.module.g_lora.register_forward_hook(keep(("gate", j))))
    handles.append(layout.final_norm.register_forward_pre_hook(keep("final", pre=True)))
    try:
        out = model(input_ids)
    finally:
        for h in handles:
            h.remove()
    logits = out.logits if hasattr(out, "logits") else _first(out)
    runs = []
    for j in range(len(layout.sublayers)):
        delta = {n[5:]: saved[(n, j)] for n in HOOKS_DELTA if (n, j) in saved}
        runs.append(SublayerRun(saved[("out", j)], saved.get(("write", j), saved[("out", j)]), saved.get(("z", j)),
                                delta, saved.get(("gate", j))))
    return Stream(layout, input_ids, logits, [saved[("pre", i)] for i in range(layout.num_layers)],
                  [saved[("post", i)] for i in range(layout.num_layers)], saved["final"], runs)


FORM_TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 3e-3}
"""Largest relative gap between a norm and its frozen form that still reads as that form (float32 and float64:
1e-3; the norms compute in float32 and round their output to the model's dtype)."""


class FrozenNorm:
    """An RMSNorm or LayerNorm with its scale frozen at the run's own inputs x [..., D]: a linear map plus a
    constant, `norm(x) = apply(x) + bias` exactly, and `apply(c)` for any part c of x (TransformerLens's
    convention for direct logit attribution). ProbeError for a norm of another form (checked on x itself).
    """

    def __init__(self, norm: nn.Module, x: torch.Tensor) -> None:
        x64 = x.double()
        D = x.shape[-1]
        self.centre = isinstance(norm, nn.LayerNorm)
        if isinstance(norm, nn.LayerNorm):
            eps = norm.eps
            w = norm.weight.double() if norm.weight is not None else x64.new_ones(D)
            self.bias = norm.bias.double() if norm.bias is not None else x64.new_zeros(D)
            var = x64.var(-1, unbiased=False, keepdim=True)
        else:  # RMS-type: y = x / rms(x) * w_eff; w_eff read as norm(ones) * sqrt(1 + eps) (covers (1 + w) forms)
            eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
            if eps is None:
                raise ProbeError(f"final norm {type(norm).__name__} has no eps: deltalab reads RMSNorm and LayerNorm")
            ones = torch.ones(D, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32, device=x.device)
            w = norm(ones).double() * (1 + eps) ** 0.5
            self.bias = x64.new_zeros(D)
            var = x64.pow(2).mean(-1, keepdim=True)
        self.scale = torch.rsqrt(var + eps) * w  # [..., D]
        want = norm(x).double()
        got = self.apply(x64) + self.bias
        err = float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))
        if err > FORM_TOLERANCE.get(x.dtype, 1e-3):  # a form check: the norm itself rounds in its own dtype
            raise ProbeError(f"norm {type(norm).__name__} is not an RMSNorm or LayerNorm deltalab can freeze "
                             f"(relative error {err:.2g}): the attribution cannot read this model")

    def apply(self, c: torch.Tensor) -> torch.Tensor:
        """The frozen norm's linear part applied to c [..., D] (float64)."""
        c = c.double()
        if self.centre:
            c = c - c.mean(-1, keepdim=True)
        return c * self.scale

    def pull_back(self, u: torch.Tensor) -> torch.Tensor:
        """u' with u' . c = u . apply(c) for every c: the read direction before the norm (u [..., D])."""
        u = u.double() * self.scale
        return u - u.mean(-1, keepdim=True) if self.centre else u


class ReadOut:
    """The model's final norm and unembedding (tied embeddings read as the unembedding, as the model does)."""

    def __init__(self, layout: Layout) -> None:
        self.norm, self.unembed, self.vocab_size = layout.final_norm, layout.unembed, layout.vocab_size

    @torch.no_grad()
    def logits(self, resid: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] of a residual [..., D] through the real final norm and unembedding (the lens)."""
        w = self.unembed.weight
        return self.unembed(self.norm(resid.to(w.dtype).to(w.device)))

    def check_tokens(self, ids: torch.Tensor | list[int], what: str) -> None:
        t = torch.as_tensor(ids)
        bad = t[(t < 0) | (t >= self.vocab_size)]
        if bad.numel():
            raise ProbeError(f"{what} {int(bad[0])} is outside the vocabulary: pass a token id in "
                             f"0..{self.vocab_size - 1}")

    def directions(self, target: torch.Tensor, minus: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(unembedding rows [..., D], bias [...]) of the target tokens, minus those of `minus` (a logit difference);
        float64."""
        W = self.unembed.weight.double()
        b = self.unembed.bias.double() if self.unembed.bias is not None else W.new_zeros(W.shape[0])
        t = target.clamp(min=0).to(W.device)
        d, c = W[t], b[t]
        if minus is not None:
            m = minus.clamp(min=0).to(W.device)
            d, c = d - W[m], c - b[m]
        return d, c
