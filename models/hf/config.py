"""The fields deltalab reads from a model config, for a transformers Gated DeltaNet model.

Capture, probes and the dashboard read `num_heads`, `head_k_dim`, ... from deltalab's own
ModelConfig; `HFModelConfig` offers the same names (heads = value heads), plus what grouped heads
and hybrids add: `num_key_heads`, `key_head_of` and `delta_layers` (the real indices of the
linear layers).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from deltalab.models.hf.families import LINEAR, Family


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float spelled as a string ("inf"): stores keep plain JSON, and Mamba-2
    configs hold `time_step_limit = (0.0, inf)`."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


@dataclass
class HFModelConfig:
    """deltalab's view of a transformers model config (text part of vision-language configs)."""

    model_type: str
    family: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_key_heads: int
    head_k_dim: int
    head_v_dim: int
    delta_layers: list[int]
    layer_types: list[str]
    allow_neg_eigval: bool = False
    single_residual: bool = True
    num_householder: int = 1
    use_forget_gate: bool = True
    use_beta: bool = True
    use_short_conv: bool = True
    conv_size: int = 4
    gate: str = "scalar"  # "scalar" (Gated DeltaNet, g [B,T,H]) or "channel" (Kimi Delta Attention, g [B,T,H,dk])
    removal: bool = True  # False for Mamba-2 (SSD): no -beta k k^T S term, no beta, every write whole
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    hf_config: dict[str, Any] = field(default_factory=dict)

    @property
    def key_head_of(self) -> list[int]:
        """Key head read by each value head (j // (Hv / Hk))."""
        group = self.num_heads // self.num_key_heads
        return [j // group for j in range(self.num_heads)]

    @property
    def num_value_heads(self) -> int:
        """Heads of v, beta, g, o and the state (`num_heads` here)."""
        return self.num_heads

    @property
    def grouped(self) -> bool:
        return self.num_key_heads != self.num_heads

    @classmethod
    def from_hf(cls, config: Any, family: Family) -> HFModelConfig:
        """Read a transformers PreTrainedConfig (the text config of a vision-language one)."""
        text = config.get_text_config()
        layer_types = list(text.layer_types)
        neg = bool(getattr(text, family.neg_eig_field, False)) if family.neg_eig_field else False
        if family.ssd:
            return cls._from_ssd(config, text, family, layer_types)
        if family.channel_gate:  # Kimi Delta Attention: one head count, dk = dv
            heads = k_heads = int(text.linear_num_heads)
            dk = dv = int(text.linear_head_dim)
        else:
            heads, k_heads = int(text.linear_num_value_heads), int(text.linear_num_key_heads)
            dk, dv = int(text.linear_key_head_dim), int(text.linear_value_head_dim)
        return cls(
            model_type=family.model_type, family=family.label, num_hidden_layers=int(text.num_hidden_layers),
            hidden_size=int(text.hidden_size), vocab_size=int(text.vocab_size),
            num_heads=heads, num_key_heads=k_heads, head_k_dim=dk, head_v_dim=dv,
            gate="channel" if family.channel_gate else "scalar",
            delta_layers=[i for i, t in enumerate(layer_types) if t == LINEAR], layer_types=layer_types,
            allow_neg_eigval=neg, single_residual=family.single_residual,
            conv_size=int(getattr(text, "linear_conv_kernel_dim", 4)),
            pad_token_id=getattr(text, "pad_token_id", None), bos_token_id=getattr(text, "bos_token_id", None),
            eos_token_id=getattr(text, "eos_token_id", None), hf_config=config.to_dict(),
        )

    @classmethod
    def _from_ssd(cls, config: Any, text: Any, family: Family, layer_types: list[str]) -> HFModelConfig:
        """Mamba-2: heads = SSD heads, key heads = n_groups, dk = d_state, dv = head_dim (docs/mamba2.md)."""

        def first(*names: str) -> int:
            return int(next(getattr(text, n) for n in names if getattr(text, n, None) is not None))

        return cls(
            model_type=family.model_type, family=family.label, num_hidden_layers=int(text.num_hidden_layers),
            hidden_size=int(text.hidden_size), vocab_size=int(text.vocab_size),
            num_heads=first("mamba_n_heads", "mamba_num_heads", "n_mamba_heads", "num_heads"),
            num_key_heads=first("mamba_n_groups", "mamba_ngroups", "n_groups"),
            head_k_dim=first("mamba_d_state", "ssm_state_size", "state_size"),
            head_v_dim=first("mamba_d_head", "mamba_headdim", "mamba_head_dim", "head_dim"),
            delta_layers=[i for i, t in enumerate(layer_types) if t in family.linear_types], layer_types=layer_types,
            single_residual=family.single_residual, use_beta=False, removal=False,
            conv_size=first("mamba_d_conv", "conv_kernel"),
            pad_token_id=getattr(text, "pad_token_id", None), bos_token_id=getattr(text, "bos_token_id", None),
            eos_token_id=getattr(text, "eos_token_id", None), hf_config=json_safe(config.to_dict()),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (stored as the store's `model_config`), with `key_head_of` spelled out."""
        out = asdict(self)
        out["key_head_of"] = self.key_head_of
        return out
