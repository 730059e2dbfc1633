"""The stage order of docs/DESIGN.md holds in the code: no module of a stage imports a later one,
and no module imports one that imports it back (no circle, at any depth).

    common <- pins <- fetch <- patch_gate <- kernel_cache <- jit_cache <- image

Every tools/**/*.py is parsed with ast (nothing is imported) and each `import tools.X...` /
`from tools.X... import ...` is mapped to the stage and the module it names: at module level, inside
a function, under TYPE_CHECKING or in a `__main__` guard alike (a function-level import that only
dodges a circle is still an arrow). tools/bench and tools/gpu_suite time and run the stages, so
they may import any of them; no stage may import them.
"""
from __future__ import annotations

import ast
import shutil
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).absolute().parents[3]
TOOLS = REPO_ROOT / "tools"

# The stage order (docs/DESIGN.md), lowest first: a stage may import itself and earlier stages.
STAGES = ["common", "pins", "fetch", "patch_gate", "kernel_cache", "jit_cache", "image", "rbe"]
# Packages that time or run the stages (they may import any stage; no stage may import them).
RUNNERS = ["bench", "gpu_suite"]


def stage_of(module: str) -> str | None:
    """The stage (or runner) a dotted module name under `tools` belongs to; None for `tools`."""
    parts = module.split(".")
    if parts[0] != "tools" or len(parts) < 2:
        return None
    return parts[1]


def imported_modules(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every tools module `path` imports, wherever the import stands.
    `from tools.a import b` names tools.a.b where that is a module, else tools.a."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found += [(node.lineno, f"{base}.{a.name}" if _is_module(path, module, f"{base}.{a.name}")
                       else base) for a in node.names]
    return sorted({(line, name) for line, name in found if name == "tools" or name.startswith("tools.")})


def _is_module(path: Path, module: str, name: str) -> bool:
    """Whether dotted `name` is a module or package under the tools/ tree that holds `path`."""
    root = path.parents[len(module.split(".")) - (0 if path.name == "__init__.py" else 1)]
    rel = Path(*name.split("."))
    return (root / rel).with_suffix(".py").is_file() or (root / rel / "__init__.py").is_file()


def _modules(tools_dir: Path) -> dict[str, Path]:
    result = {}
    for path in sorted(tools_dir.rglob("*.py")):
        module = ".".join(path.relative_to(tools_dir.parent).with_suffix("").parts)
        result[module.removesuffix(".__init__")] = path
    return result


def import_circles(tools_dir: Path) -> list[str]:
    """Every circle of imports between tools modules, as `a.py -> b.py -> a.py` (the files)."""
    modules = _modules(tools_dir)
    graph = {m: sorted({name for _, name in imported_modules(p, m) if name in modules and name != m})
             for m, p in modules.items()}
    circles, index, low, stack, on_stack = [], {}, {}, [], set()

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(_one_circle(sorted(component), graph))

    for m in graph:
        if m not in index:
            visit(m)
    rel = {m: str(p.relative_to(tools_dir.parent)) for m, p in modules.items()}
    return sorted(" -> ".join(rel[m] for m in circle) for circle in circles)


def _one_circle(component: list[str], graph: dict[str, list[str]]) -> list[str]:
    """A path from the component's first module back to itself, inside the component."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in graph[v]:
            if w == start:
                return paths[v] + [start]
            if w in members and w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    raise AssertionError(component)


def upward_imports(tools_dir: Path) -> list[str]:
    """Every import that runs against the stage order, as `path:line: stage imports stage (module)`."""
    rank = {s: i for i, s in enumerate(STAGES)}
    problems = []
    for path in sorted(tools_dir.rglob("*.py")):
        rel = path.relative_to(tools_dir.parent)
        module = ".".join(rel.with_suffix("").parts)
        if module.endswith(".__init__"):
            module = module[: -len(".__init__")]
        own = stage_of(module)
        if own is None or own in RUNNERS:
            continue
        if own not in rank:
            problems.append(f"{rel}: package tools/{own} is in no stage; add it to STAGES or RUNNERS")
            continue
        for line, name in imported_modules(path, module):
            other = stage_of(name)
            if other is None or other == own:
                continue
            if other in RUNNERS or other not in rank or rank[other] > rank[own]:
                problems.append(f"{rel}:{line}: {own} imports {other} ({name})")
    return problems


def test_no_stage_imports_a_later_one() -> None:
    stages_seen = {p.parent.name for p in TOOLS.rglob("*.py")}
    # The check is not vacuous: every stage's and runner's sources are here (the test's deps).
    assert set(STAGES) | set(RUNNERS) <= stages_seen, sorted(set(STAGES) | set(RUNNERS) - stages_seen)
    assert upward_imports(TOOLS) == []


def test_no_import_circle() -> None:
    assert import_circles(TOOLS) == [], "give what both sides need one home below both"


def _copy_tools(tmp_path: Path) -> Path:
    copy = tmp_path / "tools"
    shutil.copytree(TOOLS, copy, ignore=shutil.ignore_patterns("__pycache__", "*.bzl", "BUILD.bazel"))
    return copy


@pytest.mark.parametrize("planted, expected", [
    ("import tools.image.layer\n", "tools/pins/lock.py:{line}: pins imports image (tools.image.layer)"),
    ("def f():\n    from tools.fetch.cache import Cache\n",
     "tools/pins/lock.py:{line}: pins imports fetch (tools.fetch.cache)"),
    ("from tools import kernel_cache\n", "tools/pins/lock.py:{line}: pins imports kernel_cache (tools.kernel_cache)"),
    ("from tools.gpu_suite import site\n", "tools/pins/lock.py:{line}: pins imports gpu_suite (tools.gpu_suite.site)"),
], ids=["module-level", "in-a-function", "from-tools", "a-runner"])
def test_a_planted_upward_import_is_named(tmp_path: Path, planted: str, expected: str) -> None:
    copy = _copy_tools(tmp_path)
    lock = copy / "pins" / "lock.py"
    text = lock.read_text()
    line = text.count("\n") + 1 + planted.count("\n") - 1
    lock.write_text(text + planted)
    assert upward_imports(copy) == [expected.format(line=line)]


def test_a_main_guard_import_counts_too(tmp_path: Path) -> None:
    copy = _copy_tools(tmp_path)
    lock = copy / "pins" / "lock.py"
    text = lock.read_text()
    lock.write_text(text + 'if __name__ == "__main__":\n    from tools.fetch.cli import main\n')
    assert upward_imports(copy) == [f"tools/pins/lock.py:{text.count(chr(10)) + 2}: pins imports fetch (tools.fetch.cli)"]


@pytest.mark.parametrize("planted, expected", [
    ("if TYPE_CHECKING:\n    from tools.pins.pypi import Wheel\n",
     "tools/pins/lock.py -> tools/pins/pypi.py -> tools/pins/lock.py"),
    ("def f():\n    from tools.common import files\n",
     None),
], ids=["type-checking-within-a-stage", "no-circle"])
def test_a_planted_circle_is_named_by_its_files(tmp_path: Path, planted: str, expected: str | None) -> None:
    copy = _copy_tools(tmp_path)
    lock = copy / "pins" / "lock.py"
    lock.write_text(lock.read_text() + planted)
    assert sorted(set(import_circles(copy)) - set(import_circles(TOOLS))) == ([expected] if expected else [])


def test_a_circle_through_a_function_level_import_is_named(tmp_path: Path) -> None:
    copy = _copy_tools(tmp_path)
    files = copy / "common" / "files.py"
    files.write_text(files.read_text() + "def f():\n    from tools.common import cache\n")
    cache = copy / "common" / "cache.py"
    cache.write_text(cache.read_text() + "from tools.common.files import MODE\n")
    assert sorted(set(import_circles(copy)) - set(import_circles(TOOLS))) == [
        "tools/common/cache.py -> tools/common/files.py -> tools/common/cache.py"]


def test_a_package_outside_the_stage_order_is_named(tmp_path: Path) -> None:
    copy = _copy_tools(tmp_path)
    (copy / "extra").mkdir()
    (copy / "extra" / "__init__.py").write_text("")
    assert upward_imports(copy) == ["tools/extra/__init__.py: package tools/extra is in no stage; add it to "
                                    "STAGES or RUNNERS"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
