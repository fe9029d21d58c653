"""The layering rule of docs/architecture.md, checked on the source: which package may import which.

    kernels < models < tasks < store < {train, probes} < app

A package imports only packages below it; train and probes are siblings that never import each other;
no package imports benchmarks, scripts or tests (they sit on top and may import anything). Every import
counts: top-level and inside functions, `import x`, `from x import y`, relative imports, and
`importlib.import_module("x...")` / `__import__("x")` with a literal (or f-string) module name.
On top of that, no import cycle may run through modules of two packages.

`check_layers(root)` returns one message per violation (`file:line: import ...: why`), so the test
names every offending import; it takes the root folder so that it can be tested on a fake tree.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LAYERS: dict[str, int] = {"kernels": 0, "models": 1, "tasks": 2, "store": 3, "train": 4, "probes": 4, "app": 5}
"""Package -> layer. Packages of one layer are siblings: they never import each other."""

TOP = ("benchmarks", "scripts", "tests", "notebooks")
"""Folders above every package: they may import anything, and no package imports them."""

RECIPES = ("models/zoo",)
"""Folders inside a package that hold no package code: the bundled checkpoints and the recipes beside their cards
(a training sweep, a card's table from a store). Like TOP, they sit above the stack and no package imports them."""

KNOWN_VIOLATIONS: dict[tuple[str, str], str] = {}
"""(file, statement) -> why it is tolerated for now. Each entry must still occur (else delete it): the
list only shrinks. Everything else the check finds fails the test."""


@dataclass(frozen=True)
class Import:
    """One import statement's target, where it is and how it reads in the source."""

    importer: str  # dotted module name of the importing file
    target: str  # dotted module imported
    path: Path  # file, relative to the root
    line: int
    text: str  # the statement as written (normalised)


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(root: Path, dotted: str) -> bool:
    base = root.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _literal_prefix(node: ast.expr) -> str | None:
    """The module name of a string literal, or the literal start of an f-string (`f"probes.{x}"` -> "probes.")."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values:
        first = node.values[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            return first.value
    return None


def _dynamic_target(call: ast.Call) -> str | None:
    """`importlib.import_module("x")`, `import_module("x")` or `__import__("x")`: the (literal) module name."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in ("import_module", "__import__") or not call.args:
        return None
    prefix = _literal_prefix(call.args[0])
    if not prefix:
        return None
    if prefix.startswith("."):  # relative: resolved against the `package` argument, which we do not track
        return None
    if "." in prefix:
        head, _, rest = prefix.rpartition(".")
        return prefix if rest else head  # "probes." (an f-string prefix) -> "probes"
    return prefix


def _unprefixed(target: str) -> str:
    """`deltalab.store.reader` -> `store.reader`: the installed name maps onto the repository's folders."""
    return target.removeprefix("deltalab.") if target.startswith("deltalab.") else target


def imports_of(root: Path, path: Path) -> list[Import]:
    """Every import in `path` (a .py file under `root`), with relative imports resolved."""
    module = _module_name(root, path)
    is_pkg = path.name == "__init__.py"
    package = module if is_pkg else module.rpartition(".")[0]
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source, filename=str(path))
    rel = path.relative_to(root)
    out: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append(Import(module, _unprefixed(alias.name), rel, node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                up = node.level - 1
                base = base[: len(base) - up] if up else base
                origin = ".".join([*base, *([node.module] if node.module else [])])
            else:
                origin = node.module or ""
            names = ", ".join(a.name for a in node.names)
            text = f"from {'.' * node.level}{node.module or ''} import {names}"
            targets = []
            for alias in node.names:  # `from pkg import sub` imports the module pkg.sub when there is one
                sub = _unprefixed(f"{origin}.{alias.name}" if origin else alias.name)
                targets.append(sub if alias.name != "*" and _is_module(root, sub) else _unprefixed(origin))
            for target in dict.fromkeys(t for t in targets if t):
                out.append(Import(module, target, rel, node.lineno, text))
        elif isinstance(node, ast.Call):
            target = _dynamic_target(node)
            target = _unprefixed(target) if target else None
            if target:
                call = ast.get_source_segment(source, node) or f"import_module({target!r})"
                out.append(Import(module, target, rel, node.lineno, " ".join(call.split())))
    return out


def source_files(root: Path) -> list[Path]:
    """The .py files of the layered packages under `root` (build caches and hidden folders skipped)."""
    files = []
    for pkg in LAYERS:
        folder = root / pkg
        if not folder.is_dir():
            continue
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(root).parts
            if any(p == "__pycache__" or p.startswith(".") for p in parts):
                continue
            if any("/".join(parts).startswith(folder + "/") for folder in RECIPES):
                continue
            files.append(path)
    return files


def _rule(importer_pkg: str, target_pkg: str) -> str | None:
    """Why `importer_pkg` may not import `target_pkg` (None: allowed)."""
    if target_pkg == importer_pkg:
        return None
    if target_pkg in TOP:
        return f"{importer_pkg} imports {target_pkg}, which sits on top of every package"
    if target_pkg not in LAYERS:
        return None  # a third-party or standard-library module
    mine, theirs = LAYERS[importer_pkg], LAYERS[target_pkg]
    if theirs < mine:
        return None
    if theirs == mine:
        return f"{importer_pkg} and {target_pkg} are siblings and never import each other"
    return f"{importer_pkg} (layer {mine}) imports {target_pkg} (layer {theirs}), a layer above it"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def check_layers(root: Path) -> list[str]:
    """Every violation of the layering rule under `root`, one line each: `path:line: statement: why`."""
    root = Path(root)
    problems: list[str] = []
    graph: dict[str, set[str]] = {}
    where: dict[tuple[str, str], Import] = {}
    for path in source_files(root):
        module = _module_name(root, path)
        graph.setdefault(module, set())
        for imp in imports_of(root, path):
            importer_pkg, target_pkg = module.split(".")[0], imp.target.split(".")[0]
            why = _rule(importer_pkg, target_pkg)
            if why:
                problems.append(f"{imp.path}:{imp.line}: `{imp.text}`: {why}")
            if target_pkg in LAYERS:
                # importing a.b.c runs a/__init__.py and a/b/__init__.py first: edges to those too
                parts = imp.target.split(".")
                for i in range(1, len(parts) + 1):
                    target = ".".join(parts[:i])
                    if target != module and _is_module(root, target):
                        graph[module].add(target)
                        where.setdefault((module, target), imp)
    for component in _cycles(graph):
        packages = sorted({m.split(".")[0] for m in component})
        if len(packages) < 2:
            continue  # a cycle inside one package is that package's business
        members = set(component)
        edges = [where[(a, b)] for a in component for b in sorted(graph[a] & members)
                 if a.split(".")[0] != b.split(".")[0]]
        detail = "; ".join(dict.fromkeys(f"{e.path}:{e.line}: `{e.text}`" for e in edges))
        problems.append(f"import cycle across {', '.join(packages)} through {', '.join(component)} "
                        f"(cross-package edges: {detail})")
    return problems


# --- the rule on this repository -----------------------------------------------------------------

def _known(problem: str) -> tuple[str, str] | None:
    return next((key for key in KNOWN_VIOLATIONS if problem.startswith(key[0] + ":") and f"`{key[1]}`" in problem),
                None)


def test_packages_respect_the_layers():
    problems = [p for p in check_layers(ROOT) if _known(p) is None]
    assert not problems, "layering violations (see docs/architecture.md):\n" + "\n".join(problems)


def test_known_violations_are_still_real():
    found = {_known(p) for p in check_layers(ROOT)}
    fixed = [f"{path}: `{stmt}`" for path, stmt in KNOWN_VIOLATIONS if (path, stmt) not in found]
    assert not fixed, "fixed, so delete from KNOWN_VIOLATIONS in tests/test_layers.py: " + "; ".join(fixed)


def test_every_package_is_checked():
    """Each layered package exists and has source files, so a rename cannot empty the check silently."""
    files = source_files(ROOT)
    for pkg in LAYERS:
        assert any(f.relative_to(ROOT).parts[0] == pkg for f in files), f"no .py files found under {pkg}/"


def _targets_of(folder: str) -> dict[str, str]:
    """Imported module -> `file:line` of its first import, for every file under `folder` (e.g. "tasks")."""
    out: dict[str, str] = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        for imp in imports_of(ROOT, path):
            out.setdefault(imp.target, f"{imp.path}:{imp.line}")
    return out


def test_tasks_import_nothing_of_models():
    """The task generators are numpy over the label convention in kernels.constants: no model code under them."""
    above = {t: where for t, where in _targets_of("tasks").items() if t.split(".")[0] in ("models", "store")}
    assert not above, f"tasks/ imports {above}"


def test_dash_building_blocks_import_no_views():
    """app/dash holds what the pages use; the frame that assembles the pages lives above both (app/frame.py)."""
    up = {t: where for t, where in _targets_of("app/dash").items()
          if t.startswith("app.views") or t in ("app.frame", "app.dashboard")}
    assert not up, f"app/dash imports {up}"


# --- the checker on fake trees -------------------------------------------------------------------

def _tree(root: Path, files: dict[str, str]) -> Path:
    for pkg in LAYERS:
        (root / pkg).mkdir(parents=True, exist_ok=True)
        (root / pkg / "__init__.py").write_text("")
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_clean_tree_passes(tmp_path):
    root = _tree(tmp_path, {
        "kernels/delta_rule/naive.py": "import torch\nCHUNK_SIZE = 64\n",
        "models/lm.py": "from kernels.delta_rule.naive import CHUNK_SIZE\n",
        "tasks/state_tracking.py": "from models.lm import IGNORE_INDEX\n",
        "store/data.py": "def f():\n    from tasks.state_tracking import get_task\n",
        "train/lm.py": "import store\nfrom . import evaluate\n",
        "train/evaluate.py": "from models import lm\n",
        "probes/erank.py": "import importlib\nm = importlib.import_module('deltalab.kernels.delta_rule.naive')\n",
        "app/cli.py": "from train import lm\nfrom probes import erank\n",
    })
    assert check_layers(root) == []


def test_kernels_importing_models_fails(tmp_path):
    root = _tree(tmp_path, {"models/lm.py": "X = 1\n",
                            "kernels/delta_rule/chunk.py": "import torch\n\nfrom models.lm import X\n"})
    problems = check_layers(root)
    assert len(problems) == 1
    assert problems[0].startswith("kernels/delta_rule/chunk.py:3: `from models.lm import X`: kernels (layer 0) "
                                  "imports models")


def test_lazy_relative_and_dynamic_imports_count(tmp_path):
    root = _tree(tmp_path, {
        "models/lm.py": "def f():\n    import store.reader\n",
        "store/reader.py": "",
        "tasks/corpus.py": "from ..app import cli\n",
        "app/cli.py": "",
        "kernels/spectra/householder.py": "import importlib\n\n\ndef g(name):\n"
                              "    return importlib.import_module(f'deltalab.probes.{name}')\n",
    })
    problems = sorted(check_layers(root))
    assert any(p.startswith("models/lm.py:2: `import store.reader`: models (layer 1) imports store") for p in problems)
    assert any(p.startswith("tasks/corpus.py:1: `from ..app import cli`: tasks (layer 2) imports app")
               for p in problems)
    assert any(p.startswith("kernels/spectra/householder.py:5: `importlib.import_module(f'deltalab.probes.{name}')`")
               for p in problems)


def test_siblings_and_top_folders(tmp_path):
    root = _tree(tmp_path, {
        "train/prune_study.py": "def v():\n    from probes.base import deltalab_version\n",
        "probes/base.py": "import train\n",
        "store/capture.py": "from benchmarks import store\n",
    })
    problems = check_layers(root)
    assert any(p.startswith("train/prune_study.py:2: `from probes.base import deltalab_version`: train and probes "
                            "are siblings") for p in problems)
    assert any(p.startswith("probes/base.py:1: `import train`: probes and train are siblings") for p in problems)
    assert any(p.startswith("store/capture.py:1: `from benchmarks import store`: store imports benchmarks")
               for p in problems)


def test_cross_package_cycle_is_reported(tmp_path):
    root = _tree(tmp_path, {
        "kernels/a.py": "from models import b\n",
        "models/b.py": "from deltalab.kernels import a\n",
    })
    problems = check_layers(root)
    cycle = [p for p in problems if p.startswith("import cycle")]
    assert cycle and "kernels.a" in cycle[0] and "models.b" in cycle[0] and "kernels/a.py:1" in cycle[0]


def test_cycle_inside_one_package_is_allowed(tmp_path):
    root = _tree(tmp_path, {"store/a.py": "from store import b\n", "store/b.py": "def f():\n    from store import a\n"})
    assert check_layers(root) == []


@pytest.mark.parametrize("stmt", ["import app", "from app.cli import main", "import app.frame as m"])
def test_nothing_imports_app(tmp_path, stmt):
    root = _tree(tmp_path, {"probes/x.py": stmt + "\n", "app/cli.py": "", "app/dash/__init__.py": "",
                            "app/frame.py": ""})
    assert check_layers(root), stmt
