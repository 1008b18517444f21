"""The shape of the tree: no import cycle among the benchmark modules, nor across the library
and the benchmarks, the benchmarks use only the library's public surface, the library knows
nothing of the benchmarks, bench/ shows its parts, and bench/results holds only cited files.
Each check also runs on a planted violation, so it is known to fail. Modules are split by
topic, not by a line count (docs/design.md §2)."""

from __future__ import annotations

import ast
import fnmatch
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("scape", "kernels", "comm")

PUBLIC = {
    "scape": None,  # filled in by _allowed(): scape.__all__ and its public modules
    "scape.rules": None,
    "scape.kernels": None,
    "scape.comm": None,
    "scape.comm.base": {"Communicator", "Work", "CompletedWork", "CommError", "OPS",
                        "REDUCE_OPS"},
    "scape.buffers": {"Bucket", "DENSE_ALIGN", "flat_layout"},
    "scape.profiling": {"phase"},
    "scape.wire": {"PARAM_BITS", "fused_segment_bytes", "mask_bytes", "segment_bytes",
                   "ParamWire"},  # (bench.research.update_codes recodes its segments)
}
"""The library surface the benchmarks may use: module -> the names they may take from it
(None: every public name)."""


def _allowed() -> dict[str, set[str] | None]:
    import scape
    import scape.comm

    table = dict(PUBLIC)
    table["scape"] = set(scape.__all__) | {"rules", "kernels", "comm", "buffers", "profiling",
                                           "__version__"}
    table["scape.comm"] = set(scape.comm.__all__)
    return table


def _modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """``{"bench.engine.runner": path, "bench": path/__init__.py, ...}`` under ``root``."""
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg.replace(".", "/")).glob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _from_target(node: ast.ImportFrom, package: str) -> str:
    """The absolute module a ``from ... import`` reads, its dots resolved against ``package``."""
    base = node.module or ""
    if node.level:
        anchor = package.split(".")
        anchor = anchor[:len(anchor) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    return base


def _imports(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, list[str]]]:
    """Every import in ``tree``, at any depth (module level and inside functions), as
    ``(module, names)``; ``names`` is empty for ``import x``."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((_from_target(node, package), [alias.name for alias in node.names]))
    return found


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports (``from pkg import mod`` counts as an
    import of ``pkg.mod``; importing ``a.b.c`` imports the packages ``a`` and ``a.b`` too,
    except those that contain the importer: their ``__init__`` has run before it)."""
    mods = _modules(root, packages)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        tree = ast.parse(path.read_text(), str(path))
        for target, names in _imports(tree, name, path.name == "__init__.py"):
            heads = [f"{target}.{n}" for n in names if f"{target}.{n}" in mods] or [target]
            for head in heads:
                parts = head.split(".")
                for i in range(1, len(parts) + 1):
                    dep = ".".join(parts[:i])
                    if dep in mods and dep != name and (dep not in own or dep == head):
                        graph[name].add(dep)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


TREE = {"scape": "scape", "scape.kernels": "kernels", "scape.comm": "comm", "bench": "bench"}
"""Import name -> folder: the library as pyproject.toml's ``package-dir`` installs it, and the
benchmarks."""

DEFERRED_CYCLES = {("scape.comm.hierarchical", "scape.comm")}
"""Imports inside a function that close a cycle by design, as ``(importer, imported)``:
``HierarchicalCommunicator.__init__`` makes its two levels communicators with
``scape.comm.as_communicator``, which builds a ``HierarchicalCommunicator`` from a
two-dimensional mesh. Such an import runs at call time, when both modules are loaded."""


def tree_modules(root: Path, tree: dict[str, str] = TREE) -> dict[str, Path]:
    """``{"scape.kernels.topk": root/kernels/topk.py, ...}``: every module of the packages under
    each folder of ``tree`` (recursively; a folder without ``__init__.py`` is not a package)."""
    out = {}
    for prefix, folder in tree.items():
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("").parts
            if not all((base.joinpath(*rel[:i]) / "__init__.py").is_file()
                       for i in range(len(rel))):
                continue
            parts = [*prefix.split("."), *rel]
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _scoped_imports(tree: ast.AST, module: str,
                    is_package: bool) -> list[tuple[str, list[str], bool]]:
    """Every import in ``tree`` as ``(module, names, deferred)``: ``deferred`` when it sits in
    a function (it runs when called, not when the module is imported). Imports under ``if
    TYPE_CHECKING:`` count as the module level they sit in."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[str, list[str], bool]] = []

    def visit(node: ast.AST, deferred: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((alias.name, [], deferred) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                found.append((_from_target(child, package),
                              [alias.name for alias in child.names], deferred))
            visit(child, deferred or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return found


def tree_import_graph(root: Path, tree: dict[str, str] = TREE) -> dict[str, dict[str, bool]]:
    """Module -> ``{imported module: deferred}`` over the modules of :func:`tree_modules`
    (``deferred``: every import of it sits in a function).

    ``from pkg import mod`` imports ``pkg.mod``, and ``pkg`` itself when a name is not a
    module. Importing ``a.b.c`` imports the packages ``a`` and ``a.b`` too, except those that
    contain the importer: a package's ``__init__`` runs before any module inside it, so
    reaching it by a dotted path is no dependency (importing a name from it is)."""
    mods = tree_modules(root, tree)
    graph: dict[str, dict[str, bool]] = {m: {} for m in mods}
    for name, path in mods.items():
        is_package = path.name == "__init__.py"
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        if is_package:
            own.add(name)
        for target, names, deferred in _scoped_imports(ast.parse(path.read_text(), str(path)),
                                                       name, is_package):
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in mods]
            heads = subs + ([target] if len(subs) < len(names) or not names else [])
            for head in heads:
                parts = head.split(".")
                deps = {".".join(parts[:i]) for i in range(1, len(parts))} - own
                for dep in deps | {head}:
                    if dep in mods and dep != name:
                        graph[name][dep] = graph[name].get(dep, True) and deferred
    return graph


def tree_cycle(graph: dict[str, dict[str, bool]],
               allowed: set[tuple[str, str]] = DEFERRED_CYCLES) -> list[str] | None:
    """A cycle of :func:`tree_import_graph`'s graph (:func:`find_cycle`), counting every import
    but the deferred ones listed in ``allowed``."""
    return find_cycle({m: {d for d, deferred in deps.items()
                           if not (deferred and (m, d) in allowed)}
                       for m, deps in graph.items()})


def _is_module(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def library_uses(root: Path, packages: tuple[str, ...]) -> list[str]:
    """What the modules of ``packages`` take from ``scape`` beyond :data:`PUBLIC`: imports of
    other modules or names, names starting with ``_``, and ``scape.<attr>`` chains on an
    imported module that leave the public surface."""
    allowed = _allowed()

    def module_ok(mod: str) -> bool:
        if mod in allowed:
            return True
        head, _, last = mod.rpartition(".")
        return head == "scape.kernels" and not last.startswith("_") and _is_module(mod)

    def name_ok(mod: str, name: str) -> bool:
        if name.startswith("_") and name != "__version__":
            return False
        names = allowed.get(mod)
        return names is None or name in names

    bad = []
    for module, path in _modules(root, packages).items():
        tree = ast.parse(path.read_text(), str(path))
        where = str(path.relative_to(root))
        bound: dict[str, str] = {}  # local name -> the scape module it is
        for target, names in _imports(tree, module, path.name == "__init__.py"):
            if target != "scape" and not target.startswith("scape."):
                continue
            if not names:
                if not module_ok(target):
                    bad.append(f"{where}: import {target}")
                bound["scape"] = "scape"
                continue
            if not module_ok(target):
                bad.append(f"{where}: from {target} import {', '.join(names)}")
                continue
            for n in names:
                if not name_ok(target, n):
                    bad.append(f"{where}: from {target} import {n}")
                elif module_ok(f"{target}.{n}") and _is_module(f"{target}.{n}"):
                    bound[n] = f"{target}.{n}"
        for node in ast.walk(tree):
            if isinstance(node, ast.alias) and node.asname and node.name in bound.values():
                bound[node.asname] = node.name
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in bound):
                continue
            mod = bound[node.value.id]
            if not name_ok(mod, node.attr):
                bad.append(f"{where}:{node.lineno}: {node.value.id}.{node.attr} ({mod})")
    return bad


def library_mentions(root: Path, dirs: tuple[str, ...] = LIBRARY) -> list[str]:
    """Where library code names the benchmarks' README, speaks of hypotheses, or imports
    from ``bench``."""
    bad = []
    for d in dirs:
        for path in sorted((root / d).rglob("*.py")):
            text = path.read_text()
            where = str(path.relative_to(root))
            lower = text.lower()
            for word in ("bench/readme", "hypothesis", "hypotheses"):
                if word in lower:
                    bad.append(f"{where}: mentions {word!r}")
            for target, _ in _imports(ast.parse(text, where), d, False):
                if target == "bench" or target.startswith("bench."):
                    bad.append(f"{where}: imports {target}")
    return bad


# --------------------------------------------------------------------------- the tree
BENCH = ("bench", "bench.engine", "bench.workloads", "bench.research")
MAX_TOP_LEVEL = 20
"""Modules directly in bench/: the jobs (and their reports); the engine, the workloads and the
research each live in a folder of their own."""


def test_bench_top_level_holds_the_jobs_and_folders_hold_the_parts():
    top = sorted(p.name for p in (ROOT / "bench").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, top
    for folder in BENCH[1:]:
        assert (ROOT / folder.replace(".", "/") / "__init__.py").exists(), folder
    assert {"runner.py", "launch.py", "run_config.py", "run_rank.py", "optimizers.py"} <= \
        {p.name for p in (ROOT / "bench" / "engine").glob("*.py")}


def test_bench_has_no_import_cycle():
    graph = import_graph(ROOT, BENCH)
    assert {"bench.engine.runner", "bench.engine.optimizers", "bench.research.rules"} <= set(graph)
    assert "bench.engine.rows" in graph["bench.research.sweep_rows"]  # research -> engine
    assert "bench.engine.runner" in graph["bench.research.convergence_train"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_no_import_cycle_across_library_and_benchmarks():
    """No module of scape/, kernels/, comm/ or bench/ reaches itself through imports. Counted:
    imports at module level, those under ``if TYPE_CHECKING:`` too (a cycle a type checker and
    a reader follow is a cycle), and imports inside functions, bar :data:`DEFERRED_CYCLES`."""
    graph = tree_import_graph(ROOT)
    assert {"scape", "scape.rules", "scape.rules.catchups", "scape.kernels.topk",
            "scape.comm.hierarchical", "bench.engine.runner", "bench.research.rules"} <= set(graph)
    assert "scape.rules.state" in graph["scape.rules.catchups"]
    assert "scape.rules" in graph["bench.research.rules"]
    for importer, imported in DEFERRED_CYCLES:
        assert graph[importer].get(imported) is True, \
            f"{importer} -> {imported} is no longer a deferred import: update DEFERRED_CYCLES"
    cycle = tree_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


ONE_WAY = ("bench", "scape", "kernels", "comm", "examples")
"""The folders whose modules may not import the research (bench/research/ itself excepted)."""


def research_importers(root: Path, folders: tuple[str, ...] = ONE_WAY) -> list[str]:
    """``"path: imports bench.research..."`` for every module under ``folders`` (bench/research/
    left out) that imports the research package or a module of it, at any depth: the research
    reaches the engine, never the other way."""
    bad = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root)
            if rel.parts[:2] == ("bench", "research") or "results" in rel.parts:
                continue
            parts = rel.with_suffix("").parts
            module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            tree = ast.parse(path.read_text(), str(rel))
            for target, names in _imports(tree, module, path.name == "__init__.py"):
                heads = [target] + [f"{target}.{n}" for n in names]
                if any(h == "bench.research" or h.startswith("bench.research.") for h in heads):
                    bad.append(f"{rel}: imports {target}" + (f" ({', '.join(names)})"
                                                            if names else ""))
    return bad


def test_nothing_outside_the_research_imports_it():
    assert research_importers(ROOT) == []


@pytest.mark.parametrize("text", [
    "import bench.research.rules\n",
    "from bench.research.drift import Drift\n",
    "from bench import research\n",
    "def f():\n    from bench.research import rows\n",
    "from ..research import rows\n",
])
def test_a_planted_research_import_is_found(tmp_path, text):
    _plant(tmp_path, {"bench/__init__.py": "", "bench/engine/__init__.py": "",
                      "bench/engine/x.py": text,
                      "bench/research/__init__.py": "import bench.engine.x\n"})
    found = research_importers(tmp_path)
    assert len(found) == 1 and found[0].startswith("bench/engine/x.py: imports bench"), found


def test_research_may_import_the_engine(tmp_path):
    _plant(tmp_path, {"bench/__init__.py": "", "bench/engine/__init__.py": "",
                      "bench/engine/x.py": "import scape\n",
                      "bench/research/__init__.py": "from bench.engine import x\n"})
    assert research_importers(tmp_path) == []


def test_bench_uses_only_the_public_library():
    assert library_uses(ROOT, BENCH) == []


def test_library_knows_nothing_of_the_benchmarks():
    assert library_mentions(ROOT) == []


def test_one_place_registers_the_research_rules():
    """Only the research package imports its rules: ``import bench.research`` registers them
    (and the research's engine hooks); every entry point that takes rule names builds through
    the optimizer table, which names no research module."""
    graph = import_graph(ROOT, BENCH)
    importers = {m for m, deps in graph.items() if "bench.research.rules" in deps}
    assert importers and all(m.startswith("bench.research") for m in importers), importers
    assert "bench.research.rules" in graph["bench.research"]
    for entry in ("bench.engine.run_rank", "bench.research.convergence_train",
                  "bench.step_compute", "bench.research.lr_stability", "bench.compare"):
        reach, todo = set(), [entry]
        while todo:
            for dep in graph[todo.pop()] - reach:
                reach.add(dep)
                todo.append(dep)
        assert "bench.engine.optimizers" in reach, entry


# --------------------------------------------------------------------------- planted faults
def _plant(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.mark.parametrize("b_text", [
    pytest.param("import pkg.a\n", id="module-level"),
    pytest.param("def f():\n    from pkg import a\n", id="function-level"),
    pytest.param("def f():\n    from . import a\n", id="relative"),
    pytest.param("from pkg.sub import c\n", id="through-a-subpackage"),
])
def test_a_planted_cycle_is_found(tmp_path, b_text):
    root = _plant(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "from pkg.b import x\n",
                             "pkg/b.py": b_text, "pkg/sub/__init__.py": "",
                             "pkg/sub/c.py": "import pkg.a\n"})
    cycle = find_cycle(import_graph(root, ("pkg", "pkg.sub")))
    assert cycle is not None and cycle[0] == cycle[-1] and "pkg.a" in cycle


def test_no_cycle_is_found_where_there_is_none(tmp_path):
    root = _plant(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "from pkg.b import x\n",
                             "pkg/b.py": "import os\n"})
    assert find_cycle(import_graph(root, ("pkg",))) is None


@pytest.mark.parametrize("b_text, deferred", [
    pytest.param("from pkg.a import x\n", False, id="module-level"),
    pytest.param("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import x\n",
                 False, id="type-checking"),
    pytest.param("def f():\n    from . import a\n", True, id="function-level"),
    pytest.param("from pkg import x\n", False, id="a-name-of-the-package"),
    pytest.param("from top.mapped import c\n", False, id="through-a-mapped-folder"),
])
def test_a_planted_tree_cycle_is_found(tmp_path, b_text, deferred):
    root = _plant(tmp_path, {"pkg/__init__.py": "from pkg.a import x\n",
                             "pkg/a.py": "from pkg.b import y\n", "pkg/b.py": b_text,
                             "top/__init__.py": "", "other/__init__.py": "",
                             "other/c.py": "import pkg.a\n"})
    graph = tree_import_graph(root, {"pkg": "pkg", "top": "top", "top.mapped": "other"})
    cycle = tree_cycle(graph, set())
    assert cycle is not None and cycle[0] == cycle[-1] and "pkg.b" in cycle, cycle
    if deferred:  # a listed deferred import is let through, and only that one
        assert graph["pkg.b"] == {"pkg.a": True}
        assert tree_cycle(graph, {("pkg.b", "pkg.a")}) is None


def test_no_tree_cycle_through_a_parent_package(tmp_path):
    """``pkg/__init__.py`` importing ``pkg.a``, which imports ``pkg.b`` by its dotted path:
    the package runs first, so that is no cycle."""
    root = _plant(tmp_path, {"pkg/__init__.py": "from pkg.a import x\n",
                             "pkg/a.py": "import pkg.b\nfrom pkg.sub.c import y\n",
                             "pkg/b.py": "import os\n", "pkg/sub/__init__.py": "",
                             "pkg/sub/c.py": "from pkg.b import z\n",
                             "pkg/loose/d.py": "import pkg\n"})
    graph = tree_import_graph(root, {"pkg": "pkg"})
    assert graph == {"pkg": {"pkg.a": False}, "pkg.a": {"pkg.b": False, "pkg.sub": False,
                                                        "pkg.sub.c": False},
                     "pkg.b": {}, "pkg.sub": {}, "pkg.sub.c": {"pkg.b": False}}
    assert tree_cycle(graph, set()) is None



@pytest.mark.parametrize("text, why", [
    pytest.param("from scape.optimizer import SCAPE\n", "scape.optimizer", id="internal-module"),
    pytest.param("import scape.sharded\n", "import scape.sharded", id="internal-import"),
    pytest.param("def f():\n    from scape.rules import _lazy\n", "_lazy", id="private-name"),
    pytest.param("from scape.buffers import pad_to\n", "pad_to", id="unlisted-name"),
    pytest.param("import scape\nx = scape.optimizer.SCAPE\n", "scape.optimizer",
                 id="attribute"),
    pytest.param("from scape import rules\nx = rules._private\n", "rules._private",
                 id="module-attribute"),
    pytest.param("from scape.kernels import _checks\n", "_checks", id="private-module"),
])
def test_a_planted_private_use_is_found(tmp_path, text, why):
    root = _plant(tmp_path, {"pkg/__init__.py": "", "pkg/m.py": text})
    bad = library_uses(root, ("pkg",))
    assert len(bad) == 1 and why in bad[0], bad


def test_public_uses_pass(tmp_path):
    root = _plant(tmp_path, {"pkg/__init__.py": "", "pkg/m.py": (
        "import scape\nfrom scape import StepInfo, rules\nfrom scape.comm.base import Work\n"
        "from scape.kernels import topk\nx = scape.SCAPE, rules.RULES, topk.topk_config\n")})
    assert library_uses(root, ("pkg",)) == []


@pytest.mark.parametrize("text, why", [
    pytest.param("# see bench/README.md\n", "bench/readme", id="readme"),
    pytest.param('"""Hypothesis 3 says so."""\n', "hypothesis", id="hypothesis"),
    pytest.param("def f():\n    import bench.research.rules\n", "imports bench.research.rules",
                 id="import"),
    pytest.param("from bench import optimizers\n", "imports bench", id="from-import"),
])
def test_a_planted_library_mention_is_found(tmp_path, text, why):
    root = _plant(tmp_path, {"scape/x.py": text, "kernels/y.py": "z = 1\n", "comm/z.py": ""})
    bad = library_mentions(root)
    assert len(bad) == 1 and why in bad[0], bad



@pytest.mark.parametrize("path, limit", [("README.md", 250), ("bench/README.md", 300)])
def test_readmes_stay_short(path, limit):
    """A training engineer reads the README in ten minutes; the rest lives in docs/."""
    lines = (ROOT / path).read_text().splitlines()
    assert len(lines) <= limit, f"{path} has {len(lines)} lines (at most {limit})"


MAX_RESULTS = 64


def test_results_are_few_and_each_is_cited():
    """bench/results keeps what the docs cite (the research log pins the rest to a commit)."""
    results = ROOT / "bench" / "results"
    files = sorted(p.relative_to(results).as_posix() for p in results.rglob("*") if p.is_file())
    assert 0 < len(files) <= MAX_RESULTS, len(files)
    text = "\n".join(p.read_text() for p in [ROOT / "README.md", ROOT / "bench" / "README.md",
                                              *sorted((ROOT / "docs").glob("*.md")),
                                              *sorted((ROOT / "bench").rglob("*.py")),
                                              *sorted((ROOT / "tests").glob("*.py")),
                                              *sorted((ROOT / ".ci").glob("*"))])
    names = set(re.findall(r"(?:[\w./*-]*\{[^{}\s]*\}[\w.{},*-]*|[\w./-]+\*[\w.*-]*)"
                           r"\.(?:json|png|txt|log)", text))
    patterns = {e.rpartition("bench/results/")[2] for n in names for e in _braces(n)}
    uncited = [f for f in files if f not in text and f.rpartition("/")[2] not in text
               and not any(fnmatch.fnmatch(f, p) or fnmatch.fnmatch(f.rpartition("/")[2], p)
                           for p in patterns)]
    assert uncited == [], uncited


def _braces(s: str) -> list[str]:
    """``a{b,c}d`` -> ``["abd", "acd"]`` (nested and repeated braces too)."""
    m = re.search(r"\{([^{}]*)\}", s)
    if m is None:
        return [s]
    return [x for alt in m.group(1).split(",") for x in _braces(s[:m.start()] + alt + s[m.end():])]
