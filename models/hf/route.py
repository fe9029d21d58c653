"""Reroute a transformers modeling module's Gated DeltaNet kernel calls to deltalab's hooked adapter.

The layer looks its kernel up as a module global at call time, so deltalab replaces the global
once per modeling module with a router. A forward pre-hook on each hooked `linear_attn` marks
its adapter active (a context variable) for the duration of that layer's forward; the router
calls the active adapter, or the original kernel when none is (models that were not hooked run
exactly as before).
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from deltalab.models.hf.families import GDN_KERNELS

_ACTIVE: contextvars.ContextVar[nn.Module | None] = contextvars.ContextVar("deltalab_hf_active", default=None)


class PackedSequencesError(ValueError):
    """Packed sequences (cu_seqlens) reached a hooked layer: deltalab's hooks take one sequence per row."""


def _router(original: Callable) -> Callable:
    signature = inspect.signature(original)  # the transformers torch function's (functools.wraps)

    @functools.wraps(original)
    def routed(*args: Any, **kwargs: Any) -> Any:
        adapter = _ACTIVE.get()
        if adapter is None:
            return original(*args, **kwargs)
        if kwargs.get("cu_seqlens") is not None:
            raise PackedSequencesError("packed sequences (cu_seqlens) cannot pass deltalab's hooks: "
                                       "pass one sequence per row with an attention mask")
        call = signature.bind(*args, **kwargs).arguments  # names whatever was passed by position
        if hasattr(adapter, "route_call"):  # Mamba-2's scan: the adapter reads its own arguments
            return adapter.route_call(call)
        return adapter(call["query"], call["key"], call["value"], call["g"], call["beta"],
                       initial_state=call.get("initial_state"),
                       output_final_state=bool(call.get("output_final_state", False)),
                       use_qk_l2norm_in_kernel=bool(call.get("use_qk_l2norm_in_kernel", False)))

    routed.deltalab_original = original  # type: ignore[attr-defined]
    return routed


def install_router(module_name: str, names: tuple[str, ...] = GDN_KERNELS) -> None:
    """Replace the kernel globals `names` of `module_name` with routers (idempotent)."""
    module = importlib.import_module(module_name)
    for name in names:
        fn = getattr(module, name)
        if not hasattr(fn, "deltalab_original"):
            setattr(module, name, _router(fn))


def attach(layer: nn.Module, adapter: nn.Module) -> list[Any]:
    """Make `adapter` receive `layer`'s kernel calls; returns the hook handles (remove() detaches)."""
    tokens: list[contextvars.Token] = []

    def enter(_mod: nn.Module, _args: Any) -> None:
        tokens.append(_ACTIVE.set(adapter))

    def leave(_mod: nn.Module, _args: Any, _out: Any) -> None:
        if tokens:
            _ACTIVE.reset(tokens.pop())

    return [layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave, always_call=True)]
