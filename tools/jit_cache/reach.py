"""Which modules of a source tree a launch profile's server can run: a static import closure.

From root modules (the entry point, the model module of the profile's architecture, modules the
profile's settings select), follow every import a reached module makes: at module level and
inside functions (SGLang imports most backends lazily, inside the function that picks them), and
`importlib.import_module("literal")`. Pruned, because the image runs one platform and one
configuration (reach.json names each rule's inputs):

- `if TYPE_CHECKING:` bodies (never run);
- the body of an `if` whose test is a platform predicate of a platform the image is not (ROCm,
  NPU, XPU, ...: `_is_hip`, `is_npu()`, `a and _is_hip`, `not _is_cuda`), and the `else` of
  `if not <that>` or `if _is_cuda`;
- modules of packages that run only on another platform (`sglang.srt.hardware_backend.npu`, ...);
- a function registered under a key (`@register_attention_backend("flashinfer")`) whose key the
  profile does not select.

Over-approximates: an import inside a branch the profile never takes is followed (settings are
not evaluated), and a reached module's every kernel counts, called or not. Under-approximates:
imports built from strings at run time (other than literal import_module), plugins, exec'd
sources, and code outside the tree (FlashInfer's own Python is scanned only as API names).
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field, fields
from typing import Iterable, Mapping

from tools.jit_cache.sites import dotted


def module_name(path: str) -> str | None:
    """`sglang.a.b` for `sglang/a/b.py` (`sglang.a` for its `__init__.py`); None for non-Python."""
    if not path.endswith(".py"):
        return None
    parts = path[:-3].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if not all(p.isidentifier() for p in parts):
        return None
    return ".".join(parts)


@dataclass(frozen=True)
class Pruning:
    """What the closure does not follow (reach.json `pruning`)."""

    other_platform_predicates: frozenset[str]
    cuda_predicates: frozenset[str] = frozenset()
    other_platform_modules: tuple[str, ...] = ()  # packages whose code runs only on another platform
    registries: Mapping[str, frozenset[str]] = field(default_factory=dict)  # decorator -> selected keys


def _predicate_name(node: ast.AST) -> str | None:
    """`_is_hip` for `_is_hip`, `is_hip()`, `utils.is_hip()`."""
    if isinstance(node, ast.Call) and not node.args and not node.keywords:
        node = node.func
    name = dotted(node)
    return name.rsplit(".", 1)[-1] if name else None


def _other_platform(test: ast.AST, pruning: Pruning) -> bool:
    """The test holds only on a platform the image is not."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(_other_platform(v, pruning) for v in test.values)
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or):
        return all(_other_platform(v, pruning) for v in test.values)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _predicate_name(test.operand) in pruning.cuda_predicates
    return _predicate_name(test) in pruning.other_platform_predicates


def _cuda_only(test: ast.AST, pruning: Pruning) -> bool:
    """The test holds on CUDA (the image's platform): its `else` runs elsewhere."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _predicate_name(test.operand) in pruning.other_platform_predicates
    return _predicate_name(test) in pruning.cuda_predicates


def _type_checking(test: ast.AST) -> bool:
    return dotted(test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


class _ImportCollector(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, pruning: Pruning, lazy: bool = True):
        self.package = module if is_package else module.rpartition(".")[0]
        self.pruning = pruning
        self.lazy = lazy
        self.imports: list[tuple[str, tuple[str, ...]]] = []  # (module, names imported from it)

    def visit_If(self, node: ast.If) -> None:
        if _type_checking(node.test) or _other_platform(node.test, self.pruning):
            for child in node.orelse:
                self.visit(child)
            return
        if _cuda_only(node.test, self.pruning):
            for child in node.body:
                self.visit(child)
            return
        self.generic_visit(node)

    def _visit_def(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        if not self.lazy:
            return
        for dec in node.decorator_list:
            if isinstance(dec, ast.Call) and dec.args and isinstance(dec.args[0], ast.Constant):
                name = dotted(dec.func)
                selected = self.pruning.registries.get(name.rsplit(".", 1)[-1] if name else "")
                if selected is not None and dec.args[0].value not in selected:
                    return
        self.generic_visit(node)

    visit_FunctionDef = _visit_def
    visit_AsyncFunctionDef = _visit_def

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self.imports.append((a.name, ()))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".") if self.package else []
            if node.level > 1:
                base = base[: len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        if target:
            self.imports.append((target, tuple(a.name for a in node.names)))

    def visit_Call(self, node: ast.Call) -> None:
        name = dotted(node.func)
        if name in ("importlib.import_module", "import_module") and node.args and (
                isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            self.imports.append((node.args[0].value, ()))
        self.generic_visit(node)


def imports_of(module: str, is_package: bool, tree: ast.Module, pruning: Pruning,
               lazy: bool = True) -> list[tuple[str, tuple[str, ...]]]:
    """What `module` imports; `lazy`: also inside functions (else only what importing it runs)."""
    collector = _ImportCollector(module, is_package, pruning, lazy)
    collector.visit(tree)
    return collector.imports


def _with_parents(name: str) -> Iterable[str]:
    """Importing a.b.c runs a/__init__, a/b/__init__ and a/b/c."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        yield ".".join(parts[:i])


def _pruning_key(pruning: Pruning) -> tuple:
    """Every field of the pruning, hashable (a mapping as its sorted items): a field added to
    Pruning is part of the memo's key without anyone remembering to add it here."""
    values = (getattr(pruning, f.name) for f in fields(pruning))
    return tuple(tuple(sorted(v.items())) if isinstance(v, Mapping) else v for v in values)


def closure(roots: Iterable[str], modules: Mapping[str, str], parse, pruning: Pruning, lazy: bool = True,
            memo: dict[tuple, list[tuple[str, tuple[str, ...]]]] | None = None) -> set[str]:
    """Module names reached from `roots`. `modules`: module name -> path in the tree; `parse(path)`
    gives a module's AST. `lazy`: follow imports inside functions too (else: what importing the
    roots loads at startup). `memo`: one dict for every closure over the same `modules` and
    `parse`; a module's imports depend only on its AST, the pruning and `lazy`, and walking the
    ASTs again for each launch profile was most of an inventory's time."""
    packages = {m for m, p in modules.items() if p.endswith("/__init__.py")}
    skipped = tuple(p + "." for p in pruning.other_platform_modules)
    memo = {} if memo is None else memo
    pruning_key = _pruning_key(pruning)
    reached: set[str] = set()
    todo = [r for root in roots for r in _with_parents(root)]
    while todo:
        name = todo.pop()
        if name in reached or name not in modules or name in pruning.other_platform_modules or name.startswith(skipped):
            continue
        reached.add(name)
        key = (name, lazy, pruning_key)
        if key not in memo:
            memo[key] = imports_of(name, name in packages, parse(modules[name]), pruning, lazy)
        for target, names in memo[key]:
            todo.extend(_with_parents(target))
            todo.extend(f"{target}.{n}" for n in names if f"{target}.{n}" in modules)
    return reached
