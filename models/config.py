"""One config for the whole family, read from and written back to fla's `config.json` fields."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

MODEL_TYPES = ("gated_deltaproduct", "delta_net", "gated_deltanet", "kda", "rwkv7")


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
    hidden_act: str | None = None  # None: fla's default for the type ("swish"; rwkv7 "sqrelu")
    norm_eps: float | None = None  # None: fla's default for the type (1e-6; rwkv7 1e-5)
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    num_v_heads: int | None = None  # gated_deltanet: grouped value heads (None = num_heads)
    attn: dict[str, Any] | list[dict[str, Any]] | None = None  # hybrids: fla's softmax-attention layer specs
    max_position_embeddings: int | None = None
    lower_bound: float | None = None  # kda: bounded gate lower_bound * sigmoid(...) instead of -exp(A_log) softplus
    # rwkv7 (fla's RWKV7Config): low-rank widths (None: fla's sqrt(hidden) rule), norms, value width
    decay_low_rank_dim: int | None = None
    gate_low_rank_dim: int | None = None
    a_low_rank_dim: int | None = None
    v_low_rank_dim: int | None = None
    norm_first: bool = True  # rwkv7: a LayerNorm on the embeddings before layer 0
    norm_bias: bool = True  # rwkv7: LayerNorms with a bias
    fuse_norm: bool = True  # rwkv7: fla's fused norms (kappa = k / sqrt(|k|^2 + 1e-6)) vs torch's (max(|k|, 1e-12))
    value_dim: int | list[int] | None = None  # rwkv7: value width per layer (None: hidden_size)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ConfigError(
                f"unknown model_type {self.model_type!r}: deltalab loads {', '.join(MODEL_TYPES)}"
            )
        rwkv7 = self.model_type == "rwkv7"
        if self.hidden_act is None:
            self.hidden_act = "sqrelu" if rwkv7 else "swish"
        if self.norm_eps is None:
            self.norm_eps = 1e-5 if rwkv7 else 1e-6
        if self.model_type == "delta_net":
            key_dim = self.hidden_size * self.expand_k
            if key_dim % self.num_heads:
                raise ConfigError(f"hidden_size*expand_k={key_dim} is not divisible by num_heads={self.num_heads}")
            self.head_dim = int(key_dim // self.num_heads)
            self.num_householder, self.use_forget_gate = 1, False
        if self.model_type == "gated_deltanet":
            self.num_householder, self.use_forget_gate = 1, True
        if self.model_type == "kda":  # Kimi Delta Attention: a per-key-channel gate, a sigmoid output gate
            self.num_householder, self.use_forget_gate, self.use_output_gate = 1, True, True
            self.output_gate_activation = "sigmoid"
        if self.model_type == "rwkv7":
            self._rwkv7_post_init()
        if self.num_householder < 1:
            raise ConfigError(f"num_householder must be >= 1, got {self.num_householder}")
        if self.hidden_act != "swish" and self.model_type != "rwkv7":
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported: use 'swish'")
        if self.num_v_heads is not None:
            if self.model_type not in ("gated_deltanet", "kda") and self.num_v_heads != self.num_heads:
                raise ConfigError(f"num_v_heads={self.num_v_heads} != num_heads={self.num_heads}: fla groups value "
                                  "heads only in gated_deltanet")
            if self.num_v_heads < self.num_heads or self.num_v_heads % self.num_heads:
                raise ConfigError(f"num_v_heads={self.num_v_heads} must be a multiple of num_heads={self.num_heads}")
        self.attn_specs = parse_attention(self.attn, self.num_hidden_layers, self.hidden_size)

    def _rwkv7_post_init(self) -> None:
        """fla's RWKV7Config/RWKV7Attention rules: heads from head_dim, low-rank widths, one value width."""
        if self.hidden_act != "sqrelu":
            raise ConfigError(f"rwkv7 hidden_act {self.hidden_act!r} is not supported: fla's rwkv7 uses 'sqrelu'")
        if self.attn:
            raise ConfigError("rwkv7 with softmax-attention layers ('attn') is not supported: fla 0.6.0's RWKV7Block "
                              "cannot run them (it unpacks four outputs from its attention); drop 'attn'")
        D = self.hidden_size
        if self.head_dim:
            if D % self.head_dim:
                raise ConfigError(f"rwkv7 hidden_size={D} is not divisible by head_dim={self.head_dim}")
            self.num_heads = D // self.head_dim
        elif self.num_heads:
            self.head_dim = D // self.num_heads
        widths = self.value_dim if isinstance(self.value_dim, list) else [self.value_dim or D]
        if len(set(widths)) != 1 or widths[0] % self.num_heads or widths[0] < D:
            raise ConfigError(f"rwkv7 value_dim {self.value_dim!r} is not supported: deltalab (like fla's first-layer "
                              f"value residual) needs one width >= hidden_size divisible by num_heads={self.num_heads}")
        self.expand_v = widths[0] / D
        factor = self.head_dim / 64
        rule = {"decay_low_rank_dim": 2.5 * factor, "gate_low_rank_dim": 5.0, "a_low_rank_dim": 2.5 * factor,
                "v_low_rank_dim": 1.7 * factor}
        for name, mult in rule.items():  # fla: max(32, round(mult * sqrt(hidden) / 32) * 32)
            if getattr(self, name) is None:
                setattr(self, name, max(32, int(round(mult * D**0.5 / 32) * 32)))
        self.num_householder, self.use_forget_gate, self.use_output_gate = 1, True, True
        self.use_short_conv, self.use_beta = False, True

    @property
    def num_key_heads(self) -> int:
        """Heads of q and k (fla's `num_heads`)."""
        return self.num_heads

    @property
    def num_value_heads(self) -> int:
        """Heads of v, beta, g, o and the state (fla's `num_v_heads`, default `num_heads`)."""
        return self.num_v_heads or self.num_heads

    @property
    def grouped(self) -> bool:
        return self.num_value_heads != self.num_key_heads

    @property
    def key_head_of(self) -> list[int]:
        """Key head read by each value head (j // (Hv / Hk), fla's grouped value attention)."""
        group = self.num_value_heads // self.num_key_heads
        return [j // group for j in range(self.num_value_heads)]

    @property
    def gate(self) -> str:
        """"channel" (kda: one log decay per key channel), "scalar" (one per head) or "none"."""
        return "channel" if self.model_type in ("kda", "rwkv7") else "scalar" if self.use_forget_gate else "none"

    @property
    def delta_layers(self) -> list[int]:
        """Real indices of the delta-rule layers (every layer not given to softmax attention by `attn`)."""
        return [i for i in range(self.num_hidden_layers) if i not in self.attn_specs]

    @property
    def hybrid(self) -> bool:
        return bool(self.attn_specs)

    @property
    def head_k_dim(self) -> int:
        return self.head_dim

    @property
    def head_v_dim(self) -> int:
        if self.model_type == "delta_net":
            return int(self.hidden_size * self.expand_v) // self.num_heads
        if self.model_type == "rwkv7":
            return round(self.hidden_size * self.expand_v) // self.num_heads
        return int(self.head_dim * self.expand_v)

    @property
    def mlp_size(self) -> int:
        """fla's GatedMLP width: 2/3 * hidden * ratio rounded up to a multiple of 256."""
        if self.intermediate_size is not None:
            return self.intermediate_size
        if self.model_type == "rwkv7":  # fla's RWKV7FeedForward: hidden * ratio rounded up to a multiple of 32
            return 32 * ((int(self.hidden_size * (self.hidden_ratio or 4)) + 31) // 32)
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
        check_fields(raw)
        if raw.get("attnres_block_size") is not None:
            raise ConfigError("attention-residual checkpoints ('attnres_block_size') are not supported")
        if model_type == "rwkv7":  # fla's RWKV7Config defaults where config.json leaves a field out
            for name, value in _RWKV7_DEFAULTS.items():
                raw.setdefault(name, value)
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
            "kda": ["head_dim", "expand_v", "lower_bound"],
            "rwkv7": ["head_dim", "num_heads", "decay_low_rank_dim", "gate_low_rank_dim", "a_low_rank_dim",
                      "v_low_rank_dim", "norm_first", "norm_bias", "fuse_norm", "value_dim"],
        }[self.model_type]
        if self.model_type == "rwkv7":  # fla's RWKV7Config has no conv, eigenvalue or gate switches
            common = [n for n in common if n not in ("use_short_conv", "conv_size", "allow_neg_eigval")]
        out: dict[str, Any] = dict(self.extra)
        out.update({name: getattr(self, name) for name in common + per_type})
        for name in ("num_v_heads", "attn", "max_position_embeddings"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.model_type not in ("gated_deltaproduct", "kda", "rwkv7"):
            out["use_gate"] = self.use_output_gate
        out["model_type"] = self.model_type
        out.setdefault("architectures", [_ARCHITECTURES[self.model_type]])
        return out


# --- the schema of config.json's fields -----------------------------------------------------

_INT_RANGES: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 24), "hidden_size": (1, 1 << 17), "num_hidden_layers": (1, 4096),
    "num_heads": (1, 4096), "head_dim": (1, 1 << 14), "num_householder": (1, 64), "conv_size": (1, 256),
    "hidden_ratio": (1, 64), "intermediate_size": (1, 1 << 20), "pad_token_id": (0, 1 << 24),
    "num_v_heads": (1, 4096), "max_position_embeddings": (1, 1 << 40), "decay_low_rank_dim": (1, 1 << 16),
    "gate_low_rank_dim": (1, 1 << 16), "a_low_rank_dim": (1, 1 << 16), "v_low_rank_dim": (1, 1 << 16),
}
"""Integer fields and the values deltalab accepts (inclusive); wider ones are typos or hostile (memory)."""

_FLOAT_RANGES: dict[str, tuple[float, float]] = {
    "expand_v": (1e-3, 64.0), "expand_k": (1e-3, 64.0), "norm_eps": (0.0, 1.0), "lower_bound": (-1e6, 1e6),
}
"""Float fields (finite, an integer allowed) and their open..closed ranges."""

_BOOL_FIELDS = ("use_forget_gate", "use_output_gate", "use_gate", "use_short_conv", "conv_bias", "allow_neg_eigval",
                "use_beta", "tie_word_embeddings", "norm_first", "norm_bias", "fuse_norm")
_STR_FIELDS = ("model_type", "qk_activation", "qk_norm", "output_gate_activation", "hidden_act")
_OPTIONAL = ("hidden_ratio", "intermediate_size", "hidden_act", "norm_eps", "pad_token_id", "num_v_heads",
             "max_position_embeddings", "lower_bound", "decay_low_rank_dim", "gate_low_rank_dim", "a_low_rank_dim",
             "v_low_rank_dim", "value_dim", "use_gate", "use_output_gate")
"""Fields config.json may set to null (deltalab or fla then uses its default)."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _field_error(key: str, value: Any, want: str) -> ConfigError:
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return ConfigError(f"field {key!r} is {shown} ({type(value).__name__}): it must be {want}; fix it in config.json")


def check_fields(raw: dict[str, Any]) -> None:
    """Refuse a config.json field of the wrong type or range, in one ConfigError naming the key and the fix.

    Runs before anything is built from the config: `"12"` for an integer, null where a value is required,
    NaN, `"false"` for a boolean (which Python would read as True) and sizes past `_INT_RANGES` (a model
    too large to allocate) are refused here rather than met as a traceback or a silent misreading."""
    rwkv7 = raw.get("model_type") == "rwkv7"
    for key, value in raw.items():
        if value is None:
            if key in _OPTIONAL or (rwkv7 and key in ("num_heads", "head_dim")):
                continue
            if key in _INT_RANGES or key in _FLOAT_RANGES or key in _BOOL_FIELDS or key in _STR_FIELDS:
                raise _field_error(key, value, "set (it has no default when given as null); remove the line "
                                               "to take deltalab's default or give a value")
            continue
        if key in _INT_RANGES:
            low, high = _INT_RANGES[key]
            if not _is_int(value):
                raise _field_error(key, value, f"an integer {low}..{high}")
            if not low <= value <= high:
                raise _field_error(key, value, f"an integer {low}..{high}")
        elif key in _FLOAT_RANGES:
            low, high = _FLOAT_RANGES[key]
            if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value) or \
                    not low < value <= high:
                raise _field_error(key, value, f"a finite number in ({low:g}, {high:g}]")
        elif key in _BOOL_FIELDS:
            if not isinstance(value, bool):
                raise _field_error(key, value, "true or false (JSON booleans, not strings or numbers)")
        elif key in _STR_FIELDS:
            if not isinstance(value, str):
                raise _field_error(key, value, "a string")
        elif key == "value_dim":
            widths = value if isinstance(value, list) else [value]
            if not widths or not all(_is_int(w) and 1 <= w <= 1 << 18 for w in widths):
                raise _field_error(key, value, f"an integer 1..{1 << 18} or a list of them")


def parameter_count_floor(config: ModelConfig) -> int:
    """A lower bound on the model's parameter count from its config alone (embeddings, the projections and
    the MLP of every layer), cheap enough to check before anything is allocated."""
    D, V = config.hidden_size, config.vocab_size
    n_h = config.num_householder
    key_width = config.num_key_heads * config.head_k_dim
    value_width = config.num_value_heads * config.head_v_dim
    per_layer = D * (key_width * (1 + n_h) + value_width * (n_h + 1)) + 2 * D * config.mlp_size
    return V * D * (1 if config.tie_word_embeddings else 2) + config.num_hidden_layers * per_layer


def available_memory() -> int | None:
    """Bytes of memory available to allocate now (Linux MemAvailable, else free pages), None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def check_fits_memory(config: ModelConfig, bytes_per_parameter: int = 4, where: str = "config.json") -> None:
    """ConfigError in one line when the model's parameters alone would not fit in the memory available now
    (checked before the model is built, so an absurd size is refused rather than swapped or killed)."""
    need = parameter_count_floor(config) * bytes_per_parameter
    have = available_memory()
    if have is not None and need > have:
        raise ConfigError(f"{where} describes a model of at least {need / 1e9:.1f} GB "
                          f"({config.num_hidden_layers} layers, hidden_size {config.hidden_size}, vocab_size "
                          f"{config.vocab_size}) but {have / 1e9:.1f} GB of memory is available: check those sizes")


def parse_attention(attn: Any, num_layers: int, hidden_size: int) -> dict[int, dict[str, Any]]:
    """fla's `attn` field (one spec or a list) -> {layer index: spec with defaults}; one-line ConfigErrors.

    A spec gives `layers` and `num_heads`, optionally `num_kv_heads` (default num_heads), `qkv_bias` (False),
    `window_size` (None: full causal attention) and `rope_theta` (10000).
    """
    if not attn:
        return {}
    specs = [attn] if isinstance(attn, dict) else attn
    if not isinstance(specs, list) or not all(isinstance(s, dict) for s in specs):
        raise ConfigError(f"'attn' must be a dict or a list of dicts (fla's attention specs), got {attn!r}"[:200])
    out: dict[int, dict[str, Any]] = {}
    for spec in specs:
        if "layers" not in spec or "num_heads" not in spec:
            raise ConfigError(f"'attn' spec {spec!r} needs 'layers' and 'num_heads'"[:200])
        full = {"num_kv_heads": spec["num_heads"], "qkv_bias": False, "window_size": None, "rope_theta": 10000.0,
                **{k: v for k, v in spec.items() if v is not None or k != "num_kv_heads"}}
        heads, kv_heads = full["num_heads"], full["num_kv_heads"]
        if not all(isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in (heads, kv_heads)):
            raise ConfigError(f"'attn' num_heads/num_kv_heads must be positive integers, got {heads}, {kv_heads}")
        if heads % kv_heads or hidden_size % heads:
            raise ConfigError(f"'attn' num_heads={heads} must divide hidden_size={hidden_size} and be a multiple "
                              f"of num_kv_heads={kv_heads}")
        for i in spec["layers"]:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < num_layers:
                raise ConfigError(f"'attn' layer {i!r} is not a layer index 0..{num_layers - 1}")
            if i in out:
                raise ConfigError(f"'attn' assigns layer {i} twice")
            out[i] = full
    return out


_RWKV7_DEFAULTS: dict[str, Any] = {"head_dim": 64, "num_hidden_layers": 24, "decay_low_rank_dim": 64,
                                   "gate_low_rank_dim": 128, "a_low_rank_dim": 64, "v_low_rank_dim": 16}
"""fla 0.6.0's RWKV7Config defaults that differ from ModelConfig's."""

_ARCHITECTURES = {
    "gated_deltaproduct": "GatedDeltaProductForCausalLM",
    "delta_net": "DeltaNetForCausalLM",
    "gated_deltanet": "GatedDeltaNetForCausalLM",
    "kda": "KDAForCausalLM",
    "rwkv7": "RWKV7ForCausalLM",
}
