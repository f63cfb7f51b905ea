"""The floors of the package, held: no module imports a floor above its own, no import cycle, no
oversized function or module.

Every import is parsed, the ones inside functions and under ``TYPE_CHECKING`` included: a lazy import
hides a cycle, it does not remove it. The floors, from the ground up, are drawn in
``docs/architecture.md``; this table is their one statement.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "megatron_2bw"

# unit (top-level package or module of megatron_2bw) -> floor; a unit may import its own floor and below.
FLOORS = {
    "errors": 0,
    "schedule": 1,
    "config": 2, "yaml_cfg": 2, "fused": 2, "data": 2, "testing": 2,
    "parallel_state": 3,
    "tensor_parallel": 4, "optimizer": 4, "context_parallel": 4, "moe": 4,
    "models": 5, "pipeline": 5,
    "checkpoint": 6,
    "export": 7, "flags": 7,
    "cli": 8,
    "planner": 9,
    "training": 10,
    "__init__": 11,
}
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 500


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, imported module of this package) for every import in ``path``, wherever it stands."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("megatron_2bw")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("megatron_2bw"):
                continue
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
            out += [(node.lineno, s) for s in subs] or [(node.lineno, target)]
    return out


def test_every_unit_has_a_floor():
    units = {unit_of(m) for m in MODULES}
    assert units <= set(FLOORS), f"units without a floor in FLOORS: {sorted(units - set(FLOORS))}"


def test_no_upward_import():
    upward = []
    for mod, path in MODULES.items():
        mine = FLOORS[unit_of(mod)]
        for line, target in imports_of(path):
            if FLOORS[unit_of(target)] > mine:
                upward.append(f"{path.relative_to(ROOT.parent)}:{line} {unit_of(mod)} -> {unit_of(target)} ({target})")
    assert not upward, f"{len(upward)} upward imports:\n" + "\n".join(upward)


# units of one floor that must not see each other: the pipeline runs any ``layer(x, batch)`` list, so it never
# imports the models, and the models never reach into the engine
APART = (("models", "pipeline"),)


def test_the_pipeline_and_the_models_stay_apart():
    crossing = []
    for mod, path in MODULES.items():
        for line, target in imports_of(path):
            pair = {unit_of(mod), unit_of(target)}
            if any(pair == set(apart) for apart in APART):
                crossing.append(f"{path.relative_to(ROOT.parent)}:{line} {unit_of(mod)} -> {unit_of(target)}")
    assert not crossing, "\n".join(crossing)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1; stack.append(root); on.add(root)
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
                        x = stack.pop(); on.discard(x); comp.append(x)
                        if x == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif nxt not in index:
                index[nxt] = low[nxt] = counter[0]; counter[0] += 1; stack.append(nxt); on.add(nxt)
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


@pytest.mark.parametrize("limit", [MAX_FUNCTION_LINES])
def test_no_function_over_the_limit(limit):
    long = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    long.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name} {n} lines")
    assert not long, f"functions over {limit} lines:\n" + "\n".join(long)


def test_no_module_over_the_limit():
    big = [f"{p.relative_to(ROOT.parent)} {n}" for p in ROOT.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not big, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(big)
