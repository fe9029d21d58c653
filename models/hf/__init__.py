"""Gated DeltaNet, Kimi Delta Attention and Mamba-2 (SSD) layers inside Hugging Face transformers models, with
deltalab's hook points.

    from deltalab.models.hf import load_hf_checkpoint
    model = load_hf_checkpoint("olmo-hybrid-folder")      # HookedHFModel
    NNsight(model).layers[0].attn.hook_beta               # same names as deltalab's own models

families: supported model types; loader: local folders; route + adapter (ssd_adapter for Mamba-2): the kernel
call replaced by deltalab's hooked forward; hooked: the wrapper exposing `layers.{i}`.
"""

from deltalab.models.hf.adapter import DeltaRuleHooks, key_head_of
from deltalab.models.hf.config import HFModelConfig
from deltalab.models.hf.families import FAMILIES, Family, family_of, supported_types
from deltalab.models.hf.hooked import HookedHFModel
from deltalab.models.hf.loader import check_transformers, load_hf_checkpoint
from deltalab.models.hf.ssd_adapter import SSDHooks

__all__ = [
    "FAMILIES",
    "DeltaRuleHooks",
    "Family",
    "HFModelConfig",
    "HookedHFModel",
    "SSDHooks",
    "check_transformers",
    "family_of",
    "key_head_of",
    "load_hf_checkpoint",
    "supported_types",
]
