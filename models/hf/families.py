"""Which Hugging Face model types hold Gated DeltaNet layers, and how to read them.

Each family's linear layers are `<decoder layers>[i].linear_attn` (`config.layer_types[i] ==
"linear_attention"`); every family calls the module globals `torch_chunk_gated_delta_rule` and
`torch_recurrent_gated_delta_rule` of its modeling module, which deltalab reroutes (models.hf.route).
"""

from __future__ import annotations

from dataclasses import dataclass

TRANSFORMERS_RANGE = ((5, 23), (6, 0))
"""Supported transformers versions: >= 5.23, < 6 (the modeling code read for these families)."""

TRANSFORMERS_SPEC = "transformers>=5.23,<6"


@dataclass(frozen=True)
class Family:
    """One supported model type.

    `module`: the transformers modeling module whose kernel globals are rerouted.
    `single_residual`: the decoder layer keeps one residual stream (resid hooks exist);
    Qwen4-Exp's hyper-connections keep several, so it has none.
    `neg_eig_field`: text-config field that doubles beta (OLMo-Hybrid), or None.
    """

    model_type: str
    label: str
    module: str
    single_residual: bool = True
    neg_eig_field: str | None = None


_FAMILIES = (
    Family("olmo_hybrid", "OLMo-Hybrid", "transformers.models.olmo_hybrid.modeling_olmo_hybrid",
           neg_eig_field="linear_allow_neg_eigval"),
    Family("qwen3_next", "Qwen3-Next", "transformers.models.qwen3_next.modeling_qwen3_next"),
    Family("qwen3_5", "Qwen3.5", "transformers.models.qwen3_5.modeling_qwen3_5"),
    Family("qwen3_5_text", "Qwen3.5 (text)", "transformers.models.qwen3_5.modeling_qwen3_5"),
    Family("qwen3_5_moe", "Qwen3.5-MoE", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"),
    Family("qwen3_5_moe_text", "Qwen3.5-MoE (text)", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"),
    Family("qwen4_exp", "Qwen4-Exp", "transformers.models.qwen4_exp.modeling_qwen4_exp", single_residual=False),
    Family("qwen4_exp_text", "Qwen4-Exp (text)", "transformers.models.qwen4_exp.modeling_qwen4_exp",
           single_residual=False),
)

FAMILIES: dict[str, Family] = {f.model_type: f for f in _FAMILIES}
"""model_type (config.json) -> Family."""

LINEAR = "linear_attention"
"""The `config.layer_types` entry of a Gated DeltaNet layer."""


def supported_types() -> str:
    """Comma-separated list for error messages."""
    return ", ".join(FAMILIES)


def family_of(model_type: str) -> Family | None:
    """The Family of `model_type`, or None when deltalab does not open it through transformers."""
    return FAMILIES.get(model_type)
