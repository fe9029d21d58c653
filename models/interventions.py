"""Edits applied while a model generates: steering vectors, hook edits from a step on, state edits at decode time.

Every edit names a hook point (`layers.3.hook_resid_pre`, `layers.1.attn.hook_state`, ...) and runs as a forward
hook on it, so it acts on deltalab's own models and on transformers models (`models.hf.HookedHFModel`) alike, and
with or without the decoding cache. Generation steps count from 0: step 0 reads the prompt and picks the first new
token, step s >= 1 reads generated token s - 1 and picks token s. A forward call tells the edits which step each of
its positions belongs to (`StepContext.token_steps`), so an edit "from step s on" touches the same tokens whether a
step runs one token through the cache or the whole sequence again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn


class InterventionError(ValueError):
    """An edit that cannot apply to this model (unknown layer or hook, wrong vector width, unreadable file)."""


@dataclass
class StepContext:
    """What the running forward call is: `step` (the generation step) and `token_steps` [T] (the step each of
    its positions belongs to: 0 for the prompt, s for generated token s - 1)."""

    step: int = 0
    token_steps: torch.Tensor | None = None


@dataclass
class HookEdit:
    """`fn(value, context) -> new value` on hook point `hook` at every forward call of step `from_step` on (up to
    `to_step`, inclusive, when given). `fn` may also edit `value` in place and return it."""

    hook: str
    fn: Callable[[torch.Tensor, StepContext], torch.Tensor]
    from_step: int = 0
    to_step: int | None = None

    def active(self, step: int) -> bool:
        return step >= self.from_step and (self.to_step is None or step <= self.to_step)


@dataclass
class Steering:
    """Add `alpha * vector` ([hidden]) to the residual stream entering layer `layer` (its `hook_resid_pre`; pass
    `hook="hook_resid_post"` for the stream leaving it) at every token of step `from_step` on."""

    layer: int
    vector: torch.Tensor
    alpha: float = 1.0
    hook: str = "hook_resid_pre"
    from_step: int = 0

    def as_edit(self) -> HookEdit:
        def add(x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
            delta = (self.alpha * self.vector).to(device=x.device, dtype=x.dtype)
            steps = ctx.token_steps
            if steps is None or steps.numel() != x.shape[1]:
                return x + delta
            on = (steps.to(x.device) >= self.from_step).to(x.dtype)[None, :, None]
            return x + on * delta

        return HookEdit(f"layers.{self.layer}.{self.hook}", add, from_step=self.from_step)


@dataclass
class StateEdit:
    """At decode steps `from_step`..`to_step` (from 1; None: to the end) scale layer `layer`'s recurrent state
    before the token by `factor` (0 erases it), on `heads` (value-head indices; None: all). Acts on the entry
    `hook_state[:, 0]` of a one-token step, so the step's output and the carried state follow the edit."""

    layer: int
    factor: float = 0.0
    heads: list[int] | None = field(default=None)
    from_step: int = 1
    to_step: int | None = None

    def as_edit(self) -> HookEdit:
        def scale(states: torch.Tensor, _ctx: StepContext) -> torch.Tensor:
            if states.shape[1] != 2:  # only a one-token step (before, after) has its state before on entry 0
                return states
            out = states.clone()
            heads = slice(None) if self.heads is None else list(self.heads)
            out[:, 0, heads] = out[:, 0, heads] * self.factor
            return out

        return HookEdit(f"layers.{self.layer}.attn.hook_state", scale, max(self.from_step, 1), self.to_step)


Intervention = HookEdit | Steering | StateEdit


def as_edits(interventions: list[Intervention] | tuple[Intervention, ...]) -> list[HookEdit]:
    return [i if isinstance(i, HookEdit) else i.as_edit() for i in interventions]


def hook_module(model: nn.Module, name: str) -> nn.Module:
    """The hook point `name` of `model`; InterventionError naming the layers and hooks there are otherwise."""
    try:
        return model.get_submodule(name)
    except AttributeError:
        layers = getattr(model, "layers", [])
        parts = name.split(".")
        if len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit() and int(parts[1]) >= len(layers):
            raise InterventionError(f"layer {parts[1]} does not exist: the model has layers "
                                    f"0..{len(layers) - 1}") from None
        raise InterventionError(f"no hook point {name!r} in this model: hooks are named like "
                                "'layers.0.hook_resid_pre' or 'layers.0.attn.hook_state'") from None


def check_steering(model: nn.Module, steering: Steering) -> None:
    """One-line InterventionError for a steering vector that does not fit `model`."""
    hidden = int(model.config.hidden_size)
    if steering.vector.dim() != 1 or steering.vector.numel() != hidden:
        raise InterventionError(f"steering vector for layer {steering.layer} has shape "
                                f"{tuple(steering.vector.shape)}; the model's residual stream needs ({hidden},)")
    hook_module(model, f"layers.{steering.layer}.{steering.hook}")


@contextmanager
def applied(model: nn.Module, interventions: list[Intervention] | tuple[Intervention, ...],
            context: StepContext) -> Iterator[None]:
    """Install the edits as forward hooks for the duration; each fires when `context.step` is in its range."""
    for item in interventions:
        if isinstance(item, Steering):
            check_steering(model, item)
    edits = as_edits(interventions)
    handles = []
    try:
        for edit in edits:
            module = hook_module(model, edit.hook)

            def run(_mod, _args, out, edit=edit):
                return edit.fn(out, context) if edit.active(context.step) else out

            handles.append(module.register_forward_hook(run))
        yield
    finally:
        for h in handles:
            h.remove()


def load_vector(path: str | Path, key: str | None = None) -> torch.Tensor:
    """A steering vector from a safetensors file: its only tensor, or the one named `key` (flattened, float32)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    if not p.is_file():
        raise InterventionError(f"steering file {p} does not exist: pass a .safetensors file holding one vector")
    try:
        tensors = load_file(str(p))
    except (SafetensorError, OSError, ValueError) as err:
        raise InterventionError(f"{p} is not a readable safetensors file ({str(err).splitlines()[0]}): "
                                "save the vector with safetensors.torch.save_file") from None
    if key is not None:
        if key not in tensors:
            raise InterventionError(f"{p} has no tensor {key!r}; it holds {', '.join(sorted(tensors)) or 'none'}")
        return tensors[key].float().flatten()
    if len(tensors) != 1:
        raise InterventionError(f"{p} holds {len(tensors)} tensors ({', '.join(sorted(tensors)[:4])}): name the "
                                "one to use, or save a file with a single vector")
    return next(iter(tensors.values())).float().flatten()


@torch.no_grad()
def mean_residual(model: nn.Module, input_ids: torch.Tensor, layer: int, hook: str = "hook_resid_pre") -> torch.Tensor:
    """The residual stream at `layers.{layer}.{hook}` averaged over every token of input_ids [B, T]: [hidden]."""
    seen: list[torch.Tensor] = []
    handle = hook_module(model, f"layers.{layer}.{hook}").register_forward_hook(
        lambda _m, _a, out: seen.append(out.detach()))
    try:
        model(input_ids)
    finally:
        handle.remove()
    return seen[0].float().mean((0, 1))


def difference_vector(model: nn.Module, positive: torch.Tensor, negative: torch.Tensor, layer: int,
                      hook: str = "hook_resid_pre") -> torch.Tensor:
    """The steering vector mean residual(positive) - mean residual(negative) at layer `layer` ([hidden], the
    ActAdd / mean-difference recipe); positive, negative [B, T] token ids."""
    return mean_residual(model, positive, layer, hook) - mean_residual(model, negative, layer, hook)
