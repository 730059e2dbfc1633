"""The SGLang source tree an inventory is computed from: a directory (the patch gate's tree the
image ships), or a pinned wheel that the gate patches here with the stack's series, drift-checked
against its committed manifest. Python files are parsed once, on demand; nothing is imported."""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

from tools.common.errors import UserError
from tools.jit_cache.reach import module_name

PACKAGE = "sglang"
ROLE = "sglang"  # the stack role whose pin the tree is
# Files holding none of these bytes hold no site (tools/jit_cache/sites.py detects only these).
SITE_MARKERS = (b"triton", b"load_jit", b"cute", b"compile", b"flashinfer")


@dataclass
class SourceTree:
    root: Path
    files: dict[str, Path]  # path in the tree (posix) -> file, every .py under the package
    version: str | None
    _parsed: dict[str, ast.Module | None] = field(default_factory=dict)
    unparsed: dict[str, str] = field(default_factory=dict)  # path -> why

    @property
    def modules(self) -> dict[str, str]:
        out = {}
        for rel in self.files:
            name = module_name(rel)
            if name:
                out[name] = rel
        return out

    def source(self, rel: str) -> bytes:
        return self.files[rel].read_bytes()

    def parse(self, rel: str) -> ast.Module:
        """The module's AST; an unparsable file is an empty module, recorded in `unparsed`."""
        if rel not in self._parsed:
            try:
                self._parsed[rel] = ast.parse(self.source(rel), filename=rel)
            except (SyntaxError, ValueError) as e:
                self._parsed[rel] = None
                self.unparsed[rel] = f"{type(e).__name__}: {getattr(e, 'msg', e)}"
        tree = self._parsed[rel]
        return tree if tree is not None else ast.Module(body=[], type_ignores=[])

    def may_hold_sites(self, rel: str) -> bool:
        data = self.source(rel)
        return any(m in data for m in SITE_MARKERS)


def _version(root: Path) -> str | None:
    for metadata in sorted(root.glob(f"{PACKAGE}-*.dist-info/METADATA")):
        match = re.search(r"^Version: (\S+)$", metadata.read_text(encoding="utf-8", errors="replace"), re.M)
        if match:
            return match.group(1)
    return None


def tree_from_dir(root: Path, what: str) -> SourceTree:
    if not (root / PACKAGE / "__init__.py").is_file():
        raise UserError(f"{what} {root}: no {PACKAGE}/__init__.py there; pass the patch gate's SGLang tree "
                        f"(`tools/bazel build //sglang_patches:sglang_tree`) or --wheel WHEEL")
    files = {p.relative_to(root).as_posix(): p for p in sorted((root / PACKAGE).rglob("*.py")) if p.is_file()}
    return SourceTree(root=root, files=files, version=_version(root))


def gated_tree(wheel: Path, stack: str, patch_dir: Path, lock: Path, work: Path) -> SourceTree:
    """`wheel` with stack's SGLang series applied into `work` by the patch gate's own `apply`
    (as //kernel_cache:update_plans does), refused when the result drifts from
    `<patch_dir>/<stack>.manifest.json` (so it is the tree the image ships)."""
    from tools.patch_gate import cli as gate_cli
    from tools.patch_gate.series import load_lock

    if not wheel.is_file():
        raise UserError(f"--wheel {wheel}: no such file; pass the stack's pinned sglang wheel "
                        f"(`python3 -m tools.fetch fetch --pin <the stack's sglang pin>` prints its path)")
    lock_data = load_lock(lock)
    if stack not in lock_data.stacks:
        raise UserError(f"--stack {stack}: not a stack of {lock} ({', '.join(sorted(lock_data.stacks))}); name one")
    out = work / f"sglang-{stack}"
    argv = ["apply", "--series", str(patch_dir / f"{stack}.series"), "--target", str(wheel),
            "--target-pin", lock_data.stack(stack).roles[ROLE], "--layout", str(patch_dir / "wheel_layout.json"),
            "--lock", str(lock), "--expected-manifest", str(patch_dir / f"{stack}.manifest.json"),
            "--out-dir", str(out)]
    if gate_cli.main(argv) != 0:
        raise UserError(f"--wheel {wheel}: the patch gate refused it (above); fix the series or run "
                        f"`tools/bazel run //sglang_patches:update_manifest` for the stack")
    return tree_from_dir(out, f"the patch gate's tree of --wheel {wheel} at")
