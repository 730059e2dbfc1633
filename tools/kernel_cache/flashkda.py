"""FlashKDA's wheel from pins: flash_kda (its Python package) with the extension flash_kda_C,
compiled for one arch (9.0a or 12.0a) against the stack's torch and Python with the pinned CUDA
toolchain, byte for byte the same from any output root. The Bazel actions
(tools/kernel_cache/private/flashkda.bzl) run its subcommands:

  tree     unpack the FlashKDA and CUTLASS tars (the pins) and the stack's torch headers into one tree
  plan     read the pinned setup.py and write the build plan of one arch (commands, version, wheel name)
  compile  compile one object of the plan (the kernel cache's compile step: same prefix maps)
  wheel    link flash_kda_C against sonamed stubs of torch's libraries and write the wheel

Why not `pip wheel` of FlashKDA's setup.py: it runs `git submodule update` and `git rev-parse`
(no git tree in a sandbox), asks a visible GPU for the arch by default, needs the stack's CUDA
torch installed to import torch.utils.cpp_extension (gigabytes of inputs with its NVIDIA
libraries, where the build reads only torch's headers), and torch's BuildExtension compiles with
absolute build paths and whatever compilers the host has. So the plan takes
from the pinned setup.py what it declares (sources, include_dirs, the cxx and nvcc flags, its
archs, its base version) and adds what torch's CUDAExtension/BuildExtension add for torch
2.13/2.14 on Linux (-DTORCH_API_INCLUDE_EXTENSION_H, -DTORCH_EXTENSION_NAME, -std=c++20,
torch's COMMON_NVCC_FLAGS before the package's own, -fPIC, torch's include dirs, the
libraries below). Deliberate differences, none of which changes generated code:
  - setup.py's `--threads N` (a starred call) is dropped: one arch per wheel leaves nvcc nothing
    to run in parallel;
  - its `-lineinfo` is dropped: it writes the directories of the tree and of the CUDA root into
    the cubins' line tables, and no nvcc option maps device-code paths (the host's
    -ffile-prefix-map does not reach them), so the wheel would differ with every output root;
    line info serves profilers (source view), not the generated code;
  - the interpreter's own CFLAGS that setuptools adds (-g, -Wall, ...) are not added, except
    -DNDEBUG; so the objects carry no DWARF of the build host;
  - the version's local label is the pin's commit and the arch, not `git rev-parse --short HEAD`;
  - torch's libraries are linked as sonamed stubs (the extension gets the same DT_NEEDED).
"""
from __future__ import annotations

import argparse
import ast
import base64
import csv
import hashlib
import io
import json
import os
import re
import shutil
import stat
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Mapping, Sequence

from tools.common.errors import UserError
from tools.common.files import dir_replaced_atomically, temp_sibling
from tools.common.hashing import sha256_file

PLAN_SCHEMA = 1
TREE_JSON = "flashkda_tree.json"
# Where the unpacked tree's paths point inside the objects (-ffile-prefix-map).
TREE_FIXED = "/kimi-k3/flashkda"
# Timestamps in the wheel: the zip format's earliest (1980-01-01), so no build time is in it.
ZIP_DATE = (1980, 1, 1, 0, 0, 0)
# torch's COMMON_NVCC_FLAGS (torch/utils/cpp_extension.py, 2.13 and 2.14): before the package's flags.
TORCH_NVCC_FLAGS = ("-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
                    "--expt-relaxed-constexpr")
SUPPORTED_TORCH = re.compile(r"2\.1[34]\.\d+(\+\w+)?")
# nvcc flags of setup.py left out of the plan (see the module docstring).
DROPPED_NVCC_FLAGS = ("-lineinfo", "--generate-line-info")


def read_config(path: Path) -> dict[str, Any]:
    """kernel_cache/flashkda.bzl's FLASHKDA literal."""
    text = path.read_text()
    _, sep, body = text.partition("FLASHKDA = ")
    try:
        config = ast.literal_eval(body) if sep else None
    except (ValueError, SyntaxError) as e:
        raise UserError(f"{path}: FLASHKDA is not a plain literal ({e}); keep it a dict of strings and lists") from None
    if not isinstance(config, dict):
        raise UserError(f"{path}: no `FLASHKDA = {{...}}` literal")
    return config


# ---------------------------------------------------------------------------------------------
# What the pinned setup.py declares


@dataclass(frozen=True)
class SetupFacts:
    extension: str
    sources: tuple[str, ...]
    include_dirs: tuple[str, ...]
    cxx_flags: tuple[str, ...]
    nvcc_flags: tuple[str, ...]
    archs: tuple[str, ...]
    base_version: str
    packages: tuple[str, ...]


def _setup_error(where: str, problem: str) -> UserError:
    return UserError(f"{where}: {problem}; the pinned FlashKDA changed how it builds: update "
                     "tools/kernel_cache/flashkda.py (read_setup) for it, or pin the earlier commit")


def _strings(node: ast.AST, where: str, what: str, *, skip_starred: bool = False) -> tuple[str, ...]:
    if not isinstance(node, (ast.List, ast.Tuple)):
        raise _setup_error(where, f"{what} is not a list literal")
    out = []
    for item in node.elts:
        if isinstance(item, ast.Starred) and skip_starred:
            continue  # computed flags (the arch list, --threads): the plan supplies its own
        if not (isinstance(item, ast.Constant) and isinstance(item.value, str)):
            raise _setup_error(where, f"{what} holds a non-string item ({ast.unparse(item)})")
        out.append(item.value)
    return tuple(out)


def _joined_path(node: ast.AST, where: str) -> str:
    """`os.path.join(this_dir, 'cutlass', 'include')` -> 'cutlass/include' (relative to setup.py)."""
    if (isinstance(node, ast.Call) and ast.unparse(node.func) == "os.path.join" and node.args
            and all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in node.args[1:])):
        return "/".join(a.value for a in node.args[1:])  # type: ignore[attr-defined]
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    raise _setup_error(where, f"include_dirs item {ast.unparse(node)} is not os.path.join(this_dir, ...)")


def _list(node: ast.AST, where: str, what: str) -> list[ast.expr]:
    if not isinstance(node, (ast.List, ast.Tuple)):
        raise _setup_error(where, f"{what} is not a list literal")
    return list(node.elts)


def _keywords(call: ast.Call) -> dict[str, ast.AST]:
    return {k.arg: k.value for k in call.keywords if k.arg}


def read_setup(text: str, where: str = "setup.py") -> SetupFacts:
    try:
        module = ast.parse(text)
    except SyntaxError as e:
        raise _setup_error(where, f"does not parse ({e.msg}, line {e.lineno})") from None
    calls = {ast.unparse(n.func): n for n in ast.walk(module) if isinstance(n, ast.Call)}
    ext, setup = calls.get("CUDAExtension"), calls.get("setup")
    if ext is None or setup is None:
        raise _setup_error(where, "no CUDAExtension(...) and setup(...) calls")
    kw = _keywords(ext)
    for key in ("name", "sources", "include_dirs", "extra_compile_args"):
        if key not in kw:
            raise _setup_error(where, f"CUDAExtension(...) has no {key}=")
    name = kw["name"]
    if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
        raise _setup_error(where, "CUDAExtension name= is not a string")
    args = kw["extra_compile_args"]
    if not isinstance(args, ast.Dict):
        raise _setup_error(where, "extra_compile_args= is not a dict literal")
    by_key = {k.value: v for k, v in zip(args.keys, args.values) if isinstance(k, ast.Constant)}
    if "cxx" not in by_key or "nvcc" not in by_key:
        raise _setup_error(where, "extra_compile_args= lacks 'cxx' or 'nvcc'")
    archs: tuple[str, ...] = ()
    for node in ast.walk(module):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "SUPPORTED_CUDA_ARCHS"):
            archs = _strings(node.value, where, "SUPPORTED_CUDA_ARCHS")
    if not archs:
        raise _setup_error(where, "no SUPPORTED_CUDA_ARCHS = [...] list")
    skw = _keywords(setup)
    version = skw.get("version")
    base = version.left if isinstance(version, ast.BinOp) else version
    if not (isinstance(base, ast.Constant) and isinstance(base.value, str)):
        raise _setup_error(where, "setup(version=...) does not start with a string literal")
    packages = _strings(skw["packages"], where, "packages") if "packages" in skw else ()
    return SetupFacts(
        extension=name.value,
        sources=_strings(kw["sources"], where, "sources"),
        include_dirs=tuple(_joined_path(n, where) for n in _list(kw["include_dirs"], where, "include_dirs")),
        cxx_flags=_strings(by_key["cxx"], where, "extra_compile_args['cxx']", skip_starred=True),
        nvcc_flags=_strings(by_key["nvcc"], where, "extra_compile_args['nvcc']", skip_starred=True),
        archs=archs, base_version=base.value, packages=packages)


# ---------------------------------------------------------------------------------------------
# Stamping and planning


def stamp_version(base: str, commit: str, cuda_arch: str) -> str:
    """`<base>+<commit[:7]>.sm<arch>`: the pin's commit where setup.py would put `git rev-parse
    --short HEAD` of whatever checkout it runs in (PEP 440 local label)."""
    if not re.fullmatch(r"[0-9a-f]{40}", commit):
        raise UserError(f"flashkda: commit {commit!r} is not a full 40-char git id; the lock's pin is damaged")
    return f"{base}+{commit[:7]}.sm{cuda_arch}"


def wheel_filename(distribution: str, version: str, python_tag: str) -> str:
    return f"{distribution}-{version}-{python_tag}-{python_tag}-linux_x86_64.whl"


def extension_filename(extension: str, python_tag: str) -> str:
    return f"{extension}.cpython-{python_tag[2:]}-x86_64-linux-gnu.so"


def object_name(source: str) -> str:
    stem = PurePosixPath(source).stem
    return f"{stem}.cuda.o" if source.endswith(".cu") else f"{stem}.o"


def plan(setup: SetupFacts, config: Mapping[str, Any], arch: str, commit: str, torch_version: str) -> dict[str, Any]:
    """The build of one arch's wheel: each object's command (the kernel cache's plan format:
    @TREE@, @CUDA_HOME@, @PY_INCLUDE@, @INPUT@, @OUTPUT@), the link, the version and the names."""
    archs = config["archs"]
    if arch not in archs:
        raise UserError(f"flashkda: arch {arch!r} is not built here; kernel_cache/flashkda.bzl builds "
                        f"{', '.join(sorted(archs))}")
    cuda_arch = archs[arch]
    if cuda_arch not in setup.archs:
        raise UserError(f"flashkda: the pinned setup.py supports {', '.join(setup.archs)}, not {cuda_arch} "
                        f"(--arch {arch}); drop it from kernel_cache/flashkda.bzl or pin a FlashKDA that has it")
    if setup.base_version != config["base_version"]:
        raise UserError(f"flashkda: the pinned setup.py's version is {setup.base_version}, kernel_cache/flashkda.bzl "
                        f"says {config['base_version']}; set base_version to {setup.base_version} (wheel names follow it)")
    if not SUPPORTED_TORCH.fullmatch(torch_version):
        raise UserError(f"flashkda: torch {torch_version}: the plan adds torch 2.13/2.14's extension flags; "
                        "check torch/utils/cpp_extension.py of this torch and extend tools/kernel_cache/flashkda.py")
    if list(setup.sources) != list(config["sources"]):
        raise UserError(f"flashkda: the pinned setup.py compiles {', '.join(setup.sources)}, kernel_cache/flashkda.bzl "
                        f"lists {', '.join(config['sources'])}; set its sources to the setup.py's")
    submodule = config["cutlass_submodule"]["path"]
    outside = [d for d in setup.include_dirs if d != submodule and d.startswith(submodule + "/")
               and d[len(submodule) + 1:] not in config["cutlass_dirs"]]
    if outside:
        raise UserError(f"flashkda: setup.py includes {', '.join(outside)}, which kernel_cache/flashkda.bzl "
                        "cutlass_dirs does not unpack; add it there")
    torch_defines = ["-DTORCH_API_INCLUDE_EXTENSION_H", f"-DTORCH_EXTENSION_NAME={setup.extension}"]
    includes = [f"-I@TREE@/src/{d}" for d in setup.include_dirs]
    system = ["-isystem", "@TREE@/torch/include", "-isystem", "@TREE@/torch/include/torch/csrc/api/include",
              "-isystem", "@CUDA_HOME@/include", "-isystem", "@PY_INCLUDE@"]
    objects = []
    for source in setup.sources:
        src = f"@TREE@/src/{source}"
        if source.endswith(".cu"):
            args = ["@CUDA_HOME@/bin/nvcc", *includes, *system, *TORCH_NVCC_FLAGS, "--compiler-options=-fPIC",
                    *(f for f in setup.nvcc_flags if f not in DROPPED_NVCC_FLAGS), *torch_defines, f"-gencode=arch=compute_{cuda_arch},code=sm_{cuda_arch}",
                    "-std=c++20", "-DNDEBUG", "-c", "@INPUT@", "-o", "@OUTPUT@"]
            kind = "cuda"
        else:
            args = ["c++", *includes, *system, "-fPIC", "-DNDEBUG", *setup.cxx_flags, *torch_defines, "-std=c++20",
                    "-c", "@INPUT@", "-o", "@OUTPUT@"]
            kind = "cxx"
        objects.append({"kind": kind, "src": src, "out": object_name(source), "args": args})
    python_tag = config["python_tag"]
    version = stamp_version(setup.base_version, commit, cuda_arch)
    libs = [f"-l{lib}" for lib in config["torch_libraries"]]
    return {
        "schema_version": PLAN_SCHEMA, "arch": arch, "cuda_arch": cuda_arch, "commit": commit,
        "torch_version": torch_version, "distribution": config["distribution"], "version": version,
        "wheel": wheel_filename(config["distribution"], version, python_tag),
        "extension": setup.extension, "extension_file": extension_filename(setup.extension, python_tag),
        "packages": list(setup.packages), "python_tag": python_tag, "objects": objects,
        # --no-as-needed: the stubs define nothing, and the extension must still name torch's
        # libraries (DT_NEEDED), as a link against the real ones does.
        "link": {"kind": "link", "args": ["c++", "@OBJECTS@", "-shared", "-Wl,--build-id=none", "-Wl,--no-as-needed",
                                          "-L@STUBS@", "-L@CUDA_HOME@/lib64", *libs[:4], "-lcudart", *libs[4:],
                                          "-o", "@OUTPUT@"]},
    }


# ---------------------------------------------------------------------------------------------
# The tree: FlashKDA + CUTLASS (its submodule) + the stack's torch headers


def _safe_members(tar: tarfile.TarFile, what: str, keep: Sequence[str] | None = None) -> list[tarfile.TarInfo]:
    members = []
    for m in tar.getmembers():
        if m.name.startswith("/") or ".." in PurePosixPath(m.name).parts:
            raise UserError(f"{what}: member {m.name!r} leaves the tree; the pin's tar is damaged")
        if not (m.isfile() or m.isdir()):
            continue  # links and the pax header: nothing the build reads
        if keep is not None and not any(m.name == k or m.name.startswith(k + "/") for k in keep):
            continue
        members.append(m)
    return members


def _extract(tar_path: Path, dest: Path, what: str, keep: Sequence[str] | None = None) -> int:
    try:
        with tarfile.open(tar_path) as tar:
            members = _safe_members(tar, what, keep)
            for m in members:
                target = dest / m.name
                if m.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(m)
                assert src is not None
                with src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out)
                os.chmod(target, 0o755 if m.mode & stat.S_IXUSR else 0o644)
            return sum(1 for m in members if m.isfile())
    except (OSError, tarfile.TarError) as e:
        raise UserError(f"{what} {tar_path}: not a readable tar ({e}); re-fetch the pin "
                        "(python3 -m tools.fetch evict --pin NAME)") from None


def torch_version_of(z: zipfile.ZipFile, wheel: Path) -> str:
    """The version in the wheel's torch-*.dist-info/METADATA (a file name may be a CAS digest)."""
    for name in z.namelist():
        if re.fullmatch(r"torch-[^/]+\.dist-info/METADATA", name):
            m = re.search(r"^Version: (\S+)$", z.read(name).decode("utf-8", "replace"), re.M)
            if m:
                return m.group(1)
    raise UserError(f"--torch-wheel {wheel}: no torch-*.dist-info/METADATA with a Version; pass the stack's torch wheel")


def make_tree(flashkda_tar: Path, cutlass_tar: Path, torch_wheel: Path, config: Mapping[str, Any],
              out: Path) -> Path:
    """OUT/src (FlashKDA, CUTLASS's cutlass_dirs at its submodule path), OUT/torch/include (the
    stack's torch headers), OUT/flashkda_tree.json (what it was made from)."""
    submodule = config["cutlass_submodule"]["path"]
    with dir_replaced_atomically(out.absolute(), "--out", tool=None) as tmp:
        src = tmp / "src"
        files = _extract(flashkda_tar, src, f"pin '{config['pin']}'")
        if (src / submodule).is_dir() and any((src / submodule).iterdir()):
            raise UserError(f"pin '{config['pin']}': its tar has files under {submodule}/, where the submodule "
                            "goes; the pin is not FlashKDA's archive")
        files += _extract(cutlass_tar, src / submodule, f"pin '{config['cutlass_pin']}'", config["cutlass_dirs"])
        # The CUTLASS pin's archive holds only its `paths`: a directory added here but not there
        # would compile against absent headers, failing far from the cause.
        absent = [d for d in config["cutlass_dirs"] if not (src / submodule / d).is_dir()]
        if absent:
            raise UserError(f"pin '{config['cutlass_pin']}': its tar has no {absent[0]}/, which "
                            "kernel_cache/flashkda.bzl cutlass_dirs unpacks; add it to the pin's paths (`python3 -m "
                            f"tools.fetch add-git-tree ... --path {absent[0]}`) or drop it from cutlass_dirs")
        if not (src / "setup.py").is_file():
            raise UserError(f"pin '{config['pin']}': no setup.py at the top of its tree; the pin is not FlashKDA")
        headers = 0
        try:
            with zipfile.ZipFile(torch_wheel) as z:
                torch_version = torch_version_of(z, torch_wheel)
                for info in z.infolist():
                    if info.filename.startswith("torch/include/") and not info.is_dir():
                        target = tmp / info.filename
                        target.parent.mkdir(parents=True, exist_ok=True)
                        with z.open(info) as s, open(target, "wb") as d:
                            shutil.copyfileobj(s, d)
                        headers += 1
        except (OSError, zipfile.BadZipFile) as e:
            raise UserError(f"--torch-wheel {torch_wheel}: not a readable wheel ({e}); re-fetch the stack's torch pin") from None
        if not headers:
            raise UserError(f"--torch-wheel {torch_wheel}: no torch/include/ in it; pass the stack's torch wheel")
        (tmp / TREE_JSON).write_text(json.dumps({
            "flashkda_tar_sha256": sha256_file(flashkda_tar), "cutlass_tar_sha256": sha256_file(cutlass_tar),
            "torch_wheel_sha256": sha256_file(torch_wheel), "torch_version": torch_version,
            "files": files, "torch_headers": headers}, indent=1, sort_keys=True) + "\n")
    return out


# ---------------------------------------------------------------------------------------------
# The wheel


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def wheel_files(plan_: Mapping[str, Any], package_files: Mapping[str, bytes], extension_so: bytes) -> dict[str, bytes]:
    """Every file of the wheel (dist-info last, RECORD written over the others), by archive path."""
    dist, version = plan_["distribution"], plan_["version"]
    info = f"{dist}-{version}.dist-info"
    files = dict(sorted(package_files.items()))
    files[plan_["extension_file"]] = extension_so
    files[f"{info}/METADATA"] = (
        "Metadata-Version: 2.1\n"
        f"Name: {dist}\nVersion: {version}\n"
        "Summary: FlashKDA: Flash Kimi Delta Attention (built from pins by kimi-k3's kernel cache stage)\n"
        f"Requires-Dist: torch=={plan_['torch_version']}\n").encode()
    files[f"{info}/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: kimi-k3 tools.kernel_cache.flashkda\nRoot-Is-Purelib: false\n"
        f"Tag: {plan_['python_tag']}-{plan_['python_tag']}-linux_x86_64\n").encode()
    top = sorted({p.split("/")[0] for p in plan_["packages"]} | {plan_["extension"]})
    files[f"{info}/top_level.txt"] = "".join(t + "\n" for t in top).encode()
    files[f"{info}/kimi_k3_build.json"] = (json.dumps(
        {"pin_commit": plan_["commit"], "arch": plan_["arch"], "cuda_arch": plan_["cuda_arch"],
         "torch_version": plan_["torch_version"]}, indent=1, sort_keys=True) + "\n").encode()
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for path, data in files.items():
        writer.writerow([path, _record_hash(data), len(data)])
    writer.writerow([f"{info}/RECORD", "", ""])
    files[f"{info}/RECORD"] = record.getvalue().encode()
    return files


def write_wheel(files: Mapping[str, bytes], out: Path, executable: Sequence[str] = ()) -> None:
    """A zip with fixed timestamps and modes in the given order: the same files give the same bytes."""
    tmp = temp_sibling(out, suffix=".whl")
    try:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as z:
            for path, data in files.items():
                info = zipfile.ZipInfo(path, ZIP_DATE)
                info.compress_type = zipfile.ZIP_DEFLATED
                info.external_attr = ((0o755 if path in executable else 0o644) | stat.S_IFREG) << 16
                info.create_system = 3
                z.writestr(info, data)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def package_files_of(tree: Path, packages: Sequence[str]) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    for package in packages:
        root = tree / "src" / package
        if not (root / "__init__.py").is_file():
            raise UserError(f"flashkda: package {package} of setup.py has no {package}/__init__.py in the tree")
        for path in sorted(root.rglob("*.py")):
            files[path.relative_to(tree / "src").as_posix()] = path.read_bytes()
    return files


def write_stubs(tc: Any, libraries: Sequence[str], out: Path) -> Path:
    """lib<name>.so for each library: empty, with soname lib<name>.so (as torch's wheel names them)."""
    out.mkdir(parents=True, exist_ok=True)
    src = out / "empty.c"
    src.write_text("/* link-time stand-in: the stack's torch provides the real library at run time */\n")
    for lib in libraries:
        proc = tc.run(["cc", "-shared", "-fPIC", f"-Wl,-soname,lib{lib}.so", "-o", str(out / f"lib{lib}.so"), str(src)])
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout + proc.stderr)
            raise UserError(f"flashkda: the toolchain's cc failed to build the lib{lib}.so stub; see output above")
    src.unlink()
    return out


# ---------------------------------------------------------------------------------------------
# CLI (the Bazel actions)


def _load_plan(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--plan {path}: unreadable ({e}); it is written by `flashkda plan`") from None
    if data.get("schema_version") != PLAN_SCHEMA:
        raise UserError(f"--plan {path}: schema {data.get('schema_version')}, expected {PLAN_SCHEMA}; rebuild it")
    return data


def _toolchain(args: argparse.Namespace) -> Any:
    from tools.kernel_cache.toolchain import load_toolchain
    return load_toolchain(args.cuda_home, args.userland, args.tvm_ffi)


def cmd_tree(args: argparse.Namespace) -> int:
    make_tree(args.flashkda_tar, args.cutlass_tar, args.torch_wheel, read_config(args.config), args.out)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    config = read_config(args.config)
    tree = json.loads((args.tree / TREE_JSON).read_text())
    setup = read_setup((args.tree / "src" / "setup.py").read_text(), f"pin '{config['pin']}' setup.py")
    result = plan(setup, config, args.arch, args.commit, tree["torch_version"])
    if args.expect_wheel and result["wheel"] != args.expect_wheel:
        raise UserError(f"flashkda: the plan names {result['wheel']}, the target declared {args.expect_wheel}; "
                        "kernel_cache/flashkda.bzl and the pinned setup.py disagree (base_version?)")
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return 0


def _fill(tree: Path, tc: Any) -> Any:
    """The kernel cache's placeholder values, with the tree's paths pointing at TREE_FIXED (a
    subclass here, not a field of Fill: an edit to actions.py would re-key every kernel object)."""
    from tools.kernel_cache.actions import Fill
    from tools.kernel_cache.toolchain import real_roots

    class FlashKdaFill(Fill):
        def prefix_maps(self) -> list[tuple[str, str]]:
            maps = [(p, TREE_FIXED) for p in real_roots(self.tree)] + self.tc.prefix_maps()
            return sorted(dict(maps).items(), key=lambda kv: -len(kv[0]))

    return FlashKdaFill(tree=tree.absolute(), gen_dir=tree.absolute() / "gen", tc=tc)


def cmd_compile(args: argparse.Namespace) -> int:
    from tools.kernel_cache.actions import compile_one
    plan_ = _load_plan(args.plan)
    objs = [o for o in plan_["objects"] if o["out"] == args.object]
    if not objs:
        raise UserError(f"--object {args.object}: not in the plan ({', '.join(o['out'] for o in plan_['objects'])})")
    fill = _fill(args.tree, _toolchain(args))
    compile_one({"name": "flash_kda_C"}, objs[0], fill, args.out.absolute(), args.nice)
    return 0


def cmd_wheel(args: argparse.Namespace) -> int:
    from tools.kernel_cache.actions import run_tool
    config = read_config(args.config)
    plan_ = _load_plan(args.plan)
    tc = _toolchain(args)
    fill = _fill(args.tree, tc)
    objects = {o.name: o.absolute() for o in args.objects}
    missing = [o["out"] for o in plan_["objects"] if o["out"] not in objects]
    if missing:
        raise UserError(f"flashkda wheel: objects {', '.join(missing)} not given; pass each with --objects")
    # The link's scratch (stubs, the extension before it goes into the zip): this run's own.
    args.out.absolute().parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{args.out.name}.", dir=args.out.absolute().parent))
    try:
        stubs = write_stubs(tc, config["torch_libraries"], work / "stubs")
        so = work / plan_["extension_file"]
        argv: list[str] = []
        for a in plan_["link"]["args"]:
            if a == "@OBJECTS@":
                argv += [str(objects[o["out"]]) for o in plan_["objects"]]
            elif a == "@OUTPUT@":
                argv.append(str(so))
            else:
                argv.append(fill.apply(a.replace("@STUBS@", str(stubs))))
        run_tool(argv, 0, f"link {plan_['extension']}", tc)
        files = wheel_files(plan_, package_files_of(args.tree, plan_["packages"]), so.read_bytes())
        write_wheel(files, args.out.absolute(), executable=[plan_["extension_file"]])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python3 -m tools.kernel_cache.flashkda", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    tc = argparse.ArgumentParser(add_help=False)
    tc.add_argument("--cuda-home", required=True)
    tc.add_argument("--userland")
    tc.add_argument("--tvm-ffi", help="tvm-ffi headers (the toolchain's identity wants them; FlashKDA includes none)")

    p = sub.add_parser("tree", help="unpack the pins and the torch headers")
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--flashkda-tar", type=Path, required=True)
    p.add_argument("--cutlass-tar", type=Path, required=True)
    p.add_argument("--torch-wheel", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_tree)

    p = sub.add_parser("plan", help="the build plan of one arch, from the pinned setup.py")
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--tree", type=Path, required=True)
    p.add_argument("--arch", required=True)
    p.add_argument("--commit", required=True, help="the flashkda pin's commit (the version's local label)")
    p.add_argument("--expect-wheel", help="the wheel file name the Bazel target declared")
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("compile", parents=[tc], help="compile one object of the plan")
    p.add_argument("--plan", type=Path, required=True)
    p.add_argument("--tree", type=Path, required=True)
    p.add_argument("--object", required=True)
    p.add_argument("--nice", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("wheel", parents=[tc], help="link the extension and write the wheel")
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--plan", type=Path, required=True)
    p.add_argument("--tree", type=Path, required=True)
    p.add_argument("--objects", type=Path, nargs="+", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_wheel)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    from tools.common.errors import run_cli
    sys.exit(run_cli(main))
