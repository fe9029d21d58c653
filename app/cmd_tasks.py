"""`deltalab data`: write a state-tracking data set in the word-problem CSV format (seed,input,target)."""

from __future__ import annotations

from pathlib import Path

import typer

from deltalab.app.errors import fail


def data(
    task: str = typer.Argument(..., help="S4, A5, Z60, D8, S3xZ2, S5swaps, S5m3, parity, modarith, "
                                         "modarith_brackets ..."),
    length: int = typer.Option(..., "--length", "-l", help="Tokens per sequence."),
    samples: int = typer.Option(..., "--samples", "-n", help="Number of sequences."),
    seed: int = typer.Option(0, "--seed", help="Seed; the same seed gives the same file."),
    out: Path = typer.Option(..., "--out", "-o", help="CSV file to write."),
    min_length: int | None = typer.Option(None, "--min-length",
                                          help="modarith tasks: draw each expression length in "
                                               "[min-length, length] and pad with [PAD]."),
    reference_rng: bool = typer.Option(False, "--reference-rng",
                                       help="Group tasks: draw the sequences exactly as "
                                            "jopetty/word-problem's generate_data.py does (Python "
                                            "`random`, unique rows); slow."),
    force: bool = typer.Option(False, "--force", help="Overwrite --out if it exists."),
) -> None:
    """Write TASK sequences and their labels as `seed,input,target` rows (space-separated indices)."""
    import numpy as np

    from deltalab.tasks.state_tracking import GroupWordTask, TaskError, get_task, reference_sequences, write_csv

    if out.exists() and not force:
        fail(f"{out} exists: pass --force to overwrite it or choose another --out")
    if out.is_dir():
        fail(f"--out {out} is a folder: give a file name such as {out / 'data.csv'}")
    try:
        t = get_task(task)
        t.check(length, samples, min_length)
        if reference_rng:
            if not isinstance(t, GroupWordTask) or t.inputs is not None:
                fail("--reference-rng applies to plain group word problems (S4, A5, S3xZ2 ...), "
                     f"not {t.name}")
            x = reference_sequences(t.group.order, length, samples, seed)
            inputs, labels = x, t.group.scan(x)
        else:
            inputs, labels = (a.numpy() for a in t.generate(length, samples, seed, min_length))
        write_csv(out, np.asarray(inputs), np.asarray(labels), seed, progress=True)
    except TaskError as err:
        fail(str(err))
    except OSError as err:
        fail(f"cannot write {out}: {err.strerror or err}")
    typer.echo(f"wrote {len(inputs)} sequences of {length} tokens ({t.name}, seed {seed}) to {out}")
