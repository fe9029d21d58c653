"""Group tables, task generators, the word-problem CSV format and `deltalab data`."""

from __future__ import annotations

import ast
import itertools
import random

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from deltalab.app.cli import app
from deltalab.models import IGNORE_INDEX
from deltalab.tasks.groups import GroupSpecError, alternating, cyclic, dihedral, parse_group, symmetric
from deltalab.tasks.state_tracking import (
    TaskError,
    get_task,
    read_csv,
    reference_sequences,
    write_csv,
)

GROUPS = ["S3", "S4", "A4", "A5", "Z5", "Z12", "D3", "D4", "D5", "S3xZ2", "A4xZ3", "S3_x_Z2xZ2"]


# ----------------------------------------------------------------------------- group axioms

@pytest.mark.parametrize("name", GROUPS)
def test_group_axioms(name):
    g = parse_group(name)
    t = g.table.astype(np.int64)
    n = g.order
    assert t.shape == (n, n) and t.min() >= 0 and t.max() < n  # closure
    np.testing.assert_array_equal(t[0], np.arange(n))  # identity at index 0, both sides
    np.testing.assert_array_equal(t[:, 0], np.arange(n))
    inv = g.inverse
    np.testing.assert_array_equal(t[np.arange(n), inv], 0)  # inverses, both sides
    np.testing.assert_array_equal(t[inv, np.arange(n)], 0)
    for row in t:  # Latin square: every product appears once per row
        assert len(set(row.tolist())) == n
    a, b, c = np.meshgrid(np.arange(n), np.arange(n), np.arange(n), indexing="ij")
    np.testing.assert_array_equal(t[t[a, b], c], t[a, t[b, c]])  # associativity


@pytest.mark.parametrize("name,order", [("S3", 6), ("S4", 24), ("A4", 12), ("A5", 60), ("Z60", 60),
                                        ("D8", 16), ("S3xZ2", 12), ("A4xZ5", 60)])
def test_orders(name, order):
    assert parse_group(name).order == order


def test_symmetric_group_is_lexicographic_with_b_acting_first():
    for n in (3, 4, 5):
        g = symmetric(n)
        perms = list(itertools.permutations(range(n)))
        assert [tuple(p) for p in g.perms.tolist()] == perms
        for a, b in itertools.product(range(g.order), repeat=2):
            composed = tuple(perms[a][perms[b][i]] for i in range(n))  # (a*b)[i] = a[b[i]]
            assert perms[g.mul(a, b)] == composed
    # abstract_algebra's own check (Pinter's S3, base 1): (1,3,2) * (3,1,2) = (2,1,3)
    s3 = symmetric(3)
    idx = {name: i for i, name in enumerate(s3.element_names)}
    assert s3.mul(idx["(1, 3, 2)"], idx["(3, 1, 2)"]) == idx["(2, 1, 3)"]


def test_alternating_keeps_even_permutations_in_symmetric_order():
    for n in (3, 4, 5):
        even = [p for p in itertools.permutations(range(n))
                if sum(p[i] > p[j] for i in range(n) for j in range(i + 1, n)) % 2 == 0]
        assert [tuple(p) for p in alternating(n).perms.tolist()] == even


def _isomorphism(g, h):
    """Search bijections fixing the identity for one that preserves products (small groups only)."""
    if g.order != h.order:
        return None
    for rest in itertools.permutations(range(1, h.order)):
        phi = np.array((0, *rest))
        if np.array_equal(phi[g.table], h.table[phi[:, None], phi[None, :]]):
            return phi
    return None


def test_s3_is_isomorphic_to_d3_and_not_to_z6():
    phi = _isomorphism(symmetric(3), dihedral(3))
    assert phi is not None
    assert sorted(phi.tolist()) == list(range(6))
    assert _isomorphism(symmetric(3), cyclic(6)) is None  # the search can fail


def test_dihedral_matches_polygon_symmetries():
    """r_i: x -> x + i, s_j: x -> j - x on Z_n, composed with b acting first."""
    for n in (3, 4, 6):
        g = dihedral(n)
        maps = [tuple((x + i) % n for x in range(n)) for i in range(n)]
        maps += [tuple((j - x) % n for x in range(n)) for j in range(n)]
        assert len(set(maps)) == 2 * n
        for a, b in itertools.product(range(2 * n), repeat=2):
            assert maps[g.mul(a, b)] == tuple(maps[a][maps[b][x]] for x in range(n))


def test_bad_group_names():
    for bad in ("S0", "Q8", "S3x", "S9"):
        with pytest.raises(GroupSpecError):
            parse_group(bad)


# ----------------------------------------------------------------------------- labels by an independent route

def _compose_labels(x, elements, compose, identity):
    index = {e: i for i, e in enumerate(elements)}
    out = []
    for row in x.tolist():
        acc, labels = identity, []
        for tok in row:
            acc = compose(acc, elements[tok])
            labels.append(index[acc])
        out.append(labels)
    return np.array(out)


def _perm_compose(a, b):
    return tuple(a[b[i]] for i in range(len(a)))


@pytest.mark.parametrize("name,n", [("S4", 4), ("S5", 5), ("S5swaps", 5), ("S5m3", 5)])
def test_symmetric_labels_by_composing_permutations(name, n):
    x, y = get_task(name).generate(40, 32, seed=7)
    perms = list(itertools.permutations(range(n)))
    expected = _compose_labels(x.numpy(), perms, _perm_compose, tuple(range(n)))
    np.testing.assert_array_equal(y.numpy(), expected)


def test_alternating_and_product_labels_by_composing():
    x, y = get_task("A5").generate(30, 16, seed=3)
    even = [p for p in itertools.permutations(range(5))
            if sum(p[i] > p[j] for i in range(5) for j in range(i + 1, 5)) % 2 == 0]
    np.testing.assert_array_equal(y.numpy(), _compose_labels(x.numpy(), even, _perm_compose, tuple(range(5))))

    x, y = get_task("S3xZ2").generate(30, 16, seed=4)
    pairs = list(itertools.product(itertools.permutations(range(3)), range(2)))  # itertools.product order
    compose = lambda a, b: (_perm_compose(a[0], b[0]), (a[1] + b[1]) % 2)  # noqa: E731
    np.testing.assert_array_equal(y.numpy(), _compose_labels(x.numpy(), pairs, compose, ((0, 1, 2), 0)))


def test_cyclic_and_parity_labels():
    x, y = get_task("Z60").generate(50, 8, seed=1)
    np.testing.assert_array_equal(y.numpy(), np.cumsum(x.numpy(), axis=1) % 60)
    x, y = get_task("parity").generate(50, 8, seed=1)
    assert set(np.unique(x.numpy())) <= {0, 1}
    np.testing.assert_array_equal(y.numpy(), np.cumsum(x.numpy(), axis=1) % 2)


def test_restricted_inputs_cover_the_whole_group_in_labels():
    task = get_task("S5swaps")
    assert len(task.inputs) == 11 and (task.group.moved_points()[task.inputs] <= 2).all()
    assert len(get_task("S5m3").inputs) == 31  # identity, 10 swaps, 20 three-cycles
    x, y = task.generate(64, 64, seed=0)
    assert set(np.unique(x.numpy())) <= set(task.inputs.tolist())
    assert len(np.unique(y.numpy())) > 100  # labels range over S5, not just the inputs
    assert task.vocab_size == task.num_classes == 120


def test_generation_is_seeded():
    task = get_task("S4")
    a, b, c = task.generate(16, 8, 1), task.generate(16, 8, 1), task.generate(16, 8, 2)
    assert all((u == v).all() for u, v in zip(a, b, strict=True))
    assert not (a[0] == c[0]).all()
    assert a[0].dtype == a[1].dtype == torch.int64
    assert tuple(a[0].shape) == (8, 16)


# ----------------------------------------------------------------------------- modular arithmetic

def _ast_value(node, m):
    """Evaluate +, -, * and unary minus from Python's own parser (precedence and brackets included)."""
    if isinstance(node, ast.Expression):
        return _ast_value(node.body, m)
    if isinstance(node, ast.Constant):
        return node.value % m
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_ast_value(node.operand, m) % m
    if isinstance(node, ast.BinOp):
        a, b = _ast_value(node.left, m), _ast_value(node.right, m)
        ops = {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b}
        return ops[type(node.op)] % m
    raise AssertionError(f"unexpected node {ast.dump(node)}")


@pytest.mark.parametrize("name", ["modarith", "modarith_brackets", "modarith_brackets_nomult"])
@pytest.mark.parametrize("min_length", [None, 3])
def test_modular_arithmetic_matches_python_parser(name, min_length):
    task = get_task(name)
    assert task.num_classes == 5 and task.vocab_size == (10 if name == "modarith" else 12)
    x, y = task.generate(41, 64, seed=5, min_length=min_length)
    symbols = task.token_names
    for row, labels in zip(x.numpy(), y.numpy(), strict=True):
        eq = int(np.flatnonzero(row == symbols.index("="))[0])
        assert (labels[:eq] == IGNORE_INDEX).all() and (labels[eq + 1:] == IGNORE_INDEX).all()
        assert (row[eq + 1:] == symbols.index("[PAD]")).all()
        text = "".join(symbols[t] for t in row[:eq])
        if min_length is None:  # the expression fills the row up to the final '='
            assert eq == len(row) - 1 - (len(row) % 2 if name == "modarith" else 0)
        if name == "modarith":
            assert eq % 2 == 1
        if name.endswith("nomult"):
            assert "*" not in text
        assert labels[eq] == _ast_value(ast.parse(text, mode="eval"), 5), text


def test_paper_examples_evaluate_as_in_the_papers():
    # negative-eigenvalues paper appendix E.1.2 and DeltaProduct appendix C.2
    for text, value in [("2-3-3*2", 3), ("2+1-2*2-3", 1), ("((((3+3)+-1)+-2)-((3-(-3))+((1)+4)))", 2),
                        ("((1-(-2))+((4)+3))", 0)]:
        assert _ast_value(ast.parse(text, mode="eval"), 5) == value
    task = get_task("modarith")
    from deltalab.tasks.state_tracking import _evaluate_flat

    ids = {"+": 0, "-": 1, "*": 2}
    nums = np.array([[2, 1, 2, 2, 3]])
    ops = np.array([[ids["+"], ids["-"], ids["*"], ids["-"]]])
    assert _evaluate_flat(nums, ops, np.array([4]), task.modulus)[0] == 1


# ----------------------------------------------------------------------------- CSV and reference sampling

def test_csv_round_trip(tmp_path):
    for name in ("S4", "modarith_brackets"):
        x, y = get_task(name).generate(12, 5, seed=2, min_length=None)
        path = write_csv(tmp_path / f"{name}.csv", x.numpy(), y.numpy(), seed=2)
        assert path.read_text().splitlines()[0] == "seed,input,target"
        assert path.read_text().splitlines()[1].startswith("2," + " ".join(map(str, x[0].tolist())) + ",")
        back = read_csv(path)
        np.testing.assert_array_equal(back.inputs, x.numpy())
        np.testing.assert_array_equal(back.labels, y.numpy())
        assert back.seeds == ["2"] * 5


def test_csv_reads_the_older_final_target_format(tmp_path):
    path = tmp_path / "S3=3.csv"
    path.write_text("length,input,target\n3,1 2 3,4\n3,0 0 5,5\n")
    data = read_csv(path)
    np.testing.assert_array_equal(data.labels, [[IGNORE_INDEX, IGNORE_INDEX, 4], [IGNORE_INDEX, IGNORE_INDEX, 5]])


@pytest.mark.parametrize("text,needle", [("a,b\n1,2\n", "header"), ("seed,input,target\n0,1 x,1 2\n", "integers"),
                                         ("seed,input,target\n0,1 2,1 2\n0,1,1\n", "length"),
                                         ("seed,input,target\n", "no rows")])
def test_csv_errors(tmp_path, text, needle):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(TaskError, match=needle):
        read_csv(path)


def test_reference_sampling_equals_the_reference_loop():
    """jopetty/word-problem: random.seed; add tuple(random.choices(range(n), k=k)) to a set; list(set)."""
    for order, length, samples, seed in [(24, 6, 50, 3), (2, 3, 8, 0), (6, 4, 30, 11)]:
        random.seed(seed)
        seqs = set()
        while len(seqs) < min(samples, order ** length):
            seqs.add(tuple(random.choices(range(order), k=length)))
        expected = np.array(list(seqs))
        np.testing.assert_array_equal(reference_sequences(order, length, samples, seed), expected)


def test_unknown_tasks_and_bad_sizes():
    with pytest.raises(TaskError, match="unknown task"):
        get_task("S4x")
    with pytest.raises(TaskError, match="--length"):
        get_task("modarith").generate(1, 4, 0)
    with pytest.raises(TaskError, match="min-length"):
        get_task("S4").generate(8, 4, 0, min_length=4)


# ----------------------------------------------------------------------------- CLI

def test_cli_data_writes_the_generated_set(tmp_path):
    out = tmp_path / "s4.csv"
    r = CliRunner().invoke(app, ["data", "S4", "--length", "16", "--samples", "20", "--seed", "9", "--out", str(out)])
    assert r.exit_code == 0, r.output
    x, y = get_task("S4").generate(16, 20, 9)
    data = read_csv(out)
    np.testing.assert_array_equal(data.inputs, x.numpy())
    np.testing.assert_array_equal(data.labels, y.numpy())
    r = CliRunner().invoke(app, ["data", "S3", "--length", "4", "--samples", "5", "--out", str(tmp_path / "r.csv"),
                                 "--reference-rng"])
    assert r.exit_code == 0, r.output
    np.testing.assert_array_equal(read_csv(tmp_path / "r.csv").inputs, reference_sequences(6, 4, 5, 0))


@pytest.mark.parametrize("args,needle", [
    (["data", "Q8", "--length", "4", "--samples", "2"], "unknown task"),
    (["data", "S4", "--length", "0", "--samples", "2"], "--length"),
    (["data", "S4", "--length", "4", "--samples", "0"], "--samples"),
    (["data", "parity", "--length", "4", "--samples", "2", "--reference-rng"], "reference-rng"),
    (["data", "S4", "--length", "4", "--samples", "2", "--min-length", "2"], "min-length"),
])
def test_cli_data_bad_arguments_give_one_line(tmp_path, args, needle):
    r = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "x.csv")])
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0]
    assert not (tmp_path / "x.csv").exists()


def test_cli_data_keeps_existing_files(tmp_path):
    out = tmp_path / "keep.csv"
    out.write_text("precious\n")
    r = CliRunner().invoke(app, ["data", "S4", "--length", "4", "--samples", "2", "--out", str(out)])
    assert r.exit_code == 2 and "--force" in r.output
    assert out.read_text() == "precious\n"
    r = CliRunner().invoke(app, ["data", "S4", "--length", "4", "--samples", "2", "--out", str(out), "--force"])
    assert r.exit_code == 0 and read_csv(out).inputs.shape == (2, 4)
