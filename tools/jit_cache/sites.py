"""First-use compile sites of one Python module, found by reading its AST (nothing is imported).

A site is a place where serving compiles code the first time it runs:

- `sglang-jit`: a `load_jit(...)` call (SGLang's C++/CUDA JIT over tvm-ffi): the module-name
  arguments, the CUDA/C++ sources and the exported kernel templates; also a torch C++/CUDA
  extension built at first call (`torch.utils.cpp_extension.load`/`load_inline`, SGLang's
  `load_extension_with_recovery`), `use: torch-cpp-extension`;
- `triton`: a function that `@triton.jit` (or `triton.jit(fn)`) makes a kernel, with the
  `triton.autotune` configs (counted when the list can be evaluated without running code) and
  keys, and the `triton.heuristics` names laid over it; a `@helion.kernel` (`via: helion`, which
  compiles to Triton);
- `cute-dsl`: a `cute.compile(...)` call, or a `get_jit_cache(...)` call (SGLang's CuTe-DSL AOT
  cache, `sglang/kernels/jit/cute_aot_cache.py`);
- `inductor`: a `torch.compile` use (decorator or call);
- `flashinfer`: a FlashInfer API the module imports (`from flashinfer.x import f`,
  `import flashinfer.x`, `flashinfer.x.f` after `import flashinfer`).

Ids are stable across line moves: `<kind>:<file>:<name>` (a second site of the same name in a
file gets `#2`, in file order).
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any, Iterable

KINDS = ("flashinfer", "sglang-jit", "cute-dsl", "triton", "inductor")

# Autotune lists longer than this are not expanded (a comprehension over big ranges).
_MAX_CONFIGS = 100_000
_TRITON_DECORATORS = {"jit", "autotune", "heuristics"}


@dataclass
class Site:
    kind: str
    file: str
    name: str
    details: dict[str, Any] = field(default_factory=dict)
    id: str = ""


def dotted(node: ast.AST) -> str | None:
    """`a.b.c` for a Name/Attribute chain, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def short(node: ast.AST, limit: int = 80) -> str:
    """A short rendering of an argument expression: a name, a literal, a call's callee."""
    if isinstance(node, ast.Constant):
        return repr(node.value)[:limit]
    name = dotted(node)
    if name:
        return name
    if isinstance(node, ast.Call):
        callee = dotted(node.func) or type(node.func).__name__
        return f"{callee}(...)"
    if isinstance(node, ast.JoinedStr):
        return "f" + repr("".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values))[:limit]
    if isinstance(node, ast.Starred):
        return "*" + short(node.value, limit)
    return f"<{type(node).__name__.lower()}>"


def _items(node: ast.AST) -> list[str] | str:
    """The elements of a list/tuple: strings as they are, other elements rendered short."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return [e.value if isinstance(e, ast.Constant) and isinstance(e.value, str) else short(e) for e in node.elts]
    return short(node)


def _strings(node: ast.AST | None) -> list[str] | None:
    if isinstance(node, (ast.List, ast.Tuple)) and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
        return [e.value for e in node.elts]  # type: ignore[union-attr]
    return None


def _template_head(node: ast.AST) -> str | None:
    """`SituAndMulKernel` of f"SituAndMulKernel<{args}>::run" (the kernel a wrapper exports)."""
    text = None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        text = node.value
    elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        text = str(node.values[0].value)
    if text is None:
        return None
    for stop in ("<", "("):
        text = text.split(stop)[0]
    return text or None


# torch's C++/CUDA extension JIT (ninja build at first call), and SGLang's wrapper of it.
_CPP_EXTENSION_LOADERS = {"torch.utils.cpp_extension.load", "torch.utils.cpp_extension.load_inline"}
_CPP_EXTENSION_WRAPPERS = {"load_extension_with_recovery"}
# Helion kernels compile to Triton at first call (and autotune).
_HELION_DECORATORS = {"helion.kernel"}


def _cpp_extension_details(call: ast.Call) -> dict[str, Any]:
    kw = {k.arg: k.value for k in call.keywords if k.arg}
    name = kw.get("name", call.args[0] if call.args else None)
    out: dict[str, Any] = {"use": "torch-cpp-extension", "ext_name": short(name) if name is not None else None}
    sources = kw.get("sources", call.args[1] if len(call.args) > 1 else None)
    if sources is not None:
        out["sources"] = _items(sources)
    return out


class _Imports:
    """Local names bound to triton, cute, torch and flashinfer in one module."""

    def __init__(self, tree: ast.Module):
        self.modules: dict[str, str] = {}  # local name -> module (import x.y as z)
        self.names: dict[str, str] = {}  # local name -> module.attr (from x import attr)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.modules[a.asname] = a.name
                    else:
                        self.modules.setdefault(a.name.split(".")[0], a.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    self.names[a.asname or a.name] = f"{node.module}.{a.name}"

    def resolve(self, name: str | None) -> str | None:
        """The absolute dotted name a local dotted name refers to (as far as imports tell)."""
        if not name:
            return None
        head, _, rest = name.partition(".")
        base = self.modules.get(head) or self.names.get(head)
        if base is None:
            return name
        return f"{base}.{rest}" if rest else base


def _is_triton(resolved: str | None) -> str | None:
    """'jit' / 'autotune' / 'heuristics' when `resolved` names triton's decorator."""
    if resolved and resolved.startswith("triton.") and resolved.rsplit(".", 1)[-1] in _TRITON_DECORATORS:
        return resolved.rsplit(".", 1)[-1]
    return None


def _is_cute_compile(resolved: str | None) -> bool:
    return bool(resolved) and (resolved == "cutlass.cute.compile" or resolved.endswith(".cute.compile")  # type: ignore[union-attr]
                               or resolved == "cute.compile")


class _ConstEval:
    """Evaluates an autotune config list without running code: literals, module-level constant
    names, comprehensions over literal lists and range(), simple arithmetic and comparisons."""

    class Unknown(Exception):
        pass

    def __init__(self, constants: dict[str, ast.AST]):
        self.constants = constants
        self.conditional = False  # the last length() went through a runtime-chosen constant

    def length(self, node: ast.AST) -> int | None:
        self.conditional = False
        try:
            return len(self.value(node, {}, configs=True))
        except (self.Unknown, TypeError, ValueError, ZeroDivisionError, RecursionError):
            return None

    def value(self, node: ast.AST, env: dict[str, Any], configs: bool = False) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            if node.id in env:
                return env[node.id]
            if node.id in self.constants:
                return self.value(self.constants[node.id], {}, configs)
            raise self.Unknown(node.id)
        if isinstance(node, (ast.List, ast.Tuple)):
            out: list[Any] = []
            for e in node.elts:
                if isinstance(e, ast.Starred):
                    out.extend(self.value(e.value, env, configs))
                elif configs and isinstance(e, ast.Call):
                    out.append("config")  # a triton.Config(...): counted, not evaluated
                else:
                    out.append(self.value(e, env))
            return out
        if isinstance(node, ast.ListComp):
            return self._comprehension(node, env, 0, configs)
        if isinstance(node, ast.Call) and dotted(node.func) == "range" and not node.keywords:
            args = [self.value(a, env) for a in node.args]
            r = range(*args)
            if len(r) > _MAX_CONFIGS:
                raise self.Unknown("range")
            return list(r)
        if isinstance(node, ast.BinOp):
            left, right = self.value(node.left, env, configs), self.value(node.right, env, configs)
            ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
                   ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b, ast.Pow: lambda a, b: a ** b}
            op = ops.get(type(node.op))
            if op is None or (isinstance(node.op, ast.Mult) and isinstance(left, list) and right > _MAX_CONFIGS):
                raise self.Unknown("op")
            return op(left, right)
        if isinstance(node, ast.IfExp):
            try:
                return self.value(node.body if self.value(node.test, env) else node.orelse, env, configs)
            except self.Unknown:
                pass
            # `[32, 64] if check_shared_mem() else [16, 32]`: decided on the device at import; the
            # count is known only when every choice has as many elements.
            body, orelse = self.value(node.body, env, configs), self.value(node.orelse, env, configs)
            if not (isinstance(body, list) and isinstance(orelse, list) and len(body) == len(orelse)):
                raise self.Unknown("runtime choice")
            self.conditional = True
            return body
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
            v = self.value(node.operand, env)
            return (not v) if isinstance(node.op, ast.Not) else -v
        if isinstance(node, ast.BoolOp):
            values = [self.value(v, env) for v in node.values]
            return all(values) if isinstance(node.op, ast.And) else any(values)
        if isinstance(node, ast.Compare):
            left = self.value(node.left, env)
            ops = {ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b, ast.Lt: lambda a, b: a < b,
                   ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b,
                   ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}
            for op, comparator in zip(node.ops, node.comparators):
                right = self.value(comparator, env)
                fn = ops.get(type(op))
                if fn is None or not fn(left, right):
                    return False
                left = right
            return True
        raise self.Unknown(type(node).__name__)

    def _comprehension(self, node: ast.ListComp, env: dict[str, Any], index: int, configs: bool) -> list[Any]:
        if index == len(node.generators):
            return ["config" if configs else self.value(node.elt, env)]
        gen = node.generators[index]
        if gen.is_async or not isinstance(gen.target, ast.Name):
            raise self.Unknown("target")
        out: list[Any] = []
        for item in self.value(gen.iter, env):
            inner = dict(env, **{gen.target.id: item})
            if all(self.value(cond, inner) for cond in gen.ifs):
                out.extend(self._comprehension(node, inner, index + 1, configs))
                if len(out) > _MAX_CONFIGS:
                    raise self.Unknown("size")
        return out


def _module_constants(tree: ast.Module) -> dict[str, ast.AST]:
    """Names assigned exactly once, unconditionally, at module level (an assignment under a
    module-level if/try/for/with makes the name conditional: not a constant)."""
    seen: dict[str, list[ast.AST | None]] = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                if isinstance(t, ast.Name):
                    seen.setdefault(t.id, []).append(node.value)
        elif isinstance(node, (ast.If, ast.Try, ast.For, ast.While, ast.With, ast.AugAssign)):
            for inner in ast.walk(node):
                if isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Store):
                    seen.setdefault(inner.id, []).append(None)
    return {name: values[0] for name, values in seen.items() if len(values) == 1 and values[0] is not None}


def _autotune_details(call: ast.Call, evaluator: _ConstEval) -> dict[str, Any]:
    configs = next((k.value for k in call.keywords if k.arg == "configs"), call.args[0] if call.args else None)
    key = next((k.value for k in call.keywords if k.arg == "key"), call.args[1] if len(call.args) > 1 else None)
    out: dict[str, Any] = {"configs": evaluator.length(configs) if configs is not None else None}
    if out["configs"] is not None and evaluator.conditional:
        out["configs_note"] = "through a module constant chosen at import on the device; every choice gives this count"
    keys = _strings(key)
    out["key"] = keys if keys is not None else (short(key) if key is not None else None)
    return out


def _heuristics_names(call: ast.Call) -> list[str] | str:
    arg = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "values"), None)
    if isinstance(arg, ast.Dict) and all(isinstance(k, ast.Constant) for k in arg.keys):
        return sorted(str(k.value) for k in arg.keys)  # type: ignore[union-attr]
    return short(arg) if arg is not None else "<none>"


def _jit_details(decorator: ast.AST) -> dict[str, Any]:
    if isinstance(decorator, ast.Call):
        for k in decorator.keywords:
            if k.arg == "do_not_specialize":
                names = _strings(k.value)
                return {"do_not_specialize": names if names is not None else short(k.value)}
    return {}


def _inductor_details(call: ast.Call | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in (call.keywords if call else []):
        if k.arg in ("dynamic", "mode", "fullgraph", "backend"):
            out[k.arg] = k.value.value if isinstance(k.value, ast.Constant) else short(k.value)
    return out


def _load_jit_details(call: ast.Call) -> dict[str, Any]:
    kw = {k.arg: k.value for k in call.keywords if k.arg}
    out: dict[str, Any] = {"module_args": [short(a) for a in call.args]}
    for key in ("cuda_files", "cpp_files", "extra_dependencies"):
        if key in kw:
            out[key] = _items(kw[key])
    for key in ("cuda_wrappers", "cpp_wrappers"):
        node = kw.get(key)
        if node is None:
            continue
        if isinstance(node, (ast.List, ast.Tuple)):
            wrappers = []
            for e in node.elts:
                if isinstance(e, ast.Tuple) and len(e.elts) == 2:
                    export = e.elts[0].value if isinstance(e.elts[0], ast.Constant) else short(e.elts[0])
                    wrappers.append([export, _template_head(e.elts[1]) or short(e.elts[1])])
                else:
                    wrappers.append([short(e), None])
            out[key] = wrappers
        else:
            out[key] = short(node)
    return out


class _Scanner(ast.NodeVisitor):
    def __init__(self, file: str, tree: ast.Module):
        self.file = file
        self.imports = _Imports(tree)
        self.evaluator = _ConstEval(_module_constants(tree))
        self.scope: list[str] = []
        self.sites: list[Site] = []
        self.decorator_calls: set[int] = set()
        # triton kernels by function name: autotune/heuristics applied by call attach to them.
        self.triton: dict[str, Site] = {}
        self.flashinfer_seen: set[str] = set()

    def qualname(self) -> str:
        return ".".join(self.scope) or "<module>"

    def add(self, kind: str, name: str, details: dict[str, Any]) -> Site:
        site = Site(kind=kind, file=self.file, name=name, details=details)
        self.sites.append(site)
        return site

    # Definitions: scope, decorators.
    def _visit_def(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        triton_parts: dict[str, Any] = {}
        is_triton = False
        for dec in node.decorator_list:
            callee = dec.func if isinstance(dec, ast.Call) else dec
            if isinstance(dec, ast.Call):
                self.decorator_calls.add(id(dec))
            resolved = self.imports.resolve(dotted(callee))
            which = _is_triton(resolved)
            if which == "jit":
                is_triton = True
                triton_parts.update(_jit_details(dec))
            elif which == "autotune" and isinstance(dec, ast.Call):
                triton_parts["autotune"] = _autotune_details(dec, self.evaluator)
            elif which == "heuristics" and isinstance(dec, ast.Call):
                triton_parts["heuristics"] = _heuristics_names(dec)
            elif resolved in _HELION_DECORATORS and not isinstance(node, ast.ClassDef):
                is_triton = True
                triton_parts["via"] = "helion"
            elif resolved == "torch.compile" and not isinstance(node, ast.ClassDef):
                self.add("inductor", ".".join(self.scope + [node.name]),
                         {"use": "decorator", **_inductor_details(dec if isinstance(dec, ast.Call) else None)})
        if is_triton:
            site = self.add("triton", ".".join(self.scope + [node.name]), triton_parts)
            self.triton[node.name] = site
        for dec in node.decorator_list:
            self.visit(dec)
        self.scope.append(node.name)
        for child in node.body:
            self.visit(child)
        self.scope.pop()

    visit_FunctionDef = _visit_def
    visit_AsyncFunctionDef = _visit_def
    visit_ClassDef = _visit_def

    def visit_Call(self, node: ast.Call) -> None:
        if id(node) not in self.decorator_calls:
            self._call(node)
        self.generic_visit(node)

    def _call(self, node: ast.Call) -> None:
        name = dotted(node.func)
        resolved = self.imports.resolve(name)
        tail = name.rsplit(".", 1)[-1] if name else None
        if tail == "load_jit":
            self.add("sglang-jit", self.qualname(), _load_jit_details(node))
        elif resolved in _CPP_EXTENSION_LOADERS or tail in _CPP_EXTENSION_WRAPPERS:
            self.add("sglang-jit", self.qualname(), _cpp_extension_details(node))
        elif tail == "get_jit_cache" and (resolved or "").endswith("cute_aot_cache.get_jit_cache") or (
                tail == "get_jit_cache" and self.file.endswith("cute_aot_cache.py")):
            self.add("cute-dsl", self.qualname(), {"use": "aot-cache", "args": [short(a) for a in node.args]})
        elif _is_cute_compile(resolved):
            self.add("cute-dsl", self.qualname(), {"use": "compile", "compiles": short(node.args[0]) if node.args else None})
        elif resolved == "torch.compile":
            self.add("inductor", self.qualname(), {"use": "call", "compiles": short(node.args[0]) if node.args else None,
                                                   **_inductor_details(node)})
        # triton.jit(fn) / triton.autotune(...)(fn) / triton.heuristics(...)(fn) by call
        elif isinstance(node.func, ast.Call) and node.args and isinstance(node.args[0], ast.Name):
            inner = node.func
            which = _is_triton(self.imports.resolve(dotted(inner.func)))
            target = self.triton.get(node.args[0].id)
            if which and target is not None:
                if which == "autotune":
                    target.details["autotune"] = _autotune_details(inner, self.evaluator)
                elif which == "heuristics":
                    target.details["heuristics"] = _heuristics_names(inner)
        elif _is_triton(resolved) == "jit" and node.args and isinstance(node.args[0], ast.Name):
            if node.args[0].id not in self.triton:
                self.triton[node.args[0].id] = self.add("triton", node.args[0].id, {"use": "call"})

    # FlashInfer APIs the module imports.
    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.name == "flashinfer" or a.name.startswith("flashinfer."):
                if a.name != "flashinfer":
                    self._flashinfer(a.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and not node.level and (node.module == "flashinfer" or node.module.startswith("flashinfer.")):
            for a in node.names:
                self._flashinfer(f"{node.module}.{a.name}")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        name = dotted(node)
        if name and self.imports.modules.get(name.split(".")[0]) == "flashinfer" and name.count(".") >= 1:
            resolved = self.imports.resolve(name)
            if resolved:
                self._flashinfer(resolved)
            return  # the chain's prefixes are not APIs of their own
        self.generic_visit(node)

    def _flashinfer(self, api: str) -> None:
        if any(part.startswith("__") for part in api.split(".")):
            return  # flashinfer.__version__ and the like: metadata, not an API that compiles
        if api not in self.flashinfer_seen:
            self.flashinfer_seen.add(api)
            self.add("flashinfer", api, {})


def scan_module(file: str, tree: ast.Module) -> list[Site]:
    """The compile sites of one parsed module, with ids (`file` is its path in the tree)."""
    scanner = _Scanner(file, tree)
    scanner.visit(tree)
    return assign_ids(scanner.sites)


def assign_ids(sites: Iterable[Site]) -> list[Site]:
    out, count = [], {}
    for site in sites:
        base = f"{site.kind}:{site.file}:{site.name}"
        count[base] = count.get(base, 0) + 1
        site.id = base if count[base] == 1 else f"{base}#{count[base]}"
        out.append(site)
    return out
