"""One writer per store: an advisory lock held for a whole capture, and the cleanup of what interrupted renames leave.

The lock is `fcntl.flock` on `.<store name>.lock` beside the store (the store itself may not exist yet: capture
builds it as `.<name>.creating-<pid>` and renames it into place). The kernel drops the lock when its holder dies,
even by kill -9, so a stale lock file never blocks; its holder writes its pid into it (shown to the one refused)
and removes it on release. A second capture into the same `--out` is refused before it creates anything.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
from pathlib import Path

from deltalab.store.errors import StoreError


class StoreLockedError(StoreError):
    """Another process is writing the store."""


def lock_path(store: Path) -> Path:
    """The lock file of the store at `store`: beside it, hidden."""
    return store.parent / f".{store.name}.lock"


class StoreLock:
    """`with StoreLock(out):` holds the store's lock (StoreLockedError, one line, when another process holds it)."""

    def __init__(self, store: str | Path) -> None:
        self.store = Path(store)
        self.path = lock_path(self.store)
        self._fd: int | None = None

    def acquire(self) -> None:
        if not self.path.parent.is_dir():
            self.path.parent.mkdir(parents=True, exist_ok=True)  # as creating the store would
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
                os.close(fd)
                who = f" (pid {holder})" if holder.isdigit() else ""
                raise StoreLockedError(
                    f"another capture{who} is writing {self.store}: wait for it to finish (then rerun this command "
                    "to resume or append), or pass another --out") from None
            try:  # the holder before us may have removed the file between our open and our lock: lock the new one
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # while still holding it: whoever opens it next re-checks the inode
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> StoreLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def remove_creating_leftovers(store: Path) -> list[Path]:
    """Remove `.<name>.creating-<pid>` folders beside `store` that an interrupted creation left (call with the
    store's lock held: only the lock holder creates). Returns what was removed."""
    removed = []
    for stale in store.parent.glob(f".{glob_escape(store.name)}.creating-*"):
        if stale.is_dir() and not stale.is_symlink() and re.fullmatch(r"\d+", stale.name.rpartition("-")[2]):
            shutil.rmtree(stale, ignore_errors=True)
            removed.append(stale)
    return removed


def glob_escape(name: str) -> str:
    """`name` with glob's special characters taken literally."""
    return re.sub(r"([*?\[])", r"[\1]", name)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (this process counts)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_OLD = re.compile(r"^\.old-(?P<name>.+)-(?P<pid>\d+)$")


def recover_results(store: str | Path) -> list[str]:
    """Finish or undo the renames of probe runs that died between them (probes.results.ResultSink publishes a run
    as: results/NAME -> results/.old-NAME-PID, results/.partial-NAME -> results/NAME, remove the old one).

    For each `.old-NAME-PID` of a process no longer running: NAME there -> remove the old group; else the finished
    `.partial-NAME` takes NAME; else the old group is put back as NAME. Nothing outside `store/results` is touched.
    Returns the result names recovered."""
    import json

    root = Path(store) / "results"
    if not root.is_dir() or root.is_symlink():
        return []
    done = []
    for old in sorted(p for p in root.rglob(".old-*") if p.is_dir() and not p.is_symlink()):
        m = _OLD.match(old.name)
        if m is None or pid_alive(int(m["pid"])):
            continue
        final, partial = old.with_name(m["name"]), old.with_name(f".partial-{m['name']}")
        if not final.exists():
            try:
                finished = json.loads((partial / "zarr.json").read_text())["attributes"].get("complete") is True
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                finished = False
            (partial if finished else old).rename(final)
        if old.exists():
            shutil.rmtree(old, ignore_errors=True)
        done.append(final.relative_to(root).as_posix())
    return done
