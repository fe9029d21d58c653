"""`deltalab app [STORE]`: launch the Streamlit dashboard on localhost (headless), on STORE or the bundled default."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

from app.errors import fail

DASHBOARD = Path(__file__).resolve().parent / "dashboard.py"


def streamlit_argv(store: Path | None, port: int, host: str) -> list[str]:
    """The command line that runs the dashboard (python -m streamlit run ... -- STORE)."""
    argv = [sys.executable, "-m", "streamlit", "run", str(DASHBOARD),
            "--server.address", host, "--server.port", str(port), "--server.headless", "true",
            "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none",
            "--theme.base", "light", "--client.toolbarMode", "minimal"]
    if store is not None:
        argv += ["--", str(store)]
    return argv


def app_command(
    store: Path | None = typer.Argument(None, metavar="STORE",
                                        help="Store folder written by `deltalab capture` (default: the bundled "
                                             "S4 store, captured and probed on first use)."),
    port: int = typer.Option(8501, "--port", "-p", help="Port to serve on."),
    host: str = typer.Option("127.0.0.1", "--host",
                             help="Address to bind (default localhost only; 0.0.0.0 exposes it to the network)."),
) -> None:
    """Open the dashboard: betas, key PCA in 3-D, spectra on the complex plane, effective rank over time, probes."""
    if store is not None:
        import store as store_mod

        try:
            store_mod.check_store(store)
        except store_mod.StoreError as err:
            fail(str(err))
        store = store.resolve()
    else:
        from app.default_store import bundled_checkpoint, default_store_path, has_bundled_checkpoint, is_built

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
    typer.echo(f"deltalab dashboard: http://{'localhost' if host in ('127.0.0.1', 'localhost') else host}:{port}"
               "  (Ctrl+C to stop)", err=True)
    argv = streamlit_argv(store, port, host)
    sys.stdout.flush()
    sys.stderr.flush()
    if os.name == "posix":
        os.execv(argv[0], argv)  # the server replaces this process: signals and exit codes are its own
    import subprocess

    raise typer.Exit(subprocess.call(argv))
