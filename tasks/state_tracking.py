"""State-tracking tasks: seeded generators, a registry by name, and the word-problem CSV format.

Every task maps a sequence of input tokens to a sequence of labels of the same length; positions that
carry no label hold ``IGNORE_INDEX`` (-100). Names (``get_task``):

- ``S4``, ``A5``, ``Z60``, ``D8``, ``S3xZ2`` (or ``S3_x_Z2``): group word problems (see tasks.groups);
  input tokens are element indices, the label at i is x_1 * ... * x_i.
- ``S5swaps``: S5 with inputs drawn from the identity and the 10 transpositions (tokens stay S5 indices,
  labels cover all of S5). ``S5m3``: inputs are permutations moving at most 3 points (any ``S<n>m<k>``).
- ``parity``: bits, label at i is the parity of x_1..x_i (the Z2 word problem on {0, 1}).
- ``modarith``: ``2 + 1 - 2 * 2 - 3 = [PAD]...`` modulo 5 with the usual precedence (Deletang et al. 2023,
  as in the DeltaProduct appendix); only the ``=`` position is labelled, with the value.
- ``modarith_brackets``: Deletang's bracketed grammar (+, -, * and unary minus), same layout;
  ``modarith_brackets_nomult`` drops ``*``.
"""

from __future__ import annotations

import csv
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from deltalab.kernels.constants import IGNORE_INDEX
from deltalab.tasks.groups import Group, GroupSpecError, parse_group, symmetric


class TaskError(ValueError):
    """Bad task name, length, sample count or data file."""


# peak host bytes a token while a data set is generated and held (int64 inputs and labels, the sampling's
# intermediates, then the capture's int32 copies): 24 measured for generate() alone on S4, A5, Z60 and parity
GENERATE_BYTES_PER_TOKEN = 40


def _physical_memory() -> int:
    """This machine's physical memory in bytes (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


@dataclass
class Task:
    """Base class: a named generator of (inputs, labels) with fixed vocabulary and label classes."""

    name: str
    vocab_size: int
    num_classes: int
    description: str = ""
    token_names: tuple[str, ...] = field(default=(), repr=False)
    variable_length: bool = False  # whether `min_length` (sequences shorter than `length`, padded) applies

    def sample(self, rng: np.random.Generator, length: int, samples: int,
               min_length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Draw ``samples`` sequences of ``length`` tokens from ``rng``; int64 arrays [N, L]."""
        raise NotImplementedError

    def generate(self, length: int, samples: int, seed: int,
                 min_length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Deterministic data set: same (length, samples, seed) -> same tensors, int64 [N, L]."""
        self.check(length, samples, min_length)
        x, y = self.sample(np.random.default_rng(seed), length, samples, min_length)
        return torch.from_numpy(x), torch.from_numpy(y)

    def min_sequence_length(self) -> int:
        return 1

    def check(self, length: int, samples: int, min_length: int | None = None) -> None:
        """Raise TaskError with a one-line fix for impossible sizes."""
        lo = self.min_sequence_length()
        if length < lo:
            raise TaskError(f"--length {length} is too short for {self.name}; use at least {lo}")
        if samples < 1:
            raise TaskError(f"--samples {samples} must be at least 1")
        need, total = length * samples * GENERATE_BYTES_PER_TOKEN, _physical_memory()
        if total and need > total:
            raise TaskError(f"--samples {samples} x --length {length} need about {need / 1e9:,.1f} GB of memory to "
                            f"generate, more than this machine's {total / 1e9:,.1f} GB; use fewer samples")
        if min_length is not None:
            if not self.variable_length:
                raise TaskError(f"{self.name} has fixed-length sequences; drop --min-length")
            if not lo <= min_length <= length:
                raise TaskError(f"--min-length {min_length} must lie in [{lo}, {length}] for {self.name}")

    def spec(self) -> dict:
        """JSON-able description stored beside checkpoints."""
        return {"name": self.name, "vocab_size": self.vocab_size, "num_classes": self.num_classes,
                "description": self.description}


@dataclass
class GroupWordTask(Task):
    """Word problem of a finite group, inputs drawn uniformly from `inputs` (default: every element)."""

    group: Group | None = field(default=None, repr=False)
    inputs: np.ndarray | None = field(default=None, repr=False)

    def sample(self, rng, length, samples, min_length=None):
        choices = np.arange(self.group.order) if self.inputs is None else self.inputs
        x = choices[rng.integers(0, len(choices), size=(samples, length))]
        return x.astype(np.int64), self.group.scan(x)


@dataclass
class ParityTask(Task):
    """Running parity of a bit string, every position labelled."""

    def sample(self, rng, length, samples, min_length=None):
        x = rng.integers(0, 2, size=(samples, length), dtype=np.int64)
        return x, np.cumsum(x, axis=1) % 2


# ----------------------------------------------------------------------------- modular arithmetic

_OPS = ("+", "-", "*")


@dataclass
class ModArithTask(Task):
    """Modular arithmetic (Deletang et al. 2023): expression, '=', then [PAD]; the '=' position is labelled.

    Tokens: digits 0..m-1 are ids 0..m-1 (so a label is the digit's own id), then ``+ - *``, then
    ``( )`` (brackets variant only), ``=``, ``[PAD]``. Without brackets the expression has odd length
    (number, op, number, ...); with brackets it is Deletang's random grammar of exactly the given length.
    """

    modulus: int = 5
    brackets: bool = False
    mult: bool = True

    @property
    def symbols(self) -> tuple[str, ...]:
        return tuple(str(d) for d in range(self.modulus)) + _OPS + (("(", ")") if self.brackets else ()) + (
            "=", "[PAD]")

    def token_id(self, symbol: str) -> int:
        return self.symbols.index(symbol)

    def min_sequence_length(self) -> int:
        return 2  # one digit and '='

    def _lengths(self, rng, length, samples, min_length):
        """Total (expression + '=') length of each sample."""
        if min_length is None:
            return np.full(samples, length, dtype=np.int64)
        return rng.integers(min_length, length + 1, size=samples)

    def sample(self, rng, length, samples, min_length=None):
        totals = self._lengths(rng, length, samples, min_length)
        x = np.full((samples, length), self.token_id("[PAD]"), dtype=np.int64)
        y = np.full((samples, length), IGNORE_INDEX, dtype=np.int64)
        if self.brackets:
            for s in range(samples):
                expr, value = bracket_expression(rng, self.modulus, int(totals[s]) - 1, self.mult)
                ids = [self.token_id(c) for c in expr]
                x[s, : len(ids)] = ids
                x[s, len(ids)] = self.token_id("=")
                y[s, len(ids)] = value
            return x, y
        expr_len = totals - 1 - (totals % 2 == 1)  # largest odd length that leaves room for '='
        nums = rng.integers(0, self.modulus, size=(samples, (length + 1) // 2))
        ops = rng.integers(0, 2 + int(self.mult), size=(samples, length // 2))
        full = np.empty((samples, length), dtype=np.int64)
        full[:, 0::2] = nums
        full[:, 1::2] = self.modulus + ops
        rows = np.arange(samples)
        x = np.where(np.arange(length)[None, :] < expr_len[:, None], full, self.token_id("[PAD]"))
        x[rows, expr_len] = self.token_id("=")
        y[rows, expr_len] = _evaluate_flat(nums, ops, expr_len // 2, self.modulus)
        return x, y


def _evaluate_flat(nums: np.ndarray, ops: np.ndarray, n_ops: np.ndarray, m: int) -> np.ndarray:
    """Value of n0 o1 n1 o2 ... with * before + and - (op ids 0 '+', 1 '-', 2 '*'), modulo m."""
    total = np.zeros(len(nums), dtype=np.int64)
    term = nums[:, 0].astype(np.int64)
    for k in range(min(ops.shape[1], nums.shape[1] - 1)):
        active = k < n_ops
        op, nxt = ops[:, k], nums[:, k + 1]
        new_total = np.where(op == 2, total, (total + term) % m)
        new_term = np.where(op == 0, nxt, np.where(op == 1, (-nxt) % m, (term * nxt) % m))
        total = np.where(active, new_total, total)
        term = np.where(active, new_term, term)
    return (total + term) % m


def bracket_expression(rng: np.random.Generator, m: int, length: int, mult: bool) -> tuple[str, int]:
    """Deletang et al.'s bracketed expression of exactly `length` characters and its value mod m."""
    if length < 1:
        raise TaskError(f"cannot build a bracketed expression of length {length}; use length >= 1")
    if length <= 4:
        d = int(rng.integers(0, m))
        return [f"{d}", f"-{d}", f"({d})", f"(-{d})"][length - 1], (d if length in (1, 3) else -d) % m
    left_len = int(rng.integers(1, length - 3))
    left, lv = bracket_expression(rng, m, left_len, mult)
    right, rv = bracket_expression(rng, m, length - left_len - 3, mult)
    op = int(rng.integers(0, 3 if mult else 2))
    value = (lv + rv, lv - rv, lv * rv)[op] % m
    return f"({left}{_OPS[op]}{right})", value


# ----------------------------------------------------------------------------- registry

_RESTRICTED = re.compile(r"S(\d+)(?:swaps|m(\d+))")
_FIXED = {
    "parity": lambda: ParityTask("parity", 2, 2, "running parity of a bit string", ("0", "1")),
    "modarith": lambda: _modarith("modarith", brackets=False, mult=True),
    "modarith_brackets": lambda: _modarith("modarith_brackets", brackets=True, mult=True),
    "modarith_brackets_nomult": lambda: _modarith("modarith_brackets_nomult", brackets=True, mult=False),
}
TASK_EXAMPLES = ("S4", "A5", "Z60", "D8", "S3xZ2", "S5swaps", "S5m3", *_FIXED)


def _modarith(name: str, brackets: bool, mult: bool) -> ModArithTask:
    t = ModArithTask(name, 0, 5, "", modulus=5, brackets=brackets, mult=mult, variable_length=True)
    t.vocab_size = len(t.symbols)
    t.token_names = t.symbols
    t.description = (f"arithmetic mod 5 {'with' if brackets else 'without'} brackets"
                     f"{'' if mult else ' (no *)'}; label at '='")
    return t


def get_task(name: str) -> Task:
    """The task called `name` (see module docstring); TaskError names the choices."""
    key = name.strip()
    if key.lower() in _FIXED:
        return _FIXED[key.lower()]()
    m = _RESTRICTED.fullmatch(key)
    if m is not None:
        n = int(m.group(1))
        moved = 2 if m.group(2) is None else int(m.group(2))
        group = symmetric(n)
        allowed = np.flatnonzero(group.moved_points() <= moved)
        what = "identity and transpositions" if moved == 2 else f"permutations moving <= {moved} points"
        return GroupWordTask(key, group.order, group.order, f"S{n} word problem, inputs: {what}",
                             group.element_names, group=group, inputs=allowed)
    try:
        group = parse_group(key)
    except GroupSpecError as err:
        raise TaskError(f"unknown task {name!r}: choose one of {', '.join(TASK_EXAMPLES)} "
                        f"(any S/A/Z/D<n> and products)") from err
    return GroupWordTask(group.name, group.order, group.order, f"{group.name} word problem",
                         group.element_names, group=group)


# ----------------------------------------------------------------------------- reference sampling

def reference_sequences(order: int, length: int, samples: int, seed: int) -> np.ndarray:
    """The sequences jopetty/word-problem's generate_data.py draws (Python `random`, unique, set order).

    Its loop is ``random.seed(seed)``; add ``tuple(random.choices(range(order), k=length))`` to a set
    until it holds `samples`; ``list(set)``. `random.choices` is ``floor(random() * order)`` per token, and
    numpy's legacy MT19937 doubles equal Python's, so we draw them in bulk from Python's seeded state.
    Memory grows like the reference's set: meant for reproducing its files, not for millions of rows.
    """
    samples = min(int(samples), int(order) ** int(length))
    state = random.Random(seed).getstate()[1]
    mt = np.random.RandomState()
    mt.set_state(("MT19937", np.array(state[:624], dtype=np.uint32), state[624]))
    seen: set[tuple[int, ...]] = set()
    while len(seen) < samples:
        draws = np.floor(mt.random_sample((samples - len(seen), length)) * order).astype(np.int64)
        for row in draws.tolist():
            seen.add(tuple(row))
            if len(seen) == samples:
                break
    return np.array(list(seen), dtype=np.int64).reshape(-1, length)


# ----------------------------------------------------------------------------- CSV

@dataclass
class CsvData:
    """Rows of a word-problem CSV: inputs and labels [N, L] (int64) and the seed column."""

    inputs: np.ndarray
    labels: np.ndarray
    seeds: list[str]


def write_csv(path: str | os.PathLike, inputs, labels, seed: int | str, progress: bool = False) -> Path:
    """Write `seed,input,target` rows (space-separated ints), atomically (temp file then rename)."""
    path = Path(path)
    x = np.asarray(inputs)
    y = np.asarray(labels)
    if x.shape != y.shape or x.ndim != 2:
        raise TaskError(f"inputs {x.shape} and labels {y.shape} must both be [N, L]")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    chunk = 8192
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(x), desc=f"write {path.name}", unit="row", unit_scale=True)
    try:
        with open(tmp, "w", newline="") as f:
            w = csv.writer(f, lineterminator="\n")
            w.writerow(["seed", "input", "target"])
            for start in range(0, len(x), chunk):
                xs, ys = x[start: start + chunk].tolist(), y[start: start + chunk].tolist()
                w.writerows([seed, " ".join(map(str, xr)), " ".join(map(str, yr))]
                            for xr, yr in zip(xs, ys, strict=True))
                if bar is not None:
                    bar.update(len(xs))
        os.replace(tmp, path)
    finally:
        if bar is not None:
            bar.close()
        tmp.unlink(missing_ok=True)
    return path


def read_csv(path: str | os.PathLike) -> CsvData:
    """Read a word-problem CSV (`seed,input,target`; the older `length,input,target` too).

    A target with one value per row (the older files' final product) becomes a label at the last
    position, IGNORE_INDEX elsewhere.
    """
    path = Path(path)
    if not path.is_file():
        raise TaskError(f"no such data file: {path}")
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or not {"input", "target"} <= set(reader.fieldnames):
            raise TaskError(f"{path}: header must contain 'input' and 'target' (seed,input,target)")
        seed_col = "seed" if "seed" in reader.fieldnames else reader.fieldnames[0]
        xs, ys, seeds = [], [], []
        for lineno, row in enumerate(reader, start=2):
            try:
                x = [int(v) for v in row["input"].split()]
                y = [int(v) for v in row["target"].split()]
            except (ValueError, AttributeError) as err:
                raise TaskError(f"{path}:{lineno}: input/target must be space-separated integers") from err
            if len(y) == 1 and len(x) > 1:
                y = [IGNORE_INDEX] * (len(x) - 1) + y
            if len(y) != len(x) or (xs and len(x) != len(xs[0])):
                raise TaskError(f"{path}:{lineno}: every row needs input and target of one common length")
            xs.append(x)
            ys.append(y)
            seeds.append(row.get(seed_col, ""))
    if not xs:
        raise TaskError(f"{path}: no rows")
    return CsvData(np.array(xs, dtype=np.int64), np.array(ys, dtype=np.int64), seeds)
