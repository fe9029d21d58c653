"""Causal experiments: activation patching, state patching that propagates, attribution patching and exact
state gradients, on deltalab's models (see docs/patching.md).

    from deltalab.probes.patching import activation_patching
    ds = activation_patching(model, clean_ids, corrupted_ids, "logit-diff:3,5", hooks=["resid_pre", "o"])
    ds.patched.sel(hook="o", position=-1)   # layer x head
"""

from deltalab.probes.patching.gradients import attribution_patching, perturbation_outputs, state_gradients
from deltalab.probes.patching.hooks import HOOKS, ActPatch
from deltalab.probes.patching.metrics import Metric, PatchingError, normalise
from deltalab.probes.patching.runs import Run, patched_logits
from deltalab.probes.patching.states import StatePart, StatePatch, token_states
from deltalab.probes.patching.sweeps import activation_patching, state_patching

__all__ = ["HOOKS", "ActPatch", "Metric", "PatchingError", "Run", "StatePart", "StatePatch", "activation_patching",
           "attribution_patching", "normalise", "patched_logits", "perturbation_outputs", "state_gradients",
           "state_patching", "token_states"]
