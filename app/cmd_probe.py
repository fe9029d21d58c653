"""`deltalab probe NAME --store STORE [--checkpoint CKPT] [--json]`: run one of the probes/ analyses.

Each sub-command hands its arguments to the probe's own parser (`probes.base.run_module`), so
`deltalab probe NAME ...` and `python -m deltalab.probes.NAME ...` are the same program; `--help` after NAME
lists the probe's options.
"""

from __future__ import annotations

import typer

from deltalab.probes import PROBES, TYPED_INPUT  # names and one-line help only: no heavy imports

probe_app = typer.Typer(
    help="Analyses over a capture store; results go into STORE/results/NAME. "
         "`deltalab probe NAME --help` shows a probe's options (same as `python -m deltalab.probes.NAME --help`).",
    no_args_is_help=True,
)

_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def _register(name: str, help_text: str) -> None:
    @probe_app.command(name, help=help_text, context_settings=_PASS_THROUGH, add_help_option=False)
    def _command(ctx: typer.Context) -> None:
        from deltalab.probes.typed import wants_typed

        args = list(ctx.args)
        if name in TYPED_INPUT and wants_typed(args):  # --text / --tokens with a checkpoint, no store
            import importlib

            code = importlib.import_module(f"deltalab.probes.{name}").typed_main(args)
        else:
            from deltalab.probes.base import run_module

            code = run_module(name, args)
        if code:
            raise typer.Exit(code)


for _name, _help in PROBES.items():
    _register(_name, _help)
