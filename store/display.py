"""Store and checkpoint strings made inert for a terminal: metadata is data, never instructions to the screen.

A store's attributes (data spec, command line, created, model config, result names) are written by whoever
made the store. Printed raw, an escape sequence among them would move the cursor, retitle the terminal, hide
text or (with bidi overrides) reorder it. `inert` shows every such character as its escape instead.
"""

from __future__ import annotations

from typing import Any


def inert(text: Any) -> str:
    """`str(text)` with every non-printable character (control codes, escape, bidi overrides, newlines) shown
    as its Python escape (`\\x1b`, `\\u202e`, `\\n`), so one value prints as one harmless line."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def inert_tree(value: Any) -> Any:
    """`value` with `inert` applied to every string in it, keys included (dicts, lists and tuples walked)."""
    if isinstance(value, str):
        return inert(value)
    if isinstance(value, dict):
        return {inert_tree(k): inert_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(inert_tree(v) for v in value)
    return value
