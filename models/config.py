"""One config for the whole family, read from and written back to fla's `config.json` fields."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

MODEL_TYPES = ("gated_deltaproduct", "delta_net", "gated_deltanet")


class ConfigError(ValueError):
    """A config.json that deltalab cannot build a model from."""


@dataclass
class ModelConfig:
    """Normalised view of fla's GatedDeltaProduct / DeltaNet / GatedDeltaNet configs.

    DeltaNet is n_h = 1 without forget gate; Gated DeltaNet is n_h = 1 with one.
    `extra` keeps every config.json field we do not model, so a save round-trips it.
    """

    model_type: str = "gated_deltaproduct"
    vocab_size: int = 32000
    hidden_size: int = 2048
    num_hidden_layers: int = 21
    num_heads: int = 6
    head_dim: int = 256  # key head dim (dk)
    expand_v: float = 2.0  # dv = head_dim * expand_v (delta_net: value_dim = hidden * expand_v)
    expand_k: float = 1.0  # delta_net only: key_dim = hidden * expand_k
    num_householder: int = 1
    use_forget_gate: bool = False
    use_output_gate: bool = True
    use_short_conv: bool = True
    conv_size: int = 4
    conv_bias: bool = False
    allow_neg_eigval: bool = False
    use_beta: bool = True
    qk_activation: str = "silu"
    qk_norm: str = "l2"
    output_gate_activation: str = "swish"
    hidden_ratio: int | None = 4
    intermediate_size: int | None = None
    hidden_act: str = "swish"
    norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ConfigError(
                f"unknown model_type {self.model_type!r}: deltalab loads {', '.join(MODEL_TYPES)}"
            )
        if self.model_type == "delta_net":
            key_dim = self.hidden_size * self.expand_k
            if key_dim % self.num_heads:
                raise ConfigError(f"hidden_size*expand_k={key_dim} is not divisible by num_heads={self.num_heads}")
            self.head_dim = int(key_dim // self.num_heads)
            self.num_householder, self.use_forget_gate = 1, False
        if self.model_type == "gated_deltanet":
            self.num_householder, self.use_forget_gate = 1, True
        if self.num_householder < 1:
            raise ConfigError(f"num_householder must be >= 1, got {self.num_householder}")
        if self.hidden_act != "swish":
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported: use 'swish'")

    @property
    def head_k_dim(self) -> int:
        return self.head_dim

    @property
    def head_v_dim(self) -> int:
        if self.model_type == "delta_net":
            return int(self.hidden_size * self.expand_v) // self.num_heads
        return int(self.head_dim * self.expand_v)

    @property
    def mlp_size(self) -> int:
        """fla's GatedMLP width: 2/3 * hidden * ratio rounded up to a multiple of 256."""
        if self.intermediate_size is not None:
            return self.intermediate_size
        size = int(self.hidden_size * (self.hidden_ratio or 4) * 2 / 3)
        return 256 * ((size + 255) // 256)

    # --- fla config.json <-> ModelConfig ---------------------------------------------------

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from a config.json dict (fla field names; older `use_gate` accepted)."""
        raw = dict(raw)
        model_type = raw.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ConfigError(
                f"unknown model_type {model_type!r}: deltalab loads {', '.join(MODEL_TYPES)}"
            )
        if raw.get("attn"):
            raise ConfigError("hybrid checkpoints with softmax-attention layers ('attn' in config) are not supported")
        if raw.get("attnres_block_size") is not None:
            raise ConfigError("attention-residual checkpoints ('attnres_block_size') are not supported")
        if model_type == "gated_deltanet" and raw.get("num_v_heads") not in (None, raw.get("num_heads")):
            raise ConfigError("grouped value heads (num_v_heads != num_heads) are not supported yet")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra", "use_output_gate"}
        kwargs: dict[str, Any] = {k: raw.pop(k) for k in list(raw) if k in names}
        gate = raw.pop("use_output_gate", raw.pop("use_gate", None))
        raw.pop("use_gate", None)
        if gate is not None:
            kwargs["use_output_gate"] = bool(gate)
        elif model_type == "delta_net":
            kwargs["use_output_gate"] = False
        return cls(**kwargs, extra=raw)

    def to_dict(self) -> dict[str, Any]:
        """fla-compatible config.json contents for this model type."""
        common = [
            "vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "use_short_conv", "conv_size",
            "allow_neg_eigval", "hidden_ratio", "intermediate_size", "hidden_act", "norm_eps",
            "tie_word_embeddings", "pad_token_id",
        ]
        per_type = {
            "gated_deltaproduct": ["head_dim", "expand_v", "num_householder", "use_forget_gate", "use_output_gate"],
            "delta_net": ["expand_k", "expand_v", "use_beta", "qk_activation", "qk_norm"],
            "gated_deltanet": ["head_dim", "expand_v", "output_gate_activation"],
        }[self.model_type]
        out: dict[str, Any] = dict(self.extra)
        out.update({name: getattr(self, name) for name in common + per_type})
        if self.model_type != "gated_deltaproduct":
            out["use_gate"] = self.use_output_gate
        out["model_type"] = self.model_type
        out.setdefault("architectures", [_ARCHITECTURES[self.model_type]])
        return out


_ARCHITECTURES = {
    "gated_deltaproduct": "GatedDeltaProductForCausalLM",
    "delta_net": "DeltaNetForCausalLM",
    "gated_deltanet": "GatedDeltaNetForCausalLM",
}
