"""What the image holds ahead of first use: its FlashInfer kernel cache (from the image's
kernel_cache.json, or from the checked-in plan for an image assembled without its kernel-cache
layer), its SGLang JIT builds (their manifest, each .so at its recorded sha256), the Triton calls
its Triton layer is built from; the image paths of those caches and the GPU their arch is for."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from tools.common.errors import UserError

# image/constants.bzl SGLANG_JIT_DIR, and the manifest the SGLang JIT build writes there
# (tools/jit_cache/sglang_aot.py MANIFEST).
SGLANG_JIT_IMAGE_PATH = "/usr/share/kimi-k3/sglang-jit"
SGLANG_JIT_MANIFEST = "kimi-k3-sglang-jit.json"
# image/constants.bzl TRITON_DIR (the Triton layer's cache, tools/jit_cache/triton_aot.py MANIFEST).
TRITON_IMAGE_PATH = "/usr/share/kimi-k3/triton"
AOT_DIR = "flashinfer/data/aot"
CACHE_JSON = "kernel_cache.json"


@dataclass(frozen=True)
class KernelCache:
    """What a kernel cache holds: arch, selection ("full" when none is recorded), and per module
    the CUTLASS MoE runners its selection compiled in (None: the whole module)."""

    source: str
    arch: str
    selection: str
    modules: Mapping[str, tuple[str, ...] | None]

    def describe(self) -> str:
        return f"selection {self.selection}, arch {self.arch}, {len(self.modules)} modules, from {self.source}"


def _runners(entry: Mapping[str, Any]) -> tuple[str, ...] | None:
    selection = entry.get("kernel_selection")
    return tuple(selection["runners"]) if isinstance(selection, dict) else None


def kernel_cache_of_image(rootfs_site_packages: Path) -> KernelCache:
    """The image's cache from its kernel_cache.json; a module whose .so is absent is not in it."""
    aot = rootfs_site_packages / AOT_DIR
    path = aot / CACHE_JSON
    try:
        data = json.loads(path.read_text())
        modules = {name: (entry, aot / entry["path"]) for name, entry in data["modules"].items()}
        arch = str(data["arch_list"])
    except FileNotFoundError:
        raise UserError(f"the image has no {AOT_DIR}/{CACHE_JSON}: it carries no kernel cache; for an image "
                        "assembled without its kernel-cache layer pass --kernel-cache-plan PLAN") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"the image's {AOT_DIR}/{CACHE_JSON} is unreadable ({type(e).__name__}: {e}); "
                        "rebuild the kernel cache") from None
    return KernelCache(f"the image's {AOT_DIR}/{CACHE_JSON}", arch, str(data.get("selection", "full")),
                       {name: _runners(entry) for name, (entry, so) in modules.items() if so.is_file()})


def kernel_cache_of_plan(plan_path: Path) -> KernelCache:
    """The cache a checked-in plan builds (the image under test carries no kernel-cache layer)."""
    from tools.kernel_cache.plan import read_plan

    plan = read_plan(plan_path)
    return KernelCache(f"plan {plan_path.name} (the image under test has no kernel-cache layer)", str(plan["arch"]),
                       str(plan.get("selection", "full")), {m["name"]: _runners(m) for m in plan["modules"]})


def build_key(call: str, args: Any) -> str:
    """One SGLang JIT build as the inventory and the image's manifest both name it."""
    return f"{call} {json.dumps(args, sort_keys=True)}"


@dataclass(frozen=True)
class FirstUseCaches:
    """The SGLang JIT builds an image ships (tools/jit_cache build-sglang's manifest): build
    (build_key) -> None when its .so is there at the recorded sha256, else why not."""

    source: str
    arch: str | None
    sglang_jit: Mapping[str, str | None]
    # The Triton kernels the image's Triton layer is built from, by (file, function): the calls
    # that run them (jit_cache/triton_calls.json, whose kernels the build checks); None: not given.
    triton: Mapping[tuple[str, str], list[dict[str, Any]]] | None = None

    def describe(self) -> str:
        present = sum(v is None for v in self.sglang_jit.values())
        return f"{present} SGLang JIT builds for arch {self.arch} in {self.source}"


def first_use_caches_of_image(rootfs_jit_dir: Path) -> FirstUseCaches:
    """The image's prebuilt SGLang JIT builds, from its manifest; none when it ships no manifest."""
    from tools.common.hashing import sha256_file

    where = f"{SGLANG_JIT_IMAGE_PATH}/{SGLANG_JIT_MANIFEST}"
    try:
        data = json.loads((rootfs_jit_dir / SGLANG_JIT_MANIFEST).read_text())
        entries = [(str(m["call"]), m["args"], str(m["leaf"]), str(m["module"]), str(m["so_sha256"]))
                   for m in data["modules"]]
        arch = str(data["arch"])
    except FileNotFoundError:
        return FirstUseCaches(f"the image (no {where})", None, {})
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"the image's {where} is unreadable ({type(e).__name__}: {e}); rebuild the image") from None
    builds: dict[str, str | None] = {}
    for call, args, leaf, module, digest in entries:
        so = rootfs_jit_dir / leaf / f"{module}.so"
        if not so.is_file():
            builds[build_key(call, args)] = f"its {leaf}/{module}.so is missing"
        elif sha256_file(so) != digest:
            builds[build_key(call, args)] = f"its {leaf}/{module}.so is not the sha256 the manifest records"
        else:
            builds[build_key(call, args)] = None
    return FirstUseCaches(f"the image's {where}", arch, builds)


def triton_plan(calls_file: Path, stack: str) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """(file, function) -> [{"call", "args"}] of the stack's Triton calls (jit_cache/triton_calls.json)."""
    from tools.jit_cache.triton_aot import kernel_sites, load_calls

    return kernel_sites(load_calls(calls_file, stack, "--triton-calls"))


def capability_of(arch: str) -> tuple[int, int]:
    """(12, 0) for "12.0f": the GPU the kernel cache (and so the image) is built for."""
    match = re.fullmatch(r"(\d+)\.(\d+)[af]?", arch.split(";")[0].strip())
    if not match:
        raise UserError(f"kernel cache arch {arch!r}: not a CUDA arch like 12.0f; rebuild the kernel cache")
    return int(match.group(1)), int(match.group(2))

