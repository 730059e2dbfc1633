"""`python3 -m tools.kernel_cache <subcommand>` (all print progress to stderr):

  plan            generate (or --check) the plan from a tree + modules.json
  gen-sources     write one module's generated sources (FlashInfer writes some .cu files itself)
  compile-object  one object: the plan's command with tree/CUDA paths filled in   (Bazel action)
  link-module     one module .so from its objects                                (Bazel action)
  assemble        AOT layout flashinfer/data/aot/<m>/<m>.so + kernel_cache.json  (Bazel action)
  build           everything without Bazel: parallel, per-object content-addressed (reuse checked
                  against each file's sha256 record), resumable
  verify          ELF arch, digests, and resolution through FlashInfer's lookup with JIT disabled
  unpack-tvm-ffi  tvm-ffi's headers from the stack's apache-tvm-ffi wheel             (Bazel action)
  cuda-stubs      the link-time stub dir (a libcuda.so stub)

build and verify are imported only when run: the Bazel actions' tool (//tools/kernel_cache:actions)
leaves those modules out, so editing them does not invalidate every compiled object.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

import tools.kernel_cache
from tools.common.cache import cache_root
from tools.common.cliargs import named_paths
from tools.common.errors import UserError
from tools.common.files import replace_dir, temp_dir_sibling, write_text_atomic
from tools.kernel_cache.actions import (Fill, assemble, check_nvcc, compile_one, link_one,
                                        link_spec, object_spec, read_spec)
from tools.kernel_cache.modules import VARIANTS, check_arch, load_modules
from tools.kernel_cache.plan import (describe_drift, find_module, make_plan, parse_only,
                                     read_plan, render_plan, select_modules)
from tools.kernel_cache.probe import probe_main, run_probe
from tools.kernel_cache.selection import FULL, planned_selections
from tools.kernel_cache.toolchain import (Toolchain, load_toolchain, unpack_tvm_ffi,
                                          write_cuda_stubs)
from tools.kernel_cache.tree import check_tree, dir_digest, log


def _add_common(p: argparse.ArgumentParser, tree: bool = True) -> None:
    if tree:
        p.add_argument("--flashinfer-tree", type=Path, required=True,
                       help="patched tree (directory holding flashinfer/)")
    p.add_argument("--cuda-home", default=None,
                   help="CUDA root: the pinned one (@kimi_cuda//:root under Bazel) or a local "
                        "CUDA 13.0 (default $KIMI_CUDA_HOME; no other default)")
    p.add_argument("--userland", default=None,
                   help="compiler userland (the unpacked Debian set kernel-userland: g++-12, "
                        "binutils, libc6-dev), used through --sysroot; default: compilers on PATH")
    p.add_argument("--tvm-ffi", default=None,
                   help="the stack's apache-tvm-ffi as `unpack-tvm-ffi` writes it; default: the "
                        "running interpreter's")
    p.add_argument("--nice", type=int, default=10, help="niceness of compiler processes")


def _add_selection(p: argparse.ArgumentParser) -> None:
    p.add_argument("--selection", default=FULL,
                   help="kernel selection (kernel_cache/selections.json); default: full, "
                        "everything FlashInfer compiles")
    p.add_argument("--selections", type=Path,
                   help="the selections file (default: selections.json beside --modules)")


def _toolchain(args: argparse.Namespace) -> Toolchain:
    return load_toolchain(args.cuda_home, args.userland, args.tvm_ffi)




def _need(args: argparse.Namespace, name: str) -> Any:
    value = getattr(args, name)
    if value is None:
        raise UserError(f"{args.cmd}: pass --spec, or --{name} (with --plan/--module"
                        f"{'/--object' if args.cmd == 'compile-object' else ''})")
    return value


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kernel_cache",
                                 description=tools.kernel_cache.__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("plan", help="generate the per-object plan (.bzl) from the tree")
    _add_common(p)
    p.add_argument("--modules", type=Path, required=True)
    p.add_argument("--arch", default="12.0f")
    p.add_argument("--variant", choices=VARIANTS, default="full",
                   help="full (default): FlashInfer's own flags; lean: use_fast_build=True")
    _add_selection(p)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--check", action="store_true", help="compare with --out instead of writing")

    p = sub.add_parser("gen-sources", help="one module's generated sources (Bazel action)")
    _add_common(p)
    p.add_argument("--plan", type=Path, required=True)
    p.add_argument("--modules", type=Path, required=True)
    p.add_argument("--module", required=True)
    p.add_argument("--out", type=Path, required=True, help="directory to create")

    p = sub.add_parser("compile-object", help="compile one object of the plan (Bazel action)")
    _add_common(p)
    p.add_argument("--spec", type=Path,
                   help="the object's own entry (written by defs.bzl; see object_spec) instead of "
                        "--plan/--module/--object")
    p.add_argument("--plan", type=Path)
    p.add_argument("--module")
    p.add_argument("--object", help="object name as in the plan")
    p.add_argument("--gen-dir", type=Path, help="the module's gen-sources output")
    p.add_argument("--out", type=Path, required=True)

    p = sub.add_parser("link-module", help="link one module .so (Bazel action)")
    _add_common(p, tree=False)
    p.add_argument("--spec", type=Path,
                   help="the module's link entry (written by defs.bzl; see link_spec) instead of "
                        "--plan/--module")
    p.add_argument("--plan", type=Path)
    p.add_argument("--module")
    p.add_argument("--objects-dir", type=Path, required=True,
                   help="directory holding the module's objects under their plan names")
    p.add_argument("--out", type=Path, required=True)

    p = sub.add_parser("assemble", help="write the AOT layout + kernel_cache.json (Bazel action)")
    _add_common(p, tree=False)
    p.add_argument("--plan", type=Path, required=True)
    p.add_argument("--module-so", action="append", default=[], help="NAME=PATH")
    p.add_argument("--only", action="append", default=[],
                   help="assemble only these modules (comma separated or repeated)")
    p.add_argument("--out", type=Path, required=True)

    p = sub.add_parser("build", help="build everything without Bazel (resumable)")
    _add_common(p)
    p.add_argument("--modules", type=Path, required=True)
    p.add_argument("--arch", default="12.0f")
    p.add_argument("--variant", choices=VARIANTS, default="full",
                   help="full (default): FlashInfer's own flags; lean: use_fast_build=True")
    _add_selection(p)
    p.add_argument("--plan", type=Path, help="fail if this checked-in plan drifted")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("-j", "--jobs", type=int, default=1)
    p.add_argument("--mem-budget-mb", type=int, default=16000)
    p.add_argument("--cache-dir", type=Path, default=cache_root() / "kernels")
    p.add_argument("--only", action="append", default=[], help="build only these modules")

    p = sub.add_parser("verify", help="check ELF arch, digests and clean-env resolution")
    _add_common(p)
    p.add_argument("--cache", type=Path, required=True, help="output of build/assemble")
    p.add_argument("--modules", type=Path)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--cuobjdump")
    p.add_argument("--arch", help="required arch list (default: the one in kernel_cache.json)")
    p.add_argument("--only", action="append", default=[],
                   help="require only these modules of --modules (a subset build)")
    p.add_argument("--no-load", action="store_true",
                   help="only check resolution, not dlopen (hosts without a CUDA driver)")
    p.add_argument("--driver-stub", action="store_true",
                   help="put an empty libcuda.so.1 on LD_LIBRARY_PATH for the load check")

    p = sub.add_parser("unpack-tvm-ffi", help="tvm-ffi's headers from the stack's wheel (Bazel action)")
    p.add_argument("--wheel", type=Path, required=True, help="an apache-tvm-ffi wheel")
    p.add_argument("--out", type=Path, required=True, help="directory to create")

    p = sub.add_parser("cuda-stubs", help="write the link-time stub dir")
    _add_common(p, tree=False)
    p.add_argument("--out", type=Path, required=True)

    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_probe"]:
        return probe_main()
    args = parser().parse_args(argv)
    if args.cmd == "plan":
        check_arch(args.arch)
        tc = _toolchain(args)
        plan = make_plan(args.flashinfer_tree, args.modules, args.arch, args.variant, tc,
                         selection=args.selection, selections_path=args.selections)
        if args.check:
            drift = describe_drift(read_plan(args.out), plan)
            if drift:
                raise UserError(f"--out {args.out}: plan drifted from the tree: {drift}; "
                                "regenerate it with `python3 -m tools.kernel_cache plan`")
            log(f"{args.out}: up to date ({plan['object_count']} objects)")
            return 0
        write_text_atomic(args.out, render_plan(plan))
        log(f"wrote {args.out}: {len(plan['modules'])} modules, {plan['object_count']} objects")
        return 0
    if args.cmd == "gen-sources":
        plan = read_plan(args.plan)
        tc = _toolchain(args)
        decls = [d for d in load_modules(args.modules) if d.name == args.module]
        if not decls:
            raise UserError(f"--module {args.module}: not in {args.modules}")
        module = find_module(plan, args.module)
        tmp = temp_dir_sibling(args.out.absolute())
        try:
            run_probe(check_tree(args.flashinfer_tree), decls, plan["arch"], plan["variant"], tc,
                      gen_out=tmp, selections=planned_selections(plan))
            got = dir_digest(tmp / args.module)
            if got != module["gen_digest"]:
                raise UserError(f"module {args.module}: generated sources {got[:16]} differ from "
                                f"the plan's {module['gen_digest'][:16]}; regenerate the plan")
            replace_dir(tmp / args.module, args.out.absolute(), "--out", tool=None)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return 0
    if args.cmd == "compile-object":
        spec = (read_spec(args.spec, "object") if args.spec else
                object_spec(read_plan(_need(args, "plan")), _need(args, "module"),
                            _need(args, "object")))
        tc = _toolchain(args)
        check_nvcc(spec, tc)
        module, obj = {"name": spec["module"]}, spec["object"]
        args.module, args.object = spec["module"], obj["out"]
        if args.gen_dir is None and "@GEN@" in json.dumps(obj):
            raise UserError(f"--object {args.object}: uses generated sources; pass --gen-dir "
                            "(the gen-sources output of this module)")
        fill = Fill(check_tree(args.flashinfer_tree),
                    (args.gen_dir or Path("/nonexistent")).absolute(), tc)
        log(f"{args.module}: compiling {args.object}")
        secs = compile_one(module, obj, fill, args.out.absolute(), args.nice)
        log(f"{args.module}: {args.object} done in {secs:.1f}s")
        return 0
    if args.cmd == "link-module":
        spec = (read_spec(args.spec, "link") if args.spec else
                link_spec(read_plan(_need(args, "plan")), _need(args, "module")))
        tc = _toolchain(args)
        check_nvcc(spec, tc)
        module = {"name": spec["module"], "link": spec["link"]}
        objects = [args.objects_dir.absolute() / o for o in spec["objects"]]
        missing = [o.name for o in objects if not o.is_file()]
        if missing:
            raise UserError(f"--objects-dir {args.objects_dir}: missing {missing[:3]}")
        with tempfile.TemporaryDirectory() as t:
            stubs = write_cuda_stubs(tc, Path(t) / "stubs")
            link_one(module, Fill(Path("/nonexistent"), Path("/nonexistent"), tc), objects,
                     args.out.absolute(), stubs)
        return 0
    if args.cmd == "assemble":
        plan = read_plan(args.plan)
        tc = _toolchain(args)
        assemble(select_modules(plan, args.only), tc, named_paths(args.module_so, "--module-so", what="module"),
                 args.out)
        return 0
    if args.cmd == "build":
        from tools.kernel_cache.build import build  # not an action's import: see module doc
        check_arch(args.arch)
        tc = _toolchain(args)
        build(args.flashinfer_tree, args.modules, args.arch, args.variant, args.out, args.jobs,
              args.cache_dir.absolute(), tc, args.mem_budget_mb, args.nice, args.plan, args.only,
              selection=args.selection, selections_path=args.selections)
        return 0
    if args.cmd == "verify":
        from tools.kernel_cache.verify import verify  # not an action's import: see module doc
        tc = _toolchain(args)
        report = verify(args.cache, args.flashinfer_tree, args.modules, args.python, tc,
                        args.cuobjdump, not args.no_load, args.driver_stub, args.arch,
                        only=parse_only(args.only))
        print(json.dumps(report, indent=1, sort_keys=True))
        return 0
    if args.cmd == "unpack-tvm-ffi":
        unpack_tvm_ffi(args.wheel, args.out.absolute())
        return 0
    if args.cmd == "cuda-stubs":
        write_cuda_stubs(_toolchain(args), args.out.absolute())
        return 0
    return 2
