"""docs/benchmarks.md from benchmark JSON: `python -m benchmarks.report RESULTS.json ... > docs/benchmarks.md`.

Each file is one run of `python -m benchmarks.kernels --json OUT` (keys `device`, `torch`, `triton`, `fla`,
`started`, and the sections `forward`, `real`, `accuracy` it ran). A file may add `cuda`, `commit` and `command`
(the command line that made it) and a free-text `note`; missing facts print as "?". Every section becomes one
Markdown table under the command that made it and one machine line (GPU, CUDA, torch, Triton, fla, commit,
date). The page holds no history: regenerate it from new files, and git keeps the old page.

A benchmark that prints its table without `--json` can be recorded as a table file instead: `{"kind": "table",
"title", "command", "description", "columns": [...], "rows": [[...], ...]}` with the same machine keys and `note`;
it is rendered as given.

A file that is not such a run is refused in one line naming the file and what was expected (exit code 2),
before anything is printed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable
from pathlib import Path

SECTIONS = ("forward", "real", "accuracy")
FIX = "pass the file written by `python -m benchmarks.kernels --json`, or a table file (`kind: table`)"
DEFAULT_COMMAND = "python -m benchmarks.kernels --json OUT"


class ReportError(ValueError):
    """A results file the report cannot read: one line naming the file and the fix."""


def _num(x, fmt: str) -> str:
    """`x` formatted, or "–" where the run has no value (None, NaN)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return format(x, fmt)


def _ratio(x) -> str:
    return "–" if _num(x, ".2f") == "–" else f"{x:.2f}x"


def _table(head: list[str], rows: Iterable[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def machine_line(run: dict) -> str:
    """One line: GPU, CUDA, torch, Triton, fla, commit, date (the date part of `started`)."""
    fla = str(run.get("fla", "?"))
    fla = fla[4:] if fla.startswith("fla ") else fla
    date = str(run.get("started", "?")).split(" ")[0]
    parts = [
        f"{run.get('device', 'GPU ?')}",
        f"CUDA {run.get('cuda', '?')}",
        f"torch {run.get('torch', '?')}",
        f"Triton {run.get('triton', '?')}",
        f"fla {fla}",
        f"commit {run.get('commit', '?')}",
        date,
    ]
    return "Machine: " + ", ".join(parts) + "."


def forward_table(rows: list[dict]) -> list[str]:
    """The grid: one row per (B, T), one column per (n_h, gate); cells fla / ours o+fin."""
    cols = sorted({(r["n_h"], bool(r["gate"])) for r in rows})
    cells = {(r["B"], r["T"], r["n_h"], bool(r["gate"])): r.get("speedup_o_final_vs_fla") for r in rows}
    head = ["B x T"] + [f"n_h={n} {'on' if g else 'off'}" for n, g in cols]
    sizes = sorted({(r["B"], r["T"]) for r in rows})
    out = _table(head, ([f"{b} x {t}"] + [_ratio(cells.get((b, t, n, g))) for n, g in cols] for b, t in sizes))
    judged = [r for r in rows if _num(r.get("speedup_o_final_vs_fla"), "g") != "–"]
    if judged:
        worst = min(judged, key=lambda r: r["speedup_o_final_vs_fla"])
        gate = "on" if worst["gate"] else "off"
        out += ["", f"Worst point: B = {worst['B']}, T = {worst['T']}, n_h = {worst['n_h']}, gate {gate}, "
                    f"{_ratio(worst['speedup_o_final_vs_fla'])} (ours o+fin {_num(worst.get('ours_o_final_ms'), '.3f')}"
                    f" ms, fla {_num(worst.get('fla_ms'), '.3f')} ms)."]
    return out


def _size(r: dict) -> str:
    if r.get("varlen"):
        lengths = r.get("lengths") or []
        return f"packed ({len(lengths)} docs)" if lengths else "packed"
    return f"{r['B']}x{r['T']}"


def real_table(rows: list[dict]) -> list[str]:
    """The real-model rows: times in ms, ratios fla / ours for o+fin and strict, ours strict over the memory floor."""
    head = ["shape", "Hk/Hv", "dk/dv", "B x T", "ours o+fin ms", "fla ms", "fla / o+fin", "fla / strict",
            "x memory floor (strict)"]
    body = ([r["shape"], f"{r['Hk']}/{r['Hv']}", f"{r['K']}/{r['V']}", _size(r), _num(r.get("ours_o_final_ms"), ".3f"),
             _num(r.get("fla_ms"), ".3f"), _ratio(r.get("speedup_o_final_vs_fla")), _ratio(r.get("speedup_vs_fla")),
             _num(r.get("x_mem_floor"), ".1f")] for r in rows)
    return _table(head, body)


def accuracy_table(rows: list[dict]) -> list[str]:
    """Largest relative error against float64 per (kernel, dtype), over the variants (n_h, gate) the run has."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["kernel"], r["dtype"]), []).append(r)

    def worst(rs: list[dict], key: str) -> str:
        vals = [r.get(key) for r in rs if _num(r.get(key), "g") != "–"]
        return _num(max(vals), ".1e") if vals else "–"

    body = ([k, d, worst(rs, "o"), worst(rs, "final"), worst(rs, "boundary")] for (k, d), rs in groups.items())
    return _table(["kernel", "dtype", "o", "final", "boundary"], body)


TITLES = {
    "forward": ("Delta-rule forward: the grid", "fla / ours o+fin (ours returning what fla returns: o and the final "
                "state); H = 8, dk = dv = 128, bf16; each side's fastest of the rounds' medians, the sides in turns.",
                forward_table),
    "real": ("Delta-rule forward: real-model shapes", "bf16, gate on, beta in (0, 2); o+fin: ours returning o and "
             "the final state; strict: ours also writing fp32 boundary states every 64 tokens; packed: documents of "
             "mixed lengths, fla with `cu_seqlens`.", real_table),
    "accuracy": ("Delta-rule forward: accuracy", "max |x - ref| / max |ref| against a float64 token loop on the same "
                 "rounded inputs, the largest over the run's variants.", accuracy_table),
}


def _check_table(path: Path, run: dict) -> None:
    """A table file: a title, its columns, and rows as long as the columns."""
    cols, rows = run.get("columns"), run.get("rows")
    if not run.get("title") or not isinstance(cols, list) or not isinstance(rows, list) or not rows:
        raise ReportError(f"{path}: a table file needs \"title\", \"columns\" and non-empty \"rows\"")
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != len(cols):
            raise ReportError(f"{path}: row {i} has {len(row) if isinstance(row, list) else 'no'} cells, "
                              f"the table {len(cols)} columns")


def table_section(path: Path, run: dict) -> list[str]:
    """A table file's section: title, command, description, machine line, the table as given, its note."""
    what = f" {run['description']}" if run.get("description") else ""
    out = [f"## {run['title']}", "", f"`{run.get('command', '?')}` ({path.name}).{what}", "", machine_line(run), ""]
    out += _table([str(c) for c in run["columns"]], ([str(c) for c in row] for row in run["rows"])) + [""]
    if run.get("note"):
        out += [f"Note: {run['note']}", ""]
    return out


def load_run(path: Path) -> dict:
    """A `benchmarks.kernels --json` file, checked to hold at least one section, or a table file."""
    try:
        run = json.loads(path.read_text())
    except FileNotFoundError:
        raise ReportError(f"{path}: no such file; {FIX}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ReportError(f"{path}: not JSON ({exc}); {FIX}") from None
    if isinstance(run, dict) and run.get("kind") == "table":
        _check_table(path, run)
        return run
    if not isinstance(run, dict) or not any(isinstance(run.get(s), list) for s in SECTIONS):
        raise ReportError(f"{path}: no {', '.join(SECTIONS)} section; {FIX}")
    return run


def _as_given(paths: Iterable[Path]) -> str:
    """The files as one would type them: `DIR/*.json` when they are exactly that folder's JSON files in order."""
    paths = list(paths)
    folder = paths[0].parent
    if len(paths) > 1 and paths == sorted(folder.glob("*.json")):
        return f"{folder.as_posix()}/*.json"
    return " ".join(p.as_posix() for p in paths)


def render(runs: list[tuple[Path, dict]]) -> str:
    """The whole page for the runs in order."""
    names = _as_given(p for p, _ in runs)
    out = ["# Benchmarks", "",
           f"Generated by `python -m benchmarks.report {names} > docs/benchmarks.md` from the benchmarks' `--json` "
           "output; edit the results files or rerun the benchmarks, not this page. GPU numbers only count on a "
           "GPU; a ratio above 1 means deltalab is faster.", ""]
    for path, run in runs:
        if run.get("kind") == "table":
            out += table_section(path, run)
            continue
        command = run.get("command", DEFAULT_COMMAND)
        for section in SECTIONS:
            rows = run.get(section)
            if not isinstance(rows, list) or not rows:
                continue
            title, what, table = TITLES[section]
            out += [f"## {title}", "", f"`{command}` ({path.name}). {what}", "", machine_line(run), ""]
            out += table(rows) + [""]
        if run.get("note"):
            out += [f"Note ({path.name}): {run['note']}", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path, help="JSON files written by the benchmarks' --json")
    args = ap.parse_args(argv)
    try:
        runs = [(p, load_run(p)) for p in args.results]
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(render(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
