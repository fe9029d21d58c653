"""The `deltalab` command line. Each sub-command lives in its own module and is registered here."""

from __future__ import annotations

import typer

from app import cmd_store, cmd_tasks, cmd_train

app = typer.Typer(
    name="deltalab",
    help="Interpretability workbench for DeltaNet / Gated DeltaNet / DeltaProduct linear RNNs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

app.command("data")(cmd_tasks.data)
app.command("train")(cmd_train.train)
app.command("eval")(cmd_train.evaluate)
app.command("capture")(cmd_store.capture)
app.add_typer(cmd_store.store_app, name="store")


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
