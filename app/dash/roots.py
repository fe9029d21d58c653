"""What a URL may make the dashboard open: stores the server was started with or under a root it was given,
and checkpoints that are the store's own or under such a root.

A shared link carries query parameters (`?store=`, `?cmp_store=`, `?input_checkpoint=`) that anyone can
write. Paths a person types into their browser session's sidebar or fields are their choice; paths that arrive in a
URL are checked here first, and a refused one gets the same message whether or not it exists (nothing is
opened, listed or stat'ed to phrase it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ENV_STORE = "DELTALAB_STORE"
"""The store the server was started with (`deltalab app STORE` sets it)."""
ENV_ROOTS = "DELTALAB_ROOTS"
"""Folders (os.pathsep-separated) under which a link may open stores and checkpoints: `deltalab app --root`."""

REFUSED_STORE = ("This link names a store this dashboard was not started with, so it was not opened. Open it from "
                 "the sidebar (Open another store), or restart with `deltalab app --root FOLDER` to let links open "
                 "stores under FOLDER.")
REFUSED_CHECKPOINT = ("This link names a checkpoint that is neither the store's own nor under a folder the dashboard "
                      "was started with, so the store's own checkpoint is shown instead. Type another folder here "
                      "yourself to use it.")


def started_store() -> str | None:
    """STORE from `streamlit run app/dashboard.py -- STORE` (argv[0] is the script only under streamlit run), else
    $DELTALAB_STORE."""
    if sys.argv and Path(sys.argv[0]).name == "dashboard.py" and len(sys.argv) > 1 and sys.argv[1].strip():
        return sys.argv[1]
    return os.environ.get(ENV_STORE) or None


def _resolved(path: str | Path) -> Path | None:
    try:
        return Path(path).expanduser().resolve(strict=False)
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a NUL byte
        return None


def roots(started: str | Path | None = None) -> list[Path]:
    """The folders links may open: the store the server was started with (`started`, default started_store()),
    the default and cached checkpoint stores' folder, and every `$DELTALAB_ROOTS` entry."""
    from deltalab.app.default_store import cache_dir, default_store_path

    started = started or started_store()
    found = [started] if started else []
    found += [default_store_path(), cache_dir()]
    found += [p for p in os.environ.get(ENV_ROOTS, "").split(os.pathsep) if p.strip()]
    out = []
    for p in found:
        r = _resolved(p)
        if r is not None and r not in out:
            out.append(r)
    return out


def _under(path: Path, allowed: list[Path]) -> bool:
    return any(path == root or root in path.parents for root in allowed)


def store_permitted(path: str, started: str | Path | None = None) -> bool:
    """True when a store named in a URL lies in (or is) one of `roots(started)`; decided from the path alone."""
    if not isinstance(path, str) or not path.strip() or "\x00" in path:
        return False
    r = _resolved(path.strip())
    return r is not None and _under(r, roots(started))


def checkpoint_permitted(path: str, own: str | Path | None, started: str | Path | None = None) -> bool:
    """True when a checkpoint named in a URL is the store's own (`own`), the bundled one, or under a root."""
    from deltalab.app.default_store import bundled_checkpoint

    if not isinstance(path, str) or not path.strip() or "\x00" in path:
        return False
    r = _resolved(path.strip())
    if r is None:
        return False
    known = [_resolved(p) for p in (own, bundled_checkpoint()) if p]
    return r in known or _under(r, roots(started))
