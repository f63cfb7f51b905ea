"""The floors of the package, held: no module imports a floor above its own, units that must stay apart do,
the library never imports its tests, no import cycle, no oversized function or module (in the library and in
``benchmarks/``).

Every import is parsed, the ones inside functions and under ``TYPE_CHECKING`` included: a lazy import
hides a cycle, it does not remove it. So is every import by name (``importlib.import_module``,
``__import__``): its target is read from the literals it is built of (a string, an f-string whose holes are
``__package__``/``__name__`` or read a module-level literal table, a loop over such a table), and a target
that cannot be read so is itself a failure. The floors, from the ground up, are drawn in
``docs/architecture.md``; this table is their one statement.
"""

from __future__ import annotations

import ast
import functools
import itertools
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "megatron_2bw"
SIZE_RULED = (ROOT, REPO / "benchmarks")  # the library and the benchmarks keep the same size rules

# unit (top-level package or module of megatron_2bw) -> floor; a unit may import its own floor and below.
FLOORS = {
    "errors": 0, "faults": 0,  # torch-free leaves: the one-line error, the engine's fault hooks
    "schedule": 1,
    "config": 2, "yaml_cfg": 2, "fused": 2, "data": 2,
    # the command line (torch-free, reads only the configs) beside the process groups
    "flags": 3, "argv": 3, "cli": 3, "parallel_state": 3, "local_workers": 3,
    "tensor_parallel": 4, "optimizer": 4, "context_parallel": 4, "moe": 4,
    "models": 5, "pipeline": 5,
    "checkpoint": 6,
    "export": 7,
    "planner": 8,
    "training": 9,
    "__init__": 10,
}
# units of one floor that must not see each other, and why:
APART = (
    # the pipeline runs any ``layer(x, batch)`` list, so it never imports the models, and the models never
    # reach into the engine
    ("models", "pipeline"),
    # the command line is text and configs: it never starts processes or builds groups, and they never parse
    *itertools.product(("flags", "argv", "cli"), ("parallel_state", "local_workers")),
    # the fault hooks are their own root: nothing an error line needs, nothing that needs one
    ("errors", "faults"),
    # the configs are validated values: they do not read data, kernels or YAML, and those do not need each other
    ("config", "data"), ("config", "fused"), ("config", "yaml_cfg"), ("data", "fused"), ("data", "yaml_cfg"),
    ("fused", "yaml_cfg"),
    # the optimizer updates flat buffers whatever split them: it never imports the parallel layers
    ("optimizer", "tensor_parallel"), ("optimizer", "context_parallel"),
)
# what the library must never import: its tests (and their helpers, imported by bare name), the benchmarks,
# the tools and the entry points
OUTSIDE = {"tests", "benchmarks", "tools", "pretrain_gpt", "pretrain_bert", "megatron_2bw.testing",
           *(p.stem for p in (REPO / "tests").glob("*.py"))}
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 500


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


# ---------------------------------------------------------------------------- reading the imports
def _literals(tree: ast.Module) -> dict[str, list[str]]:
    """Module-level names bound to a literal -> every string inside it (a table's keys and values)."""
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            try:
                ast.literal_eval(node.value)
            except (ValueError, TypeError, SyntaxError):
                continue
            strings = [c.value for c in ast.walk(node.value)
                       if isinstance(c, ast.Constant) and isinstance(c.value, str)]
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Name):
                    out[t.id] = strings
    return out


def _loop_tables(tree: ast.Module, literals: dict[str, list[str]]) -> dict[str, list[str]]:
    """Names bound by a ``for`` over a module-level literal -> that literal's strings."""
    out: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.For) and isinstance(node.iter, ast.Name) and node.iter.id in literals:
            for t in ast.walk(node.target):
                if isinstance(t, ast.Name):
                    out[t.id] = literals[node.iter.id]
    return out


def _strings(node: ast.AST, names: dict[str, list[str]]) -> list[str] | None:
    """Every string ``node`` can evaluate to, from literals alone; None when it is not built of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.Subscript):
        root = node.value
        while isinstance(root, ast.Subscript):
            root = root.value
        return names.get(root.id) if isinstance(root, ast.Name) else None
    if isinstance(node, ast.FormattedValue):
        return _strings(node.value, names)
    if isinstance(node, ast.JoinedStr):
        parts = [_strings(v, names) for v in node.values]
        return None if None in parts else ["".join(p) for p in itertools.product(*parts)]
    return None


def _by_name(call: ast.Call) -> bool:
    f = call.func
    return (isinstance(f, ast.Attribute) and f.attr == "import_module") or (
        isinstance(f, ast.Name) and f.id in ("import_module", "__import__"))


def _absolute(target: str, package: str | None) -> str:
    """``importlib``'s resolution of a relative name against ``package``."""
    if not target.startswith(".") or package is None:
        return target
    level = len(target) - len(target.lstrip("."))
    base = package.split(".")[: len(package.split(".")) - (level - 1)]
    return ".".join(base + ([target[level:]] if target[level:] else []))


def _imported_by_name(call: ast.Call, names: dict[str, list[str]]) -> list[str] | None:
    """The modules an ``import_module``/``__import__`` call can load (None: not readable from literals)."""
    if not call.args:
        return None
    targets = _strings(call.args[0], names)
    package = None  # import_module's second argument (``__import__``'s is its globals)
    if not (isinstance(call.func, ast.Name) and call.func.id == "__import__"):
        given = [k.value for k in call.keywords if k.arg == "package"]
        package = call.args[1] if len(call.args) > 1 else given[0] if given else None
    packages = [None] if package is None else _strings(package, names)
    if targets is None or packages is None:
        return None
    found = {_absolute(t, p) for t in targets for p in packages}
    # a table's strings hold more than module names (its keys): keep what is a module of the package or
    # lies outside it; a call none of whose candidates is either is unreadable
    kept = sorted(t for t in found if t in MODULES or _outside(t) or not t.startswith(("megatron_2bw", ".")))
    return kept or None


def _outside(target: str) -> bool:
    return target.split(".")[0] in OUTSIDE or target == "megatron_2bw.testing" or target.startswith(
        "megatron_2bw.testing.")


def imports_in(source: str, me: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, imported module) for every import in the source of module ``me``, wherever it stands, by
    name included; ``"?"`` for an import by name whose target cannot be read from literals."""
    package = me if is_package else me.rsplit(".", 1)[0]
    tree = ast.parse(source)
    literals = _literals(tree)
    names = {**literals, **_loop_tables(tree, literals), "__package__": [package], "__name__": [me]}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _absolute("." * node.level + (node.module or ""), package) if node.level else node.module or ""
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
            out += [(node.lineno, s) for s in subs] or [(node.lineno, target)]
        elif isinstance(node, ast.Call) and _by_name(node):
            out += [(node.lineno, t) for t in _imported_by_name(node, names) or ["?"]]
    return out


@functools.cache
def all_imports_of(path: Path) -> tuple[tuple[int, str], ...]:
    """Every import of the package's module at ``path`` (parsed once for all the tests)."""
    return tuple(imports_in(path.read_text(), module_name(path), path.name == "__init__.py"))


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, imported module of this package, or ``"?"``) for every import in ``path``."""
    return [(line, t) for line, t in all_imports_of(path) if t == "?" or t.startswith("megatron_2bw")]


def problems(module: str, found: list[tuple[int, str]]) -> list[str]:
    """What ``module``'s imports break: a floor above its own, an apart unit, the outside, an unreadable target."""
    out, mine = [], unit_of(module)
    for line, target in found:
        if target == "?":
            out.append(f"{module}:{line} imports by a name the test cannot read (build it from literals)")
        elif _outside(target):
            out.append(f"{module}:{line} imports {target}, which is not the library")
        elif target.startswith("megatron_2bw"):
            theirs = unit_of(target)
            if FLOORS.get(theirs, len(FLOORS)) > FLOORS[mine]:
                out.append(f"{module}:{line} {mine} -> {theirs} ({target}) is upward")
            if any({mine, theirs} == set(pair) for pair in APART):
                out.append(f"{module}:{line} {mine} -> {theirs} ({target}): these stay apart")
    return out


# ---------------------------------------------------------------------------- the package
def test_every_unit_has_a_floor():
    units = {unit_of(m) for m in MODULES}
    assert units <= set(FLOORS), f"units without a floor in FLOORS: {sorted(units - set(FLOORS))}"
    assert {u for pair in APART for u in pair} <= set(FLOORS)


def test_apart_units_share_a_floor():
    """An APART pair states what the floors alone would allow: two units of one floor."""
    assert all(FLOORS[a] == FLOORS[b] for a, b in APART), [p for p in APART if FLOORS[p[0]] != FLOORS[p[1]]]


def test_no_upward_import():
    upward = []
    for mod, path in MODULES.items():
        mine = FLOORS[unit_of(mod)]
        for line, target in imports_of(path):
            if target != "?" and FLOORS[unit_of(target)] > mine:
                upward.append(f"{path.relative_to(ROOT.parent)}:{line} {unit_of(mod)} -> {unit_of(target)} ({target})")
    assert not upward, f"{len(upward)} upward imports:\n" + "\n".join(upward)


def test_the_pipeline_and_the_models_stay_apart():
    crossing = []
    for mod, path in MODULES.items():
        for line, target in imports_of(path):
            pair = {unit_of(mod), unit_of(target)}
            if target != "?" and any(pair == set(apart) for apart in APART):
                crossing.append(f"{path.relative_to(ROOT.parent)}:{line} {unit_of(mod)} -> {unit_of(target)}")
    assert not crossing, "\n".join(crossing)


def test_every_import_is_read_and_follows_the_rules():
    found = {m: [(line, t) for line, t in all_imports_of(p)
                 if t == "?" or t.startswith("megatron_2bw") or _outside(t)]
             for m, p in MODULES.items()}
    bad = [msg for m, f in found.items() for msg in problems(m, f)]
    assert not bad, "\n".join(bad)


def test_the_library_never_imports_its_tests():
    """Not even lazily: the fault hooks and the local-workers helper are the library's own (floors 0 and 3)."""
    assert not (ROOT / "testing").exists()
    outside = [msg for m, p in MODULES.items()
               for msg in problems(m, list(all_imports_of(p)))
               if "not the library" in msg]
    assert not outside, "\n".join(outside)


def test_the_checkpoint_format_table_names_every_format():
    from megatron_2bw.checkpoint.formats import MODULES as FORMAT_MODULES
    from megatron_2bw.config import CKPT_FORMATS

    assert set(FORMAT_MODULES) == set(CKPT_FORMATS)
    assert all(f"megatron_2bw.checkpoint.{m}" in MODULES for m in FORMAT_MODULES.values())


# ---------------------------------------------------------------------------- the test bites (synthetic source)
@pytest.mark.parametrize("module,source,why", [
    ("megatron_2bw.schedule.actions", "def _m():\n    from ..training import loop\n", "upward"),
    ("megatron_2bw.schedule.actions", "import importlib\nimportlib.import_module('megatron_2bw.training.loop')\n",
     "upward"),
    ("megatron_2bw.config.run", "__import__('megatron_2bw.cli')\n", "upward"),
    ("megatron_2bw.checkpoint.formats", "import importlib\nT = {'a': 'loop'}\n"
     "def f(n):\n    return importlib.import_module(f'megatron_2bw.training.{T[n]}')\n", "upward"),
    ("megatron_2bw.config.run", "import importlib\nimportlib.import_module('..training.loop', __package__)\n",
     "upward"),
    ("megatron_2bw.pipeline.executor", "from ..testing.faults import FaultInjector\n", "not the library"),
    ("megatron_2bw.planner.profiler", "def f():\n    from multiproc import run_workers\n", "not the library"),
    ("megatron_2bw.training.loop", "import importlib\nimportlib.import_module('megatron_2bw.testing.faults')\n",
     "not the library"),
    ("megatron_2bw.fused", "import importlib\ndef f(name):\n    return importlib.import_module(name)\n",
     "cannot read"),
    ("megatron_2bw.models.gpt", "from ..pipeline import executor\n", "stay apart"),
    ("megatron_2bw.flags", "from .parallel_state import build_state\n", "stay apart"),
])
def test_a_mutant_fails_the_rules(module, source, why):
    found = imports_in(source, module)
    assert any(why in msg for msg in problems(module, found)), (found, problems(module, found))


@pytest.mark.parametrize("module,source,want", [
    ("megatron_2bw.checkpoint.formats", "import importlib\nM = {'torch': 'torch_format'}\n"
     "def g(n):\n    return importlib.import_module(f'{__package__}.{M[n]}')\n",
     "megatron_2bw.checkpoint.torch_format"),
    ("megatron_2bw.checkpoint.dist_checkpoint", "import importlib\nL = {'save': 'writer'}\n"
     "def g(n):\n    return importlib.import_module(f'.{L[n]}', __name__)\n",
     "megatron_2bw.checkpoint.dist_checkpoint.writer"),
])
def test_an_import_by_name_is_read(module, source, want):
    found = imports_in(source, module, is_package=module.endswith("dist_checkpoint"))
    assert [t for _, t in found if t.startswith("megatron_2bw")] == [want]
    assert not problems(module, found)


# ---------------------------------------------------------------------------- cycles
def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        x = stack.pop()
                        on.discard(x)
                        comp.append(x)
                        if x == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif nxt not in index:
                index[nxt] = low[nxt] = counter[0]
                counter[0] += 1
                stack.append(nxt)
                on.add(nxt)
                work.append((nxt, iter(sorted(graph.get(nxt, ())))))
            elif nxt in on:
                low[node] = min(low[node], index[nxt])
    return out


def test_no_import_cycle():
    graph = {m: {t for _, t in imports_of(p) if t in MODULES and t != m} for m, p in MODULES.items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_a_cycle_through_an_import_by_name_is_found():
    """The loop the registry had: a format module imports the registry that loads it by name."""
    registry = imports_in("import importlib\nM = {'torch': 'torch_format'}\n"
                          "def get(n):\n    return importlib.import_module(f'{__package__}.{M[n]}')\n",
                          "megatron_2bw.checkpoint.formats")
    graph = {"megatron_2bw.checkpoint.formats": {t for _, t in registry},
             "megatron_2bw.checkpoint.torch_format": {"megatron_2bw.checkpoint.formats"}}
    assert _cycles(graph) == [["megatron_2bw.checkpoint.formats", "megatron_2bw.checkpoint.torch_format"]]


# ---------------------------------------------------------------------------- sizes
def _sized() -> list[Path]:
    return [p for root in SIZE_RULED for p in sorted(root.rglob("*.py"))]


@pytest.mark.parametrize("limit", [MAX_FUNCTION_LINES])
def test_no_function_over_the_limit(limit):
    long = []
    for path in _sized():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} {n} lines")
    assert not long, f"functions over {limit} lines:\n" + "\n".join(long)


def test_no_module_over_the_limit():
    big = [f"{p.relative_to(REPO)} {n}" for p in _sized() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not big, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(big)
