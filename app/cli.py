"""The `deltalab` command line. Each sub-command lives in its own module and is registered here."""

from __future__ import annotations

import typer

from deltalab.app import (
    cmd_app,
    cmd_generate,
    cmd_info,
    cmd_patch,
    cmd_probe,
    cmd_prune,
    cmd_store,
    cmd_tasks,
    cmd_train,
    cmd_train_lm,
)

app = typer.Typer(
    name="deltalab",
    help="Interpretability workbench for DeltaNet / Gated DeltaNet / DeltaProduct linear RNNs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

app.command("info")(cmd_info.info)
app.command("data")(cmd_tasks.data)
app.command("train", cls=cmd_train_lm.TrainCommand)(cmd_train.train)  # + `train lm`
app.command("eval")(cmd_train.evaluate)
app.command("capture")(cmd_store.capture)
app.command("generate")(cmd_generate.generate_command)
app.add_typer(cmd_store.store_app, name="store")
cmd_prune.register(app)  # `prune`: a checkpoint study, not a store probe
app.add_typer(cmd_probe.probe_app, name="probe")
app.command("patch")(cmd_patch.patch)
app.command("app")(cmd_app.app_command)


def main() -> None:
    """Console-script entry point: usage errors become one line (`error: CMD: what (see 'CMD --help')`)."""
    import sys

    from typer.exceptions import TyperException  # base of the click exceptions typer vendors

    try:
        code = app(prog_name="deltalab", standalone_mode=False)
    except TyperException as err:
        ctx = getattr(err, "ctx", None)
        if type(err).__name__ == "NoArgsIsHelpError" and ctx is not None:  # a bare group: show its help
            print(ctx.get_help(), file=sys.stderr)
            sys.exit(2)
        cmd = ctx.command_path if ctx is not None else "deltalab"
        message = err.format_message() if hasattr(err, "format_message") else str(err)
        print(f"error: {cmd}: {message} (see '{cmd} --help')", file=sys.stderr)
        sys.exit(getattr(err, "exit_code", 2) or 2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
