"""`deltalab app [STORE | CHECKPOINT]`: launch the Streamlit dashboard on localhost (headless), on a store, on a
checkpoint folder (captured and probed into a cached store first) or on the bundled default."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

from deltalab.app.errors import fail


def streamlit_argv(store: Path | None, port: int, host: str) -> list[str]:
    """The command line that serves the dashboard (python -m deltalab.app.serve HOST PORT [STORE]: streamlit's st.App
    with the first page's modules imported while the server starts)."""
    argv = [sys.executable, "-m", "deltalab.app.serve", host, str(port)]
    if store is not None:
        argv.append(str(store))
    return argv


def _checkpoint_store(checkpoint: Path) -> Path:
    """The cached store of `checkpoint`: opened as it is when built, else built in a background process (capture +
    probes) while the server starts, so the browser shows the build's progress instead of "connection refused"."""
    from deltalab.app import build_job
    from deltalab.app.default_store import DefaultStoreError, checkpoint_data_spec, checkpoint_store_path, is_built
    from deltalab.models import CheckpointError

    out = checkpoint_store_path(checkpoint)
    try:
        spec = checkpoint_data_spec(checkpoint)
        if is_built(out, checkpoint, spec=spec):
            return out
    except (DefaultStoreError, CheckpointError, ValueError, OSError) as err:
        fail(str(err).strip().splitlines()[0])
    build_job.start(out, checkpoint.resolve(), spec)
    info = build_job.wait_running(out)  # a bad checkpoint or data fails here, in one line, before the server starts
    if info.get("error"):
        fail(str(info["error"]))
    typer.echo(f"{checkpoint} is a checkpoint: building its store {out} in the background (pid {info['pid']}, "
               f"log {out.with_name(out.name + build_job.LOG_SUFFIX)}); the page shows the progress", err=True)
    return out


def app_command(
    store: Path | None = typer.Argument(None, metavar="STORE|CHECKPOINT",
                                        help="Store folder written by `deltalab capture`, or a checkpoint folder "
                                             "(fla or transformers; captured over its task or sample text and "
                                             "probed into a cached store on first use). Default: the bundled S4 "
                                             "store."),
    port: int = typer.Option(8501, "--port", "-p", help="Port to serve on."),
    host: str = typer.Option("127.0.0.1", "--host",
                             help="Address to bind (default localhost only; 0.0.0.0 exposes it to the network)."),
    root: list[Path] = typer.Option([], "--root", metavar="FOLDER",
                                    help="Let shared links (?store=, ?cmp_store=, ?input_checkpoint=) open stores "
                                         "and checkpoints under FOLDER (repeatable). Without it a link opens only "
                                         "the store the server was started with and the cached stores."),
) -> None:
    """Open the dashboard: betas, key PCA in 3-D, spectra on the complex plane, effective rank over time, probes."""
    if store is not None and store.is_dir():
        from deltalab.app.default_store import is_checkpoint_folder

        if is_checkpoint_folder(store):
            store = _checkpoint_store(store)
    if store is not None:
        import deltalab.store as store_mod
        from deltalab.app import build_job

        try:
            if not build_job.running(store):  # a store being built is checked by the page once it exists
                store_mod.check_store(store)
        except store_mod.StoreError as err:
            fail(str(err))
        store = store.resolve()
    else:
        from deltalab.app.default_store import bundled_checkpoint, default_store_path, has_bundled_checkpoint, is_built

        if is_built():
            typer.echo(f"no STORE given: opening the default store {default_store_path()}", err=True)
        elif has_bundled_checkpoint():
            typer.echo(f"no STORE given: the dashboard builds the default store from {bundled_checkpoint()} into "
                       f"{default_store_path()} on first use (progress shown in the page)", err=True)
        else:
            typer.echo(f"no STORE given and the bundled checkpoint {bundled_checkpoint()} is not installed: "
                       "the page explains how to open a store", err=True)
    if not 0 < port < 65536:
        fail(f"--port {port} is not a TCP port; pass 1..65535")
    for folder in root:
        if not folder.is_dir():
            fail(f"--root {folder} is not a folder: pass a folder that holds stores or checkpoints")
    if root:
        from deltalab.app.dash.roots import ENV_ROOTS

        os.environ[ENV_ROOTS] = os.pathsep.join(str(f.resolve()) for f in root)  # read by the server's pages
    typer.echo(f"deltalab dashboard: http://{'localhost' if host in ('127.0.0.1', 'localhost') else host}:{port}"
               "  (Ctrl+C to stop)", err=True)
    argv = streamlit_argv(store, port, host)
    sys.stdout.flush()
    sys.stderr.flush()
    if os.name == "posix":
        os.execv(argv[0], argv)  # the server replaces this process: signals and exit codes are its own
    import subprocess

    raise typer.Exit(subprocess.call(argv))
