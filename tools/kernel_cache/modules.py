"""kernel_cache/modules.json: which FlashInfer JIT modules the cache holds (generator, kwargs per
variant, the archs they apply to) and the source markers that refuse an unpatched tree; and the
arch lists (FLASHINFER_CUDA_ARCH_LIST entries such as 12.0f or 9.0a)."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

from tools.common.errors import UserError
from tools.common.jsondata import ANY, TEXT, Enum, ListOf, MapOf, Object, json_path, load_json_file

VARIANTS = ("lean", "full")
# nvcc emits e.g. "sm_120" for compute_120f; the ELF check compares the numeric part.
ARCH_RE = re.compile(r"^(\d+)\.(\d+)([a-z]?)$")


@dataclasses.dataclass(frozen=True)
class SourceMarker:
    """A fact the tree must contain (e.g. the SiTU enum of #4460): refuses unpatched trees."""
    path: str
    regex: str
    why: str


@dataclasses.dataclass(frozen=True)
class ModuleDecl:
    name: str
    generator: str  # "package.module:function"
    kwargs: Mapping[str, Any]
    variant_kwargs: Mapping[str, Mapping[str, Any]]
    archs: tuple[str, ...]  # arch lists this module applies to; empty = all
    markers: tuple[SourceMarker, ...]

    def kwargs_for(self, variant: str) -> dict[str, Any]:
        return {**self.kwargs, **self.variant_kwargs.get(variant, {})}

    def applies_to(self, arch: str) -> bool:
        return not self.archs or arch in self.archs


# kernel_cache/modules.json (its description and kernel_cache/README.md say what each field is for).
MODULES_FILE = Object({
    "schema_version": Enum(1),
    "modules": ListOf(Object({"name": TEXT, "generator": TEXT}, optional={
        "why": TEXT,
        "archs": ListOf(TEXT),  # empty or absent: every arch
        "kwargs": MapOf(ANY),  # the generator's keyword arguments
        "variant_kwargs": MapOf(MapOf(ANY)),  # per variant (VARIANTS), over kwargs
        "source_markers": ListOf(Object({"path": TEXT, "regex": TEXT}, optional={"why": TEXT})),
    })),
}, optional={"description": TEXT})


def load_modules(path: Path) -> list[ModuleDecl]:
    data = load_json_file(path, "--modules", MODULES_FILE)
    decls: list[ModuleDecl] = []
    for i, m in enumerate(data["modules"]):
        if not re.fullmatch(r"[\w.]+:\w+", m["generator"]):
            raise UserError(f"--modules {path}: {json_path(['modules', i, 'generator'])}: {m['generator']!r} is not "
                            "'package.module:function'")
        unknown = sorted(set(m.get("variant_kwargs", {})) - set(VARIANTS))
        if unknown:
            raise UserError(f"--modules {path}: {json_path(['modules', i, 'variant_kwargs'])}: {', '.join(unknown)} "
                            f"is not a variant ({', '.join(VARIANTS)})")
        markers = tuple(SourceMarker(path=k["path"], regex=k["regex"], why=k.get("why", ""))
                        for k in m.get("source_markers", []))
        decls.append(ModuleDecl(
            name=m["name"], generator=m["generator"], kwargs=m.get("kwargs", {}),
            variant_kwargs=m.get("variant_kwargs", {}), archs=tuple(m.get("archs", [])),
            markers=markers))
    names = [d.name for d in decls]
    if len(set(names)) != len(names):
        raise UserError(f"--modules {path}: duplicate module names {sorted(names)}")
    return decls


def check_markers(tree: Path, decls: Iterable[ModuleDecl]) -> list[dict[str, str]]:
    """Every declared source marker must match: a tree without them is unpatched."""
    seen: list[dict[str, str]] = []
    for d in decls:
        for mk in d.markers:
            f = tree / mk.path
            text = f.read_text(errors="replace") if f.is_file() else ""
            if not re.search(mk.regex, text, re.MULTILINE):
                raise UserError(
                    f"--flashinfer-tree {tree}: {mk.path} lacks /{mk.regex}/ required by module "
                    f"{d.name} ({mk.why}); build from the patched tree (patch gate output)")
            seen.append({"module": d.name, "path": mk.path, "regex": mk.regex})
    return seen


def check_arch(arch: str) -> str:
    for a in arch.split():
        if not ARCH_RE.match(a):
            raise UserError(f"--arch {arch!r}: expected FLASHINFER_CUDA_ARCH_LIST entries like "
                            "12.0f or 9.0a (space separated)")
    return arch


def arch_slug(arch: str) -> str:
    return "_".join(a.replace(".", "") for a in arch.split())


def expected_sm(arch: str) -> list[str]:
    """ELF names cuobjdump should show, e.g. 12.0f -> sm_120, 9.0a -> sm_90a."""
    out = []
    for a in arch.split():
        major, minor, suffix = ARCH_RE.match(a).groups()  # type: ignore[union-attr]
        # Family ("f") targets produce plain sm_XY cubins; arch-specific ("a") keep the suffix.
        out.append(f"sm_{major}{minor}{'a' if suffix == 'a' else ''}")
    return out
