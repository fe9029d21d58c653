"""Which Hugging Face model types hold delta-rule layers, and how to read them.

Gated DeltaNet families: the linear layers are `<decoder layers>[i].linear_attn` (`config.layer_types[i] ==
"linear_attention"`) and call the module globals `torch_chunk_gated_delta_rule` and
`torch_recurrent_gated_delta_rule`. Kimi Delta Attention families (per-channel gates, `g [B,T,H,dk]`): the
linear layers are `<decoder layers>[i].self_attn` (the attribute the softmax layers use too, so
`layer_types` decides) and call `chunk_kimi_delta_attention` / `recurrent_kimi_delta_attention`. deltalab
reroutes those globals of the family's modeling module (models.hf.route).

Mamba-2 (SSD) families: the linear layers are the decoder layers holding a Mamba-2 mixer (`config.layer_types[i]`
is "linear_attention", or "hybrid" where a layer holds attention and a mixer) and call `mamba2_chunk_scan`;
deltalab finds the mixer by its parameters (models.hf.hooked.ssd_mixer) and reroutes that global
(models.hf.ssd_adapter).
"""

from __future__ import annotations

from dataclasses import dataclass

TRANSFORMERS_RANGE = ((5, 23), (6, 0))
"""Supported transformers versions: >= 5.23, < 6 (the modeling code read for these families)."""

TRANSFORMERS_SPEC = "transformers>=5.23,<6"

LINEAR = "linear_attention"
"""The `config.layer_types` entry of a Gated DeltaNet layer."""


@dataclass(frozen=True)
class Family:
    """One supported model type.

    `module`: the transformers modeling module whose kernel globals are rerouted.
    `single_residual`: the decoder layer keeps one residual stream (resid hooks exist);
    Qwen4-Exp's hyper-connections keep several, so it has none.
    `neg_eig_field`: text-config field that doubles beta (OLMo-Hybrid), or None.
    `channel_gate`: Kimi Delta Attention (one log decay per key channel) instead of Gated DeltaNet.
    `auto_class`: the transformers Auto class that builds the model from its folder.
    `since`: the first transformers (major, minor) that ships the family, where later than TRANSFORMERS_RANGE's start.
    `ssd`: Mamba-2 (SSD) layers (scalar decay, no removal) instead of Gated DeltaNet.
    `resid_mid`: the linear layer's output is added to the residual as it is (x + mixer(norm(x))), so
    `hook_resid_mid` means pre + mixer output; False where a multiplier or a parallel branch comes between.
    """

    model_type: str
    label: str
    module: str
    single_residual: bool = True
    neg_eig_field: str | None = None
    channel_gate: bool = False
    auto_class: str = "AutoModelForCausalLM"
    since: tuple[int, int] | None = None
    ssd: bool = False
    resid_mid: bool = True

    @property
    def kernels(self) -> tuple[str, ...]:
        """The module globals (chunked, recurrent) the linear layers call (SSD: the chunked scan only; a decoding
        step with a cache runs transformers' own `mamba2_selective_state_update`, unhooked)."""
        if self.ssd:
            return SSD_KERNELS
        return KDA_KERNELS if self.channel_gate else GDN_KERNELS

    @property
    def linear_types(self) -> tuple[str, ...]:
        """`config.layer_types` entries of the layers deltalab hooks."""
        return SSD_LAYER_TYPES if self.ssd else (LINEAR,)

    @property
    def mixer(self) -> str:
        """Attribute of the decoder layer that holds the linear layer."""
        return "self_attn" if self.channel_gate else "linear_attn"

    @property
    def layer_kind(self) -> str:
        """What the family's recurrent layers are, for messages and summaries."""
        if self.ssd:
            return "Mamba-2"
        return "Kimi Delta Attention" if self.channel_gate else "Gated DeltaNet"


GDN_KERNELS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
KDA_KERNELS = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")
SSD_KERNELS = ("mamba2_chunk_scan",)
SSD_LAYER_TYPES = ("linear_attention", "hybrid")
"""Layer types holding a Mamba-2 mixer: "hybrid" is Falcon-H1's parallel attention + mixer and Zamba2's shared
transformer block followed by a mixer."""


def _ssd(model_type: str, label: str, resid_mid: bool = True) -> Family:
    return Family(model_type, label, f"transformers.models.{model_type}.modeling_{model_type}", ssd=True,
                  resid_mid=resid_mid)


_FAMILIES = (
    Family("olmo_hybrid", "OLMo-Hybrid", "transformers.models.olmo_hybrid.modeling_olmo_hybrid",
           neg_eig_field="linear_allow_neg_eigval"),
    Family("qwen3_next", "Qwen3-Next", "transformers.models.qwen3_next.modeling_qwen3_next"),
    Family("qwen3_5", "Qwen3.5", "transformers.models.qwen3_5.modeling_qwen3_5"),
    Family("qwen3_5_text", "Qwen3.5 (text)", "transformers.models.qwen3_5.modeling_qwen3_5"),
    Family("qwen3_5_moe", "Qwen3.5-MoE", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"),
    Family("qwen3_5_moe_text", "Qwen3.5-MoE (text)", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"),
    Family("lara_mini", "Lara-Mini", "transformers.models.lara_mini.modeling_lara_mini", since=(5, 24)),
    Family("qwen4_exp", "Qwen4-Exp", "transformers.models.qwen4_exp.modeling_qwen4_exp", single_residual=False),
    Family("qwen4_exp_text", "Qwen4-Exp (text)", "transformers.models.qwen4_exp.modeling_qwen4_exp",
           single_residual=False),
    Family("kimi_linear", "Kimi Linear", "transformers.models.kimi_linear.modeling_kimi_linear", channel_gate=True),
    Family("bailing_hybrid", "Bailing hybrid", "transformers.models.bailing_hybrid.modeling_bailing_hybrid",
           channel_gate=True),
    Family("glm5_next", "GLM5-Next", "transformers.models.glm5_next.modeling_glm5_next", channel_gate=True,
           single_residual=False, auto_class="AutoModelForImageTextToText"),  # hyper-connections, like Qwen4-Exp
    _ssd("mamba2", "Mamba-2"),
    _ssd("bamba", "Bamba"),
    _ssd("nemotron_h", "Nemotron-H"),
    _ssd("granitemoehybrid", "Granite 4.0-H", resid_mid=False),  # residual_multiplier scales the mixer output
    _ssd("falcon_h1", "Falcon-H1", resid_mid=False),  # attention and mixer in parallel
    _ssd("zamba2", "Zamba2", resid_mid=False),  # shared transformer block before the mixer
)

FAMILIES: dict[str, Family] = {f.model_type: f for f in _FAMILIES}
"""model_type (config.json) -> Family."""



def supported_types() -> str:
    """Comma-separated list for error messages."""
    return ", ".join(FAMILIES)


def family_of(model_type: str) -> Family | None:
    """The Family of `model_type`, or None when deltalab does not open it through transformers."""
    return FAMILIES.get(model_type)
