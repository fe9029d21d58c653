"""The first-use build (capture + probes into a cached store) in its own process, independent of any browser tab.

`start(out, checkpoint, spec)` launches `python -m deltalab.app.build_job` detached from the server's session
(closing a tab or the server does not stop it) unless one is already running for `out`; the job writes its progress
to `OUT.progress.json` beside the store, which every tab reads (`read_progress`), so a second tab sees the same bar.
Progress moves inside each step: the capture's sequences and each probe's blocks and interventions are counted
through their progress bars. torch gets a thread count chosen for the machine (`build_threads`): on a loaded
2-core machine torch's default threads oversubscribe the cores and cost many times one thread's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

PROGRESS_SUFFIX = ".progress.json"
LOG_SUFFIX = ".build.log"
WRITE_EVERY_S = 0.3
_STARTING = threading.Lock()


def progress_path(out: Path) -> Path:
    return Path(out).with_name(Path(out).name + PROGRESS_SUFFIX)


def build_threads(cpus: int | None = None, load: float | None = None) -> int:
    """torch threads for the build: half the cores the process may use, less what other work keeps busy, 1 to 4
    (the bundled model's matrices are small: more threads than free cores only wait on each other)."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if load is None:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return max(1, min(4, cpus // 2, int(cpus - load)))


def _alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except (OSError, ValueError, TypeError):
        return False
    return True


def read_progress(out: Path) -> dict[str, Any] | None:
    """The build's last report: {fraction, message, captured, done, error, pid, started, updated}, or None when no
    build was started for `out`. A job that died without saying so reads as an error."""
    try:
        info = json.loads(progress_path(out).read_text())
    except (OSError, ValueError):
        return None
    if not info.get("done") and not info.get("error") and not _alive(info.get("pid")):
        log = Path(out).with_name(Path(out).name + LOG_SUFFIX)
        info["error"] = f"the build stopped without finishing (see {log}); start it again"
    return info


def running(out: Path) -> bool:
    info = read_progress(out)
    return info is not None and not info.get("done") and not info.get("error")


def wait_running(out: Path, timeout_s: float = 120.0) -> dict[str, Any]:
    """Wait until the build has run its first batch (checkpoint and data are good), failed, or finished, at most
    `timeout_s`: `deltalab app CHECKPOINT` reports a bad checkpoint in one line before it starts the server."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = read_progress(out) or {}
        if info.get("running") or info.get("captured") or info.get("done") or info.get("error") \
                or time.monotonic() > deadline:
            return info
        time.sleep(0.2)


def restart(out: Path) -> dict[str, Any]:
    """Start a failed or stopped build of `out` again, from the checkpoint and data it was started with."""
    info = read_progress(out) or {}
    ckpt = info.get("checkpoint")
    return start(out, Path(ckpt) if ckpt else None, info.get("spec"))


def _write(out: Path, info: dict[str, Any]) -> None:
    path = progress_path(out)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**info, "updated": time.time()}))
    tmp.replace(path)  # atomic: a reader sees the old report or the new one


def start(out: Path, checkpoint: Path | None = None, spec: str | None = None) -> dict[str, Any]:
    """Launch the build of `out` in a detached process unless one is running; returns its progress report."""
    out = Path(out)
    with _STARTING:
        info = read_progress(out)
        if info is not None and not info.get("done") and not info.get("error"):
            return info
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "deltalab.app.build_job", "--out", str(out)]
        if checkpoint is not None:
            cmd += ["--checkpoint", str(checkpoint)]
        if spec is not None:
            cmd += ["--spec", spec]
        threads = str(build_threads())
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TQDM_DISABLE": "0"}
        with open(out.with_name(out.name + LOG_SUFFIX), "w") as log:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        info = {"fraction": 0.0, "message": "starting the build", "captured": False, "done": False, "error": None,
                "pid": proc.pid, "started": time.time(), "threads": int(threads),
                "checkpoint": None if checkpoint is None else str(checkpoint), "spec": spec}
        _write(out, info)
        return info


class _Reporter:
    """Combines the build's step reports with the progress bars inside each step into one progress file."""

    STEP = re.compile(r"\(step (\d+)/(\d+)\)")

    def __init__(self, out: Path, threads: int) -> None:
        self.out, self.last = out, 0.0
        before = read_progress(out) or {}  # what start() recorded: the checkpoint and data to start again from
        self.info: dict[str, Any] = {"fraction": 0.0, "message": "starting the build", "captured": False,
                                     "done": False, "error": None, "pid": os.getpid(),
                                     "started": before.get("started") or time.time(), "threads": threads,
                                     "checkpoint": before.get("checkpoint"), "spec": before.get("spec")}
        self.base, self.width, self.step_message = 0.0, 0.0, ""

    def step(self, fraction: float, message: str) -> None:
        m = self.STEP.search(message)
        self.base, self.step_message = fraction, message
        self.width = 1.0 / int(m.group(2)) if m else 0.0
        if message.startswith("probe") or fraction >= 1.0:
            self.info["captured"] = True  # the capture is complete: pages can open while the probes fill in
        self.info.update(fraction=fraction, message=message)
        self.flush(force=True)

    def inner(self, n: float, total: float | None, desc: str, unit: str) -> None:
        if not total:
            return
        part = min(1.0, n / total)
        self.info["running"] = True  # the checkpoint loaded and its data built: a batch ran
        self.info["fraction"] = self.base + self.width * part
        self.info["message"] = f"{self.step_message}: {desc or 'working'} {int(n)}/{int(total)} {unit}"
        self.flush()

    def flush(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last >= WRITE_EVERY_S:
            self.last = now
            _write(self.out, self.info)


def _count_progress_bars(reporter: _Reporter) -> None:
    """Make every tqdm bar opened after this (capture's sequences, the probes' blocks) report to `reporter`,
    drawing nothing: the capture and probes run with their bars off, so they are switched on, into /dev/null."""
    import tqdm.auto
    import tqdm.std

    sink = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process

    class Counting(tqdm.std.tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.update(disable=False, file=sink, mininterval=WRITE_EVERY_S)
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            shown = super().update(n)
            reporter.inner(self.n, self.total, str(self.desc or ""), str(self.unit or ""))
            return shown

    tqdm.auto.tqdm = Counting


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deltalab.app.build_job",
                                     description="Build a cached dashboard store (capture + probes), with progress "
                                                 "in OUT.progress.json.")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--checkpoint", type=Path, default=None)
    parser.add_argument("--spec", default=None)
    args = parser.parse_args(argv)
    threads = int(os.environ.get("OMP_NUM_THREADS") or build_threads())
    reporter = _Reporter(args.out, threads)
    reporter.flush(force=True)
    import torch

    torch.set_num_threads(threads)
    _count_progress_bars(reporter)
    from deltalab.app.default_store import DefaultStoreError, ensure_default_store

    try:
        ensure_default_store(reporter.step, checkpoint=args.checkpoint, out=args.out, spec=args.spec)
    except (DefaultStoreError, ValueError, OSError) as err:
        reporter.info["error"] = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        reporter.flush(force=True)
        print(f"error: {reporter.info['error']}", file=sys.stderr)
        return 2
    reporter.info.update(done=True, captured=True, fraction=1.0, finished=time.time())
    reporter.flush(force=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
