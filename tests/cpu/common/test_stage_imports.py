"""The stage order of docs/DESIGN.md holds in the code: no module of a stage imports a later one.

    common <- pins <- fetch <- patch_gate <- kernel_cache <- jit_cache <- image

Every tools/**/*.py is parsed with ast (nothing is imported) and each `import tools.X...` /
`from tools.X... import ...`, at module level or inside a function, is mapped to the stage it
names. tools/bench and tools/gpu_suite time and run the stages, so they may import any of them;
no stage may import them. The one exception is the body of a module-level `if __name__ ==
"__main__":` guard: it runs only when the file is the program (`python3 -m tools.pins.debian`
runs the Debian CLI, whose fetch commands live in tools/fetch), never for an importer, so it adds
no arrow to the import graph.
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
STAGES = ["common", "pins", "fetch", "patch_gate", "kernel_cache", "jit_cache", "image"]
# Packages that time or run the stages (they may import any stage; no stage may import them).
RUNNERS = ["bench", "gpu_suite"]


def stage_of(module: str) -> str | None:
    """The stage (or runner) a dotted module name under `tools` belongs to; None for `tools`."""
    parts = module.split(".")
    if parts[0] != "tools" or len(parts) < 2:
        return None
    return parts[1]


def _is_main_guard(node: ast.stmt) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and len(test.comparators) == 1 and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value == "__main__")


def imported_modules(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every tools module `path` imports, outside a `__main__` guard."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    nodes = [n for top in tree.body if not _is_main_guard(top) for n in ast.walk(top)]
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from tools import pins` names the package tools.pins, `from tools.pins import lock` a module.
            found += [(node.lineno, f"{base}.{a.name}" if base == "tools" else base) for a in node.names]
    return sorted({(line, name) for line, name in found if name == "tools" or name.startswith("tools.")})


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


def _copy_tools(tmp_path: Path) -> Path:
    copy = tmp_path / "tools"
    shutil.copytree(TOOLS, copy, ignore=shutil.ignore_patterns("__pycache__", "*.bzl", "BUILD.bazel"))
    return copy


@pytest.mark.parametrize("planted, expected", [
    ("import tools.image.layer\n", "tools/pins/lock.py:{line}: pins imports image (tools.image.layer)"),
    ("def f():\n    from tools.fetch.cache import Cache\n",
     "tools/pins/lock.py:{line}: pins imports fetch (tools.fetch.cache)"),
    ("from tools import kernel_cache\n", "tools/pins/lock.py:{line}: pins imports kernel_cache (tools.kernel_cache)"),
    ("from tools.gpu_suite import site\n", "tools/pins/lock.py:{line}: pins imports gpu_suite (tools.gpu_suite)"),
], ids=["module-level", "in-a-function", "from-tools", "a-runner"])
def test_a_planted_upward_import_is_named(tmp_path: Path, planted: str, expected: str) -> None:
    copy = _copy_tools(tmp_path)
    lock = copy / "pins" / "lock.py"
    text = lock.read_text()
    line = text.count("\n") + 1 + planted.count("\n") - 1
    lock.write_text(text + planted)
    assert upward_imports(copy) == [expected.format(line=line)]


def test_only_a_module_level_main_guard_is_exempt(tmp_path: Path) -> None:
    copy = _copy_tools(tmp_path)
    lock = copy / "pins" / "lock.py"
    text = lock.read_text()
    lock.write_text(text + 'if __name__ == "__main__":\n    from tools.fetch.cli import main\n')
    assert upward_imports(copy) == []
    lock.write_text(text + 'def run():\n    if __name__ == "__main__":\n        from tools.fetch.cli import main\n')
    assert upward_imports(copy) == [f"tools/pins/lock.py:{text.count(chr(10)) + 3}: pins imports fetch (tools.fetch.cli)"]


def test_a_package_outside_the_stage_order_is_named(tmp_path: Path) -> None:
    copy = _copy_tools(tmp_path)
    (copy / "extra").mkdir()
    (copy / "extra" / "__init__.py").write_text("")
    assert upward_imports(copy) == ["tools/extra/__init__.py: package tools/extra is in no stage; add it to "
                                    "STAGES or RUNNERS"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
