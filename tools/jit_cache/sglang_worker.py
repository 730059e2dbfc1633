"""Builds SGLang JIT modules ahead of time *through SGLang's own `load_jit`*, inside the image's
Python (Debian's python3.11 with the image's installed site-packages trees), on a machine with no
GPU. Run by tools/jit_cache/sglang_aot.py, never by hand; it imports nothing of tools/ (it runs
under another interpreter than the tools).

Why SGLang's own code computes everything: a leaf under
`$SGLANG_JIT_CACHE_DIR/<target>/<module>/build-<build_key>/deps-<deps_key>/` is a hit only when
the key the runtime computes equals it. The keys here are computed by the same functions, with the
same module arguments (the kernel's own `_jit_*_module` function is called), in the image's
installed tree, with what the runtime has and lacks:

  - the GPU: torch.cuda answers as the target device (capability, name); nothing else is faked;
  - the compilers: the image has none (no nvcc, no c++ on PATH, CUDA_HOME unset), so SGLang
    fingerprints both as "unknown" and resolves the toolkit to /usr/local/cuda, the image's CUDA
    home (links to the CUDA wheels' headers and libraries, no bin/: tools/common/cuda_home.py),
    which the caller recreates in its scratch root and names by CUDA_HOME; the key's build file
    is the one the runtime would generate.

Only the compile itself is redirected (ninja.build): it runs the same spec with the pinned
toolchain (nvcc and g++-12 given by the caller) and flags that make the bytes independent of where
the build ran (prefix maps, cudafe's source name, a fixed random seed, nvcc's temp names zeroed);
none of them changes generated code. The leaf's dependency list (sgl_deps.json, which the runtime
re-hashes) keeps the files the image ships (SGLang's kernel headers, tvm-ffi's, FlashInfer's, the
NVIDIA wheels'); the toolchain's own headers are not in the image, so listing them would make
every leaf a miss there: they are pinned by the build instead and reported to the caller.

Keyed for another runtime (a GPU host whose torch is not the image's): the request's "runtime"
names the versions that runtime's distributions report, for the ones SGLang keys by version string
only (importlib.metadata) and no module compiles against (torch, nvidia-mathdx, deep_gemm; null:
absent there), and the caller starts this worker with that runtime's CUDA_HOME. Nothing else of the
key changes: the sources, headers and build file are the image's.

Reused compiles (request "reuse": a cache built by this worker for the same arch and modules,
keyed for another runtime): the module's compile is the same, only its key differs, so the
compile is not run again. The build file this spec compiles with the pinned toolchain is compared
with the one the reused module was compiled from (compile_sha256: its text with every build path
mapped to a fixed one); only an equal one reuses that .so and its dependency list, any other
difference fails the module by name.

Request (argv[1], JSON): {"capability": [12, 0], "device_name": str, "modules": [{"call":
"pkg.mod:function", "args": [...]}], "compile_env": {...}, "nvcc": path, "cxx": path,
"cuda_home": path, "prefix_maps": [[real, fixed], ...], "runtime": {"distributions": {name:
version or null}} (optional), "compile_id_maps": [[real, fixed], ...] (what else of the build file
names a path of this run: the scratch, the compiler wrappers), "reuse": {"cache": dir, "modules":
{module: {"leaf": ..., "compile_sha256": ...}}} (optional), "result": path}.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import os
import pathlib
import re
import shutil
import stat
import sys
import traceback
import types

# What a dependency may be anchored to and still be found in the image (SGLang's anchor tokens).
IMAGE_ANCHORS = ("kernels", "tvm_ffi", "pkg:flashinfer", "pkg:deep_gemm", "pkg:nvidia", "sitepkgs")


def fake_device(capability, name):
    """torch.cuda as the target device would answer the questions load_jit's callers ask."""
    import torch

    major, minor = capability
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda device=None: (major, minor)
    torch.cuda.get_device_name = lambda device=None: name
    # sgl_kernel picks its ops library by the properties' capability at import (layernorm imports it)
    torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(major=major, minor=minor, name=name)


def key_as_runtime(runtime):
    """SGLang's build key reads each versioned distribution through importlib.metadata; answer
    it as the target runtime would for the names the request gives (the caller has checked they
    are only ones no module compiles against)."""
    from importlib.metadata import PackageNotFoundError

    from sglang.kernels.jit.utils.compile import cache

    versions = (runtime or {}).get("distributions") or {}
    if not versions:
        return
    original = cache.dist_version

    def dist_version(name):
        if name in versions:
            if versions[name] is None:
                raise PackageNotFoundError(name)
            return versions[name]
        return original(name)

    cache.dist_version = dist_version


def keyed_distributions():
    """{distribution: version or "absent"} as the build key saw them."""
    from importlib.metadata import PackageNotFoundError

    from sglang.kernels.jit.utils.compile import cache

    seen = {}
    for name in cache._VERSIONED_PACKAGES:
        try:
            seen[name] = cache.dist_version(name)
        except (PackageNotFoundError, ValueError):
            seen[name] = "absent"
    return seen


def decode_arg(value):
    import torch

    if isinstance(value, dict) and set(value) == {"dtype"}:
        dtype = getattr(torch, value["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown torch dtype {value['dtype']!r}")
        return dtype
    return value


NVCC_WRAPPER = """#!/bin/sh
# nvcc, then nvcc's temp-file name (tmpxft_<pid>_) zeroed in the object it wrote: the name lands
# in local symbol names, and the link's build-id is taken over the objects.
"{nvcc}" "$@" || exit $?
out=""
prev=""
for a in "$@"; do
  if [ "$prev" = "-o" ]; then out="$a"; fi
  prev="$a"
done
[ -n "$out" ] && exec "{python}" "{me}" --zero-temp-names "$out"
"""


def zero_temp_names(path):
    # The same rule as tools/kernel_cache/actions.py zero_nvcc_temp_names; a copy because this
    # file runs under the image's interpreter and imports nothing of tools/.
    data = pathlib.Path(path).read_bytes()
    fixed = re.sub(rb"tmpxft_[0-9a-f]{8}_", b"tmpxft_00000000_", data)
    if fixed != data:
        pathlib.Path(path).write_bytes(fixed)


def unreachable_compilers_violated(toolchain):
    """The keys must be the image's: no compiler there. A compiler this process can reach (a
    machine's /usr/local/cuda, a c++ on PATH) would go into every key's fingerprint."""
    import shutil

    found = [p for p in (toolchain.device_compiler_path(),) if os.path.exists(p)]
    host = shutil.which(toolchain.host_compiler_path())
    if host:
        found.append(host)
    if not found:
        return ""
    return (f"a compiler is reachable where the keys are computed ({', '.join(found)}), none is in "
            "the image; build through Bazel (tools/bazel build //jit_cache:sglang_jit_12_0f: its "
            "sealed root has no CUDA and the worker's PATH no compiler)")


def check(request):
    """SGLang as the image runs it, no compiler reachable and SGLANG_CRASH_ON_JIT_COMPILE=1 (set
    by the caller): each listed module function must find its leaf and load it (tvm-ffi's
    dlopen of the .so, every symbol bound)."""
    fake_device(tuple(request["capability"]), request["device_name"])
    key_as_runtime(request.get("runtime"))
    from sglang.kernels.jit.utils.compile import cache, loader, toolchain

    result = {"modules": [], "errors": []}
    reachable = unreachable_compilers_violated(toolchain)
    if reachable:
        result["fatal"] = reachable
        pathlib.Path(request["result"]).write_text(json.dumps(result))
        return 0
    found = {}
    original_find = loader._find_prebuilt

    def record(*, spec, scope):
        leaf = original_find(spec=spec, scope=scope)
        found["module"], found["scope"], found["leaf"] = spec.module_name, str(scope), leaf
        return leaf

    loader._find_prebuilt = record
    for entry in request["modules"]:
        found.clear()
        module_path, _, function_name = entry["call"].partition(":")
        try:
            function = getattr(importlib.import_module(module_path), function_name)
            module = function(*[decode_arg(a) for a in entry.get("args", [])])
        except Exception as e:
            result["errors"].append({"call": entry["call"], "args": entry.get("args", []),
                                     "error": f"{type(e).__name__}: {e}".strip().splitlines()[0],
                                     "scope": found.get("scope")})
            continue
        result["modules"].append({"call": entry["call"], "module": found.get("module"),
                                  "leaf": str(found.get("leaf")), "loaded": type(module).__name__})
    result["target"] = cache._target_tag()
    result["fingerprint"] = cache._environment_fingerprint()
    result["distributions"] = keyed_distributions()
    pathlib.Path(request["result"]).write_text(json.dumps(result, indent=1, sort_keys=True))
    return 0


PREFIX_MAP_FLAG = re.compile(r"\s*(?:-Xcompiler=)?-ffile-prefix-map=\S*")


def compile_id(build_file, path_maps):
    """sha256 of the build file a module is compiled from, with every path of this run (the
    sandbox's, the scratch's, the toolchain's real roots) replaced by its fixed name: equal ids
    mean the same compiler, flags, sources and include paths, wherever each build ran.
    The -ffile-prefix-map flags are left out: they only say where this run's paths lie, and how
    many there are depends on how the inputs were laid out (in linux-sandbox a toolchain has a
    link path and a real root, two flags; staged by a remote worker, one), not on the compile."""
    build_file = PREFIX_MAP_FLAG.sub("", build_file)
    for real, fixed in sorted(path_maps, key=lambda m: len(m[0]), reverse=True):
        if real:
            build_file = build_file.replace(real, fixed)
    return hashlib.sha256(build_file.encode()).hexdigest()


def main(request_path):
    request = json.loads(pathlib.Path(request_path).read_text())
    if request.get("mode") == "check":
        return check(request)
    result = {"modules": [], "errors": []}
    fake_device(tuple(request["capability"]), request["device_name"])
    key_as_runtime(request.get("runtime"))

    from sglang.kernels.jit.utils.compile import cache, loader, ninja, toolchain

    reachable = unreachable_compilers_violated(toolchain)
    if reachable:
        result["fatal"] = reachable
        pathlib.Path(request["result"]).write_text(json.dumps(result))
        return 0

    scratch = pathlib.Path(request["scratch"])
    scratch.mkdir(parents=True, exist_ok=True)
    nvcc_wrapper = scratch / "nvcc"
    nvcc_wrapper.write_text(NVCC_WRAPPER.format(nvcc=request["nvcc"], python=sys.executable,
                                                me=os.path.abspath(__file__)))
    nvcc_wrapper.chmod(nvcc_wrapper.stat().st_mode | stat.S_IXUSR)
    maps = [tuple(m) for m in request["prefix_maps"]]
    id_maps = maps + [tuple(m) for m in request.get("compile_id_maps", [])]
    reuse = request.get("reuse")

    current = {}
    original_build = ninja.build
    original_scan = ninja.scan_dependencies
    original_compute = cache.compute_build_key
    original_commit = cache.commit_build

    def record_key(spec, *, build_file):
        key = original_compute(spec, build_file=build_file)
        current.update(spec=spec, build_key=key, key_build_file=build_file)
        return key

    def toolchain_build_file(spec, build_dir):
        """The same spec's build file for the pinned toolchain (SGLang's generator, its toolchain
        answers replaced for the duration)."""
        saved = {n: getattr(toolchain, n) for n in ("compilers", "cuda_home", "base_cuda_flags",
                                                     "base_cxx_flags")}
        fixed_build_dir = f"/kimi-k3/sglang-jit/{spec.module_name}"
        file_maps = maps + [(str(build_dir), fixed_build_dir)]
        prefix = [f"-ffile-prefix-map={real}={fixed}" for real, fixed in file_maps]
        seed = f"-frandom-seed={spec.module_name}"
        cuda_units = [u for u in spec.translation_units() if u.is_cuda]
        cudafe = []
        if len(cuda_units) == 1:
            unit = cuda_units[0]
            src = unit.filename if unit.source is None else f"{fixed_build_dir}/{unit.filename}"
            for real, fixed in file_maps:
                if src == real or src.startswith(real + "/"):
                    src = fixed + src[len(real):]
                    break
            cudafe = ["-Xcudafe", f"--orig_src_path_name={src}"]
        try:
            toolchain.compilers = lambda: (request["cxx"], str(nvcc_wrapper))
            toolchain.cuda_home = lambda: request["cuda_home"]
            toolchain.base_cuda_flags = lambda: (saved["base_cuda_flags"]() + cudafe +
                                                 [f"-Xcompiler={f}" for f in prefix + [seed]])
            toolchain.base_cxx_flags = lambda: saved["base_cxx_flags"]() + prefix + [seed]
            return ninja.generate(spec)
        finally:
            for n, f in saved.items():
                setattr(toolchain, n, f)

    def build_with_toolchain(*, spec, build_dir, build_file):
        if build_file != current.get("key_build_file"):
            raise RuntimeError(f"{spec.module_name}: the build file to compile is not the one the "
                               "key was taken over")
        text = toolchain_build_file(spec, build_dir)
        current["toolchain_build_file"] = text
        current["compile_sha256"] = compile_id(
            text, id_maps + [(str(build_dir), f"/kimi-k3/sglang-jit/{spec.module_name}")])
        if reuse is not None:
            return reuse_compiled(spec, build_dir)
        saved_env = dict(os.environ)
        os.environ.clear()
        os.environ.update(request["compile_env"])
        try:
            library = original_build(spec=spec, build_dir=build_dir, build_file=text)
        finally:
            os.environ.clear()
            os.environ.update(saved_env)
        return library

    def reuse_compiled(spec, build_dir):
        """The reused cache's .so for this spec, once its compile is proven the same."""
        shipped = reuse["modules"].get(spec.module_name)
        if shipped is None:
            raise RuntimeError(f"{spec.module_name}: not in the reused cache {reuse['cache']} "
                               "(built from another module list); rebuild that cache first")
        if shipped["compile_sha256"] != current["compile_sha256"]:
            raise RuntimeError(f"{spec.module_name}: its build file differs from the one the "
                               f"reused cache compiled (compile_sha256 {current['compile_sha256'][:16]} "
                               f"vs {shipped['compile_sha256'][:16]}): this runtime changes what is "
                               "compiled, not only the key; build it without reuse")
        leaf = pathlib.Path(reuse["cache"]) / shipped["leaf"]
        build_dir.mkdir(parents=True, exist_ok=True)
        library = build_dir / f"{spec.module_name}.so"
        shutil.copyfile(leaf / f"{spec.module_name}.so", library)
        current["reused_deps"] = json.loads((leaf / "sgl_deps.json").read_text())
        return library

    def scan_image_dependencies(build_dir):
        kept, dropped = [], []
        if "reused_deps" in current:
            # No compile ran here, so no depfile: the reused leaf's list, resolved in this
            # tree (SGLang re-hashes each file and names the leaf by the digests).
            scanned = [cache._resolve_path(root=root, relpath=rel) for root, rel, *_ in current["reused_deps"]]
            if None in scanned:
                raise RuntimeError("the reused cache's dependency list names an anchor this tree "
                                   "does not have; rebuild it from the same trees")
        else:
            scanned = original_scan(build_dir)
        for path in scanned:
            named = path if path.is_absolute() else build_dir / path
            resolved = named.resolve()
            if resolved.is_relative_to(build_dir):
                continue
            root, rel = cache._normalize_path(resolved)
            # A toolchain file is recorded by the name the compiler used, not where its links
            # lead: the CUDA root's targets/x86_64-linux/include is a link in Bazel's repository
            # (resolved here locally, to include/) and a real directory when a remote worker
            # stages the inputs.
            (kept if root in IMAGE_ANCHORS else dropped).append((path, root, rel, os.path.normpath(named)))
        current["kept"] = [(root, rel) for _, root, rel, _ in kept]
        current["dropped"] = [real for *_, real in dropped]
        return [path for path, *_ in kept]

    def commit_and_record(spec, **kwargs):
        published = original_commit(spec, **kwargs)
        current["published"] = published
        return published

    cache.compute_build_key = record_key
    cache.commit_build = commit_and_record
    ninja.build = build_with_toolchain
    ninja.scan_dependencies = scan_image_dependencies
    loader._load = lambda library: library  # no dlopen here: the caller's test loads them

    for entry in request["modules"]:
        current.clear()
        module_path, _, function_name = entry["call"].partition(":")
        try:
            function = getattr(importlib.import_module(module_path), function_name)
            args = [decode_arg(a) for a in entry.get("args", [])]
            function(*args)
        except Exception as e:  # one entry's failure is reported with its call, not a traceback
            result["errors"].append({"call": entry["call"], "args": entry.get("args", []),
                                     "error": f"{type(e).__name__}: {e}".strip(),
                                     "traceback": traceback.format_exc(limit=6)})
            continue
        if current.get("published") is None and "spec" in current:
            result["errors"].append({"call": entry["call"], "args": entry.get("args", []),
                                     "error": "SGLang did not publish the build (no usable "
                                              "dependency list)"})
            continue
        if "spec" not in current or "kept" not in current:
            result["errors"].append({"call": entry["call"], "args": entry.get("args", []),
                                     "error": "the call did not reach load_jit's build (a "
                                              "module the runtime would not compile, or one "
                                              "built twice in the list)"})
            continue
        spec = current["spec"]
        result["modules"].append({
            "call": entry["call"],
            "args": entry.get("args", []),
            "module": spec.module_name,
            "module_args": list(spec.module_args),
            "build_key": current["build_key"],
            "so": str(current["published"]),
            "dependencies": [list(k) for k in current["kept"]],
            "toolchain_dependencies": current["dropped"],
            "key_build_file": current["key_build_file"],
            "toolchain_build_file": current["toolchain_build_file"],
            "compile_sha256": current["compile_sha256"],
            "reused": "reused_deps" in current,
        })
    result["target"] = cache._target_tag()
    result["fingerprint"] = cache._environment_fingerprint()
    result["distributions"] = keyed_distributions()
    pathlib.Path(request["result"]).write_text(json.dumps(result, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--zero-temp-names":
        zero_temp_names(sys.argv[2])
        sys.exit(0)
    sys.exit(main(sys.argv[1]))
