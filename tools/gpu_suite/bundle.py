"""One folder holding everything a GPU host without a registry needs to build the kernel
selection for its GPU and run tests/gpu:

    tools/bazel run [--config=pypi] //tools/gpu_suite:bundle -- --out DIR [--python X.Y]

DIR holds:
  run.sh          the GPU host's one command (`sh DIR/run.sh`: tools/gpu_suite/host.py)
  manifest.json   the stack, the GPU host's Python, the nvcc release the plans are made for, and
                  every other file's sha256 and size (the GPU host checks them first)
  wheels/         the stack's FlashInfer wheel as the patch gate gives it (the +kimik3 repack
                  where the stack's series patches; the pinned wheel where it is empty) and
                  tools/gpu_suite/gpu_host.json's wheels, each the stack's pin (or its build for
                  the host's Python) verified against the lock
  tvm_ffi/        tvm-ffi's headers from the stack's own apache-tvm-ffi pin, the one the image
                  ships, which every object is compiled against (as `kernel_cache unpack-tvm-ffi`)
  sglang_jit/     SGLang's JIT modules for 9.0a keyed for the GPU host (gpu_host.json
                  sglang_jit_runtime; //jit_cache:sglang_jit_9_0a_gpu_host), with the stack's SGLang
                  wheel as the patch gate gives it in wheels/ (`run.sh --sglang-jit`: the proof)
  triton/         Triton's cache for the GPU host (cache/: //jit_cache:triton_9_0_gpu_host, keyed
                  for gpu_host.json triton_runtime) and the stack's Triton for the host's Python
                  (site/: its pinned wheel's files without Triton's ptxas and CUPTI: `run.sh
                  --triton` installs it at the runtime's site_packages with a ptxas that only
                  answers --version, then runs the proof)
  repo/           this checkout's tools, tests/gpu and kernel_cache data that the GPU host runs,
                  copied from the target's runfiles (nothing is fetched on the GPU host)

DIR is written in a temp sibling and swapped in whole: a failed run leaves DIR as it was.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from tools.common.cache import cache_root
from tools.common.errors import UserError, run_cli
from tools.common.files import check_replaceable_dir, dir_replaced_atomically, workspace_path
from tools.common.hashing import sha256_file
from tools.common.jsondata import ANY, TEXT, Enum, ListOf, MapOf, Object, load_json_file
from tools.common.progress import human_bytes
from tools.fetch.cache import Cache
from tools.fetch.cli import DEFAULT_TIMEOUT_S, Context, fetch_pin
from tools.fetch.sources import mirror_dirs
from tools.gpu_suite.host import MANIFEST, SCHEMA_VERSION, SGLANG_JIT_MANIFEST
from tools.jit_cache.sglang_aot import SGLANG_JIT_RUNTIME
from tools.jit_cache.triton_aot import TRITON_RUNTIME
from tools.kernel_cache.plans import CUDA_TOOLCHAIN
from tools.kernel_cache.toolchain import unpack_tvm_ffi
from tools.pins import lock as pins_lock
from tools.pins.lock import FilePin
from tools.pins.pypi import normalize, parse_wheel_filename, python_rank

ROOT = Path(__file__).absolute().parents[2]
HOST_SPEC = Path(__file__).absolute().parent / "gpu_host.json"
# The bundle folder is this tool's output (marked): a rerun may replace it, nothing else.
BUNDLE_TOOL = "tools.gpu_suite.bundle"
# What the GPU host runs, relative to the repository root (directories: their .py files).
REPO_DIRS = ("tools/common", "tools/gpu_suite", "tools/jit_cache", "tools/kernel_cache", "tests/gpu")
# Of the host Triton's wheel, what the Triton proof leaves out: its compilers' binaries (ptxas
# gets a stand-in that only answers --version: a miss cannot compile) and the profiler's CUPTI.
TRITON_LEFT_OUT = ("triton/backends/nvidia/bin/", "triton/backends/nvidia/lib/cupti")
TRITON_MANIFEST = "kimi-k3-triton.json"  # tools/jit_cache/triton_aot.py MANIFEST
REPO_FILES = ("tools/__init__.py", "tools/gpu_suite/gpu_host.json", "kernel_cache/modules.json",
              "kernel_cache/selections.json")

RUN_SH = """#!/bin/sh
# The GPU host's command for this bundle (written by `tools/bazel run //tools/gpu_suite:bundle`):
# checks it, builds the kernel selection for this GPU with the host's nvcc and runs tests/gpu.
# Options: sh run.sh --help. PYTHON names the interpreter that holds the host's CUDA torch.
set -eu
bundle=$(cd "$(dirname "$0")" && pwd)
cd "$bundle/repo"
# The bundle's tools first (not the working directory: PYTHONSAFEPATH may be set).
export PYTHONPATH="$bundle/repo${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m tools.gpu_suite.host --bundle "$bundle" "$@"
"""


@dataclasses.dataclass(frozen=True)
class HostSpec:
    """tools/gpu_suite/gpu_host.json (its description says what each field is for)."""

    python: str
    wheels: tuple[str, ...]
    host_builds: dict[str, tuple[str, ...]]
    from_host: tuple[str, ...]


# tools/gpu_suite/gpu_host.json; the runtime objects are the first-use builds' --runtime
# (tools/jit_cache/sglang_aot.py, triton_aot.py).
HOST_SPEC_FILE = Object({
    "schema_version": Enum(1),
    "python": TEXT,
    "wheels": ListOf(TEXT),
    "from_host": ListOf(TEXT),
}, optional={
    "description": TEXT,
    "host_builds": MapOf(ListOf(TEXT)),  # a stack pin -> pins of the same version built for `python`
    "sglang_jit_runtime": SGLANG_JIT_RUNTIME,
    "triton_runtime": TRITON_RUNTIME,
    "server_bundle": ANY,  # tools/gpu_suite/server_bundle.py checks it (SERVER_BUNDLE_SCHEMA)
})


def load_host_spec(path: Path) -> HostSpec:
    data = load_json_file(path, "GPU host spec", HOST_SPEC_FILE)
    python = data["python"]
    if not python.replace(".", "").isdigit() or python.count(".") != 1:
        raise UserError(f"GPU host spec {path}: $.python: {python!r} is not the GPU host's CPython as X.Y")
    return HostSpec(python=python, wheels=tuple(data["wheels"]),
                    host_builds={k: tuple(v) for k, v in data.get("host_builds", {}).items()},
                    from_host=tuple(data["from_host"]))


def runs_on(filename: str, python: str) -> bool:
    """Whether a wheel's Python tags let CPython `python` (X.Y) install it (py3-none, abi3 up to
    that minor, or that exact cpXY)."""
    wheel = parse_wheel_filename(filename)
    return wheel is not None and python_rank(wheel, python) is not None


def host_wheel_pins(lock: pins_lock.Lock, stack_name: str, spec: HostSpec, python: str,
                    spec_path: Path = HOST_SPEC) -> list[FilePin]:
    """For each of spec.wheels, the stack's pin of that distribution, or, where its wheel does
    not run on `python`, the pin spec.host_builds names for it (same version, runs there)."""
    stack = lock.stack(stack_name)
    by_project: dict[str, list[FilePin]] = {}
    for name in stack.pin_names():
        pin = lock.pins[name]
        if isinstance(pin, FilePin) and pin.package is not None:
            by_project.setdefault(normalize(pin.package.name), []).append(pin)
    chosen: list[FilePin] = []
    for project in spec.wheels:
        found = by_project.get(normalize(project), [])
        if len(found) != 1:
            raise UserError(f"{spec_path}: wheels: {project}: stack {stack_name} has "
                            f"{len(found) or 'no'} pins of it ({', '.join(p.name for p in found) or 'none'}); "
                            "list a distribution the stack pins exactly once")
        pin = found[0]
        if runs_on(pin.filename, python):
            chosen.append(pin)
            continue
        builds = [lock.pin(n) for n in spec.host_builds.get(pin.name, ())]
        fit = [b for b in builds if isinstance(b, FilePin) and b.package == pin.package
               and runs_on(b.filename, python)]
        if not fit:
            version = pin.package.version if pin.package else ""
            tag = "cp" + python.replace(".", "")
            raise UserError(
                f"stack {stack_name}: pin {pin.name} ({pin.filename}) does not run on the GPU "
                f"host's CPython {python} and {spec_path.name} names no build of it that does; pin "
                f"one (python3 -m tools.pins.pypi add-pypi {project}=={version} --python {python} "
                f"--platform manylinux_2_28_x86_64 --pin-name {pin.name}-{tag}) and list it under "
                f"host_builds.{pin.name} in {spec_path}")
        chosen.append(fit[0])
    return chosen


def wheel_file(path: Path, what: str) -> Path:
    """`path`, or the one wheel inside it (the patch gate's wheel is a directory holding one)."""
    if path.is_dir():
        wheels = sorted(path.glob("*.whl"))
        if len(wheels) != 1:
            raise UserError(f"{what} {path}: expected one wheel in it, found {len(wheels)}")
        return wheels[0]
    if not path.is_file() or path.suffix != ".whl":
        raise UserError(f"{what} {path}: not a wheel file or a directory holding one")
    return path


def copy_repo(root: Path, out: Path) -> int:
    """The GPU host's part of this checkout (REPO_DIRS' .py files and REPO_FILES) into out."""
    files = [root / f for f in REPO_FILES]
    for d in REPO_DIRS:
        found = sorted(p for p in (root / d).rglob("*.py") if "__pycache__" not in p.parts)
        if not found:
            raise UserError(f"{root / d}: no .py files in the bundle's inputs; run the bundle through "
                            "`tools/bazel run //tools/gpu_suite:bundle`, whose runfiles hold them")
        files += found
    for src in files:
        if not src.is_file():
            raise UserError(f"{src}: missing from the bundle's inputs; run the bundle through "
                            "`tools/bazel run //tools/gpu_suite:bundle`, whose runfiles hold it")
        dst = out / src.relative_to(root)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
    return len(files)


def file_table(root: Path) -> dict[str, dict[str, Any]]:
    """{relative path: {sha256, size}} of every file under root but the manifest, sorted."""
    table: dict[str, dict[str, Any]] = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and rel != MANIFEST:
            table[rel] = {"sha256": sha256_file(p), "size": p.stat().st_size}
    return table


def _fetcher(lock: pins_lock.Lock) -> Callable[[FilePin], Path]:
    """A pin's verified file through tools/fetch (artifact cache, $KIMI_K3_MIRROR, its URLs)."""
    ctx = Context(lock=lock, cache=Cache(cache_root()), mirrors=mirror_dirs([]),
                  timeout=DEFAULT_TIMEOUT_S)
    return lambda pin: fetch_pin(ctx, pin)


def write_triton(out: Path, cache: Path, lock: pins_lock.Lock, fetch: Callable[[FilePin], Path]) -> dict[str, str]:
    """out/cache (the Triton cache keyed for the GPU host) and out/site (the Triton it was keyed
    for: the lock's pin whose file its runtime names, without TRITON_LEFT_OUT); returns sources."""
    import zipfile

    try:
        runtime = json.loads((cache / TRITON_MANIFEST).read_text())["runtime"]
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"--triton {cache}: no readable {TRITON_MANIFEST} ({e}); pass the output of "
                        "//jit_cache:triton_9_0_gpu_host") from None
    if not runtime:
        raise UserError(f"--triton {cache}: keyed for the image, not a GPU host; pass "
                        "//jit_cache:triton_9_0_gpu_host's output")
    pins = [p for p in lock.pins.values() if isinstance(p, FilePin) and p.filename == runtime["triton_wheel"]]
    if len(pins) != 1:
        raise UserError(f"{lock.path}: no pin of {runtime['triton_wheel']}, the Triton the cache is keyed "
                        "for; add it (python3 -m tools.pins.pypi add-pypi --python X.Y triton==V)")
    shutil.copytree(cache, out / "cache")
    for p in (out / "cache").rglob("*"):
        p.chmod(0o755 if p.is_dir() or p.suffix == ".so" else 0o644)
    with zipfile.ZipFile(fetch(pins[0])) as wheel:
        for info in wheel.infolist():
            if info.is_dir() or info.filename.startswith(TRITON_LEFT_OUT):
                continue
            dest = out / "site" / info.filename
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(wheel.read(info))
            dest.chmod(0o755 if (info.external_attr >> 16) & 0o111 else 0o644)
    return {"triton/cache": "//jit_cache:triton_9_0_gpu_host",
            "triton/site": f"{pins[0].name} without {', '.join(TRITON_LEFT_OUT)}"}


def write_bundle(out: Path, *, lock: pins_lock.Lock, stack_name: str, flashinfer_wheel: Path,
                 spec: HostSpec, python: str, root: Path = ROOT,
                 fetch: Callable[[FilePin], Path] | None = None,
                 sglang_wheel: Path | None = None, sglang_jit: Path | None = None,
                 triton_cache: Path | None = None) -> dict[str, Any]:
    """Write the bundle into out (replaced whole); returns its manifest. `fetch(pin) -> Path`
    gives a pin's verified file (default: tools/fetch, through the artifact cache)."""
    stack = lock.stack(stack_name)
    fetch = fetch or _fetcher(lock)
    fi_wheel = wheel_file(flashinfer_wheel, "--flashinfer-wheel")
    if not runs_on(fi_wheel.name, python):
        raise UserError(f"--flashinfer-wheel {fi_wheel.name}: does not run on CPython {python}")
    pins = host_wheel_pins(lock, stack_name, spec, python)
    tvm_role = stack.roles.get("tvm_ffi")
    if not tvm_role:
        raise UserError(f"{lock.path}: stack {stack_name} has no tvm_ffi pin; the kernel cache "
                        "is compiled against the stack's apache-tvm-ffi headers")
    tvm_pin = lock.pin(tvm_role)
    # SGLang's kernels are pure Python (the wheel's CPython 3.11 tag is for its Rust extension,
    # which the kernels do not import), so its wheel goes in whatever the host's Python.
    sg_wheel = wheel_file(sglang_wheel, "--sglang-wheel") if sglang_wheel else None
    if sglang_jit is not None and not (sglang_jit / SGLANG_JIT_MANIFEST).is_file():
        raise UserError(f"--sglang-jit {sglang_jit}: no {SGLANG_JIT_MANIFEST}; pass the output of "
                        "//jit_cache:sglang_jit_9_0a_gpu_host")
    if (sg_wheel is None) != (sglang_jit is None):
        raise UserError("--sglang-wheel / --sglang-jit: give both (the proof needs the SGLang tree "
                        "the cache was keyed on) or neither")
    with dir_replaced_atomically(out, "--out", tool=BUNDLE_TOOL) as tmp:
        wheels = tmp / "wheels"
        wheels.mkdir()
        shutil.copyfile(fi_wheel, wheels / fi_wheel.name)
        sources = {f"wheels/{fi_wheel.name}": f"{stack.roles.get('flashinfer')} through the patch "
                                              f"gate (stack {stack_name})"}
        for pin in pins:
            shutil.copyfile(fetch(pin), wheels / pin.filename)
            sources[f"wheels/{pin.filename}"] = pin.name
        if sg_wheel is not None and sglang_jit is not None:
            shutil.copyfile(sg_wheel, wheels / sg_wheel.name)
            sources[f"wheels/{sg_wheel.name}"] = f"{stack.roles.get('sglang')} through the patch gate (stack {stack_name})"
            shutil.copytree(sglang_jit, tmp / "sglang_jit")
            for p in (tmp / "sglang_jit").rglob("*"):
                p.chmod(0o755 if p.is_dir() or p.suffix == ".so" else 0o644)
            sources["sglang_jit"] = "//jit_cache:sglang_jit_9_0a_gpu_host"
        if triton_cache is not None:
            sources |= write_triton(tmp / "triton", triton_cache, lock, fetch)
        unpack_tvm_ffi(fetch(tvm_pin), tmp / "tvm_ffi")
        sources["tvm_ffi"] = f"headers of {tvm_pin.name}"
        repo_files = copy_repo(root, tmp / "repo")
        run_sh = tmp / "run.sh"
        run_sh.write_text(RUN_SH)
        run_sh.chmod(0o755)
        manifest = {
            "schema_version": SCHEMA_VERSION,
            "stack": stack_name,
            "python": python,
            "nvcc_release": lock.toolchain(CUDA_TOOLCHAIN).release,
            "flashinfer_wheel": f"wheels/{fi_wheel.name}",
            "sglang_wheel": f"wheels/{sg_wheel.name}" if sg_wheel else None,
            "sglang_jit_cache": "sglang_jit" if sglang_jit is not None else None,
            "triton": {"cache": "triton/cache", "site": "triton/site"} if triton_cache is not None else None,
            "wheels": sorted(f"wheels/{p.filename}" for p in pins),
            "from_host": list(spec.from_host),
            "sources": sources,
            "files": file_table(tmp),
        }
        # Key order as written: the file table last.
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    total = sum(f["size"] for f in manifest["files"].values())
    for rel in [manifest["flashinfer_wheel"], *([manifest["sglang_wheel"]] if sg_wheel else []),
                *manifest["wheels"]]:
        print(f"  {human_bytes(manifest['files'][rel]['size']):>9}  {rel}", file=sys.stderr)
    print(f"  + tvm_ffi/ headers, repo/ ({repo_files} files), run.sh, {MANIFEST}", file=sys.stderr)
    return manifest | {"total_size": total}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the folder to write (replaced whole)")
    ap.add_argument("--python", help="the GPU host's CPython X.Y (default: gpu_host.json's)")
    ap.add_argument("--stack", default=os.environ.get("KIMI_GPU_BUNDLE_STACK"),
                    help="the stack (under Bazel: --//third_party:stack's)")
    ap.add_argument("--flashinfer-wheel", type=Path,
                    default=os.environ.get("KIMI_GPU_BUNDLE_FLASHINFER"),
                    help="the stack's FlashInfer wheel as the patch gate gives it (under Bazel: set)")
    ap.add_argument("--sglang-wheel", type=Path, default=os.environ.get("KIMI_GPU_BUNDLE_SGLANG"),
                    help="the stack's SGLang wheel as the patch gate gives it (under Bazel: set)")
    ap.add_argument("--sglang-jit", type=Path, default=os.environ.get("KIMI_GPU_BUNDLE_SGLANG_JIT"),
                    help="//jit_cache:sglang_jit_9_0a_gpu_host's output (under Bazel: set)")
    ap.add_argument("--triton", type=Path, default=os.environ.get("KIMI_GPU_BUNDLE_TRITON"),
                    help="//jit_cache:triton_9_0_gpu_host's output (under Bazel: set)")
    ap.add_argument("--lock", type=Path, default=pins_lock.DEFAULT_LOCK)
    args = ap.parse_args(argv)
    if not args.stack or not args.flashinfer_wheel:
        raise UserError("--stack / --flashinfer-wheel: not given; run `tools/bazel run "
                        "[--config=pypi] //tools/gpu_suite:bundle -- --out DIR`, which sets both")
    spec = load_host_spec(HOST_SPEC)
    out = workspace_path(args.out).absolute()
    check_replaceable_dir(out, "--out", BUNDLE_TOOL)  # before any fetch: a wrong --out costs nothing
    manifest = write_bundle(out, lock=pins_lock.load(args.lock), stack_name=args.stack,
                            flashinfer_wheel=Path(args.flashinfer_wheel), spec=spec,
                            python=args.python or spec.python,
                            sglang_wheel=Path(args.sglang_wheel) if args.sglang_wheel else None,
                            sglang_jit=Path(args.sglang_jit) if args.sglang_jit else None,
                            triton_cache=Path(args.triton) if args.triton else None)
    print(f"wrote {out}: stack {manifest['stack']}, CPython {manifest['python']}, "
          f"{len(manifest['files'])} files, {human_bytes(manifest['total_size'])}")
    print(f"next: copy {out} to the GPU host and run `sh {out.name}/run.sh` there")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
