"""Fixtures shared by the trainer tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def corpus_root(tmp_path):
    """A fake standard library: 12 modules, plus an installed package and a cache that must be skipped."""
    root = tmp_path / "lib"
    for i in range(12):
        path = root / ("pkg" if i % 3 == 0 else "") / f"mod{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# module {i}\n" + f"def f(x):\n    return x * {i}\n" * (20 + i))
    for skipped in ("site-packages/extra.py", "__pycache__/mod1.py"):
        (root / skipped).parent.mkdir(parents=True, exist_ok=True)
        (root / skipped).write_text("SKIP = 1\n")
    return root
