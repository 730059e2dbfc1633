"""What one Bazel action of the kernel cache does: compile one object of the plan (its command
with this host's paths filled in), link one module, assemble the AOT layout
flashinfer/data/aot/<m>/<m>.so + kernel_cache.json; and the per-action spec files that give a
compile or link action its own entry of the plan. The non-Bazel build (build.py) runs the same
functions.

Where the commands deliberately differ from FlashInfer's ninja file (none changes generated code):
  - nvcc gets -Xcudafe --orig_src_path_name=<the source's fixed /kimi-k3/... path>: cudafe++
    hashes the source's absolute path into internal device symbol names;
  - depfile flags (-MMD/-MF, --generate-dependencies-with-compile) are dropped (plan.py): every
    object already depends on the whole tree;
  - -ffile-prefix-map maps the paths of tree, generated sources, CUDA, tvm_ffi and Python include
    to fixed /kimi-k3/... paths and the compiler userland's to its system paths (/usr/...), and
    the pid in nvcc's temp file name is zeroed in the object: the same inputs give byte-identical
    objects and modules on any host;
  - compilers are the pinned toolchain's (toolchain.py): nvcc from the CUDA root, gcc/g++ and
    binutils from the compiler userland through --sysroot, run with Toolchain.env();
  - the link gets a stub dir (a libcuda.so stub).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from tools.common.errors import UserError
from tools.common.files import dir_replaced_atomically, temp_sibling
from tools.common.hashing import sha256_bytes, sha256_file
from tools.kernel_cache.plan import find_module
from tools.kernel_cache.toolchain import Toolchain, check_glibc_needed, real_roots
from tools.kernel_cache.tree import AOT_SUBDIR

CACHE_JSON_SCHEMA = 1
CACHE_JSON_NAME = "kernel_cache.json"


@dataclasses.dataclass(frozen=True)
class Fill:
    """Values for the plan's placeholders on this host."""
    tree: Path
    gen_dir: Path
    tc: Toolchain

    def prefix_maps(self) -> list[tuple[str, str]]:
        """Host path -> fixed path, for -ffile-prefix-map: objects must not embed where the tree,
        generated sources, CUDA or the venv happened to live (Bazel sandboxes differ per run)."""
        maps = [(p, "/kimi-k3/flashinfer-tree") for p in real_roots(self.tree)]
        if self.gen_dir.is_dir():
            maps += [(p, "/kimi-k3/gen") for p in real_roots(self.gen_dir)]
        else:
            maps.append((str(self.gen_dir), "/kimi-k3/gen"))
        maps += self.tc.prefix_maps()
        return sorted(dict(maps).items(), key=lambda kv: -len(kv[0]))

    def apply(self, arg: str) -> str:
        return (arg.replace("@TREE@", str(self.tree)).replace("@GEN@", str(self.gen_dir))
                .replace("@CUDA_HOME@", str(self.tc.cuda_home))
                .replace("@PY_INCLUDE@", str(self.tc.python_include))
                .replace("@TVM_FFI@", str(self.tc.tvm_ffi_dir)))


def check_nvcc(plan: Mapping[str, Any], tc: Toolchain) -> None:
    # FlashInfer picks some nvcc flags by CUDA release (e.g. -static-global-template-stub).
    if plan["nvcc_release"] != tc.nvcc_release:
        raise UserError(f"--cuda-home {tc.cuda_home}: nvcc {tc.nvcc_release}, but the plan was "
                        f"made for nvcc {plan['nvcc_release']}; regenerate the plan or pin CUDA")


def fixed_path(path: str, fill: Fill) -> str:
    """A host path as the prefix maps rewrite it (e.g. /kimi-k3/flashinfer-tree/...)."""
    for real, fixed in fill.prefix_maps():
        if path == real or path.startswith(real + "/"):
            return fixed + path[len(real):]
    return path


def compile_argv(obj: Mapping[str, Any], fill: Fill, out: Path) -> list[str]:
    maps = [f"-ffile-prefix-map={real}={fixed}" for real, fixed in fill.prefix_maps()]
    if obj["kind"] == "cuda":
        maps = [f"-Xcompiler={m}" for m in maps]  # nvcc hands these to every gcc step
        # cudafe++ derives the "module id" in internal-linkage device symbol names
        # (_INTERNAL_<hash>_7_norm_cu_...) from the source's real absolute path; no prefix map
        # reaches it. Naming the source by its fixed path makes the id (and so the object)
        # independent of where the tree lives (measured: norm's csrc_norm.cuda.o differed
        # between two tree paths without this; identical with it).
        maps += ["-Xcudafe", "--orig_src_path_name=" + fixed_path(fill.apply(obj["src"]), fill)]
        # A source with no external definition of its own (FlashInfer's generated instantiation
        # files, the moe_gemm_kernels_*.cu lists) gets anonymous-namespace names from a random
        # number and the pid (_GLOBAL__N__..._cu_e31c0577_17583 in one build, _a0bf3d01_30717 in
        # the next: fused_moe_120.so differed between two clean output roots, every other module
        # matched). nvcc's seed replaces that random number; one per object of a module.
        maps += [f"-frandom-seed={obj['out']}"]
    argv: list[str] = []
    for i, a in enumerate(obj["args"]):
        if i == 1:
            argv += maps
        argv.append({"@INPUT@": fill.apply(obj["src"]), "@OUTPUT@": str(out)}.get(a) or
                    fill.apply(a))
    return argv


def link_argv(module: Mapping[str, Any], fill: Fill, objects: Sequence[Path], out: Path,
              stub_dir: Path) -> list[str]:
    argv: list[str] = []
    for a in module["link"]["args"]:
        if a == "@OBJECTS@":
            argv += [str(o) for o in objects]
        elif a == "@OUTPUT@":
            argv.append(str(out))
        else:
            argv.append(fill.apply(a))
    return argv + [f"-L{stub_dir}"]




def run_tool(argv: Sequence[str], nice: int, what: str, tc: Toolchain) -> float:
    t0 = time.monotonic()
    proc = tc.run(argv, nice)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        if "unsupported GNU version" in proc.stderr and tc.userland is None:
            raise UserError(f"{what}: nvcc refuses this host compiler (e.g. gcc 16); compile with "
                            "the pinned compiler userland: --userland DIR (unpacked by `python3 -m "
                            "tools.fetch.debian extract --set kernel-userland --out DIR`)")
        raise UserError(f"{what}: compiler failed (exit {proc.returncode}); see output above")
    return time.monotonic() - t0


# Per-action specs. A Bazel compile action reads only its own object's entry (not the whole
# plan file), so its key is that object's command: lean and full plans share every identical
# object, and regenerating a plan (a new module, a changed memory hint) recompiles only what
# changed. mem_mb is left out: it schedules, it does not change bytes.
SPEC_SCHEMA = 1


def object_spec(plan: Mapping[str, Any], module_name: str, object_name: str) -> dict[str, Any]:
    module = find_module(plan, module_name)
    for o in module["objects"]:
        if o["out"] == object_name:
            return {"spec": "object", "schema_version": SPEC_SCHEMA, "module": module_name,
                    "nvcc_release": plan["nvcc_release"],
                    "object": {k: v for k, v in o.items() if k != "mem_mb"}}
    raise UserError(f"--object {object_name}: not an object of {module_name}")


def link_spec(plan: Mapping[str, Any], module_name: str) -> dict[str, Any]:
    module = find_module(plan, module_name)
    return {"spec": "link", "schema_version": SPEC_SCHEMA, "module": module_name,
            "nvcc_release": plan["nvcc_release"], "link": module["link"],
            "objects": [o["out"] for o in module["objects"]]}


def read_spec(path: Path, kind: str) -> dict[str, Any]:
    try:
        spec = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--spec {path}: unreadable ({e}); it is written by "
                        "tools/kernel_cache/defs.bzl")
    if not isinstance(spec, dict) or spec.get("spec") != kind or spec.get("schema_version") != SPEC_SCHEMA:
        raise UserError(f"--spec {path}: not a {kind} spec of schema {SPEC_SCHEMA}; rebuild with "
                        "this checkout's tools/kernel_cache/defs.bzl")
    return spec


_NVCC_TEMP_NAME = re.compile(rb"tmpxft_[0-9a-f]{8}_")


def zero_nvcc_temp_names(obj_file: Path) -> None:
    """nvcc compiles host code from a temp file tmpxft_<pid>_..., and that name lands in the
    object (an STT_FILE symbol and the _GLOBAL__sub_I_ static-init symbol). Both are local
    symbol names, so the pid is zeroed in place (same length): identical inputs then give
    identical objects. No nvcc flag fixes the name."""
    data = obj_file.read_bytes()
    fixed = _NVCC_TEMP_NAME.sub(b"tmpxft_00000000_", data)
    if fixed != data:
        obj_file.write_bytes(fixed)


def compile_one(module: Mapping[str, Any], obj: Mapping[str, Any], fill: Fill, out: Path,
                nice: int) -> float:
    tmp = temp_sibling(out, suffix=out.suffix)
    try:
        secs = run_tool(compile_argv(obj, fill, tmp), nice, f"{module['name']}/{obj['out']}",
                        fill.tc)
        if obj["kind"] == "cuda":
            zero_nvcc_temp_names(tmp)
        os.replace(tmp, out)
        return secs
    finally:
        tmp.unlink(missing_ok=True)


def link_one(module: Mapping[str, Any], fill: Fill, objects: Sequence[Path], out: Path,
             stub_dir: Path) -> None:
    tmp = temp_sibling(out, suffix=out.suffix)
    try:
        run_tool(link_argv(module, fill, objects, tmp, stub_dir), 0, f"link {module['name']}",
                 fill.tc)
        check_glibc_needed(tmp, fill.tc, f"link {module['name']}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def write_cache_json(plan: Mapping[str, Any], tc: Toolchain, module_sos: Mapping[str, Path],
                     aot_dir: Path) -> dict[str, Any]:
    data = {
        "schema_version": CACHE_JSON_SCHEMA,
        "flashinfer_version": plan["flashinfer_version"],
        "patched_source_digest": plan["patched_source_digest"],
        "arch_list": plan["arch"],
        "variant": plan["variant"],
        # The kernel selection (absent for `full`, as in caches built before selections).
        **({"selection": plan["selection"]} if "selection" in plan else {}),
        "source_markers": plan["source_markers"],
        "toolchain": tc.identity(),
        "toolchain_digest": tc.digest(),
        "plan_digest": sha256_bytes(json.dumps(plan, sort_keys=True).encode()),
        "modules": {
            m["name"]: {
                "path": f"{m['name']}/{m['name']}.so",
                "sha256": sha256_file(module_sos[m["name"]]),
                "generator": m["generator"], "kwargs": m["kwargs"],
                "objects": len(m["objects"]),
                # The runners a kernel selection compiled in (tests/gpu skip the others, naming
                # the selection); absent for `full`.
                **({"kernel_selection": {"name": m["kernel_selection"]["name"],
                                         "runners": m["kernel_selection"]["runners"],
                                         # Only where a tile set stubs some (bytes unchanged else).
                                         **({"stubbed_tiles": m["kernel_selection"]["stubbed_tiles"]}
                                            if m["kernel_selection"].get("stubbed_tiles") else {})}}
                   if "kernel_selection" in m else {}),
                "flags": {"compile": sorted({" ".join(o["args"]) for o in m["objects"]}),
                          "link": " ".join(m["link"]["args"])},
            } for m in plan["modules"]},
    }
    (aot_dir / CACHE_JSON_NAME).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return data


def assemble(plan: Mapping[str, Any], tc: Toolchain, module_sos: Mapping[str, Path],
             out: Path, tool: str | None = None) -> dict[str, Any]:
    """Write OUT/flashinfer/data/aot/<m>/<m>.so and kernel_cache.json, atomically. tool=None: the
    Bazel action's tree, shipped in a layer byte for byte (no marker); the Bazel-free `build`
    names itself, so its reruns replace their own --out."""
    missing = [m["name"] for m in plan["modules"] if m["name"] not in module_sos]
    if missing:
        raise UserError(f"assemble: no .so given for modules {missing}; pass --module-so NAME=PATH")
    with dir_replaced_atomically(out.absolute(), "--out", tool=tool) as tmp:
        aot = tmp / AOT_SUBDIR
        for name, so in module_sos.items():
            (aot / name).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(so, aot / name / f"{name}.so")
        return write_cache_json(plan, tc, {n: aot / n / f"{n}.so" for n in module_sos}, aot)
