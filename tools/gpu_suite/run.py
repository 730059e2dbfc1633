"""Run the GPU suite on a host without Bazel: the same test files, pytest, a JUnit XML report.

For GPU hosts that have CUDA torch and pytest but no Bazel and no registry access (such as the
H200 host this project was proven on). The bundle's run.sh (tools/gpu_suite/host.py,
docs/GPU_RUN.md) brings the stack's wheels, builds the kernel cache for the host's arch and runs
this; by hand, with those wheels and a cache (`bazel build //kernel_cache:sm90_cache`, or
`python3 -m tools.kernel_cache build --arch 9.0a`):

    python3 -m tools.gpu_suite --wheel dist/*.whl --kernel-cache cache-90a --junit gpu.xml

It lays them out with tools/gpu_suite/site.py (through tests/gpu/conftest.py), runs pytest on
tests/gpu with FLASHINFER_DISABLE_JIT=1, and prints a table: test, outcome, device, reason.
Exit status is pytest's (0 only when nothing failed). A module kernel_cache/modules.json
declares for the cache's arch that the cache lacks fails its tests; for a cache built as a
subset (`python3 -m tools.kernel_cache build --only`, `--//kernel_cache:only`) pass the same `--only` here,
and the modules it leaves out are skipped instead.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Sequence

from tools.common.errors import UserError, run_cli

ROOT = Path(__file__).absolute().parents[2]


def summarize(junit: Path) -> tuple[list[tuple[str, str, str, str]], dict[str, int]]:
    """(test, outcome, device, reason) rows and outcome counts from a pytest JUnit XML file."""
    root = ET.parse(junit).getroot()
    rows: list[tuple[str, str, str, str]] = []
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for case in root.iter("testcase"):
        name = f"{Path(case.get('file') or case.get('classname', '').replace('.', '/')).stem}::{case.get('name')}"
        device = next((p.get("value", "") for p in case.iter("property") if p.get("name") == "device"), "")
        outcome, reason = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                reason = (el.get("message") or "").splitlines()[0][:160] if el.get("message") else ""
        counts[outcome] += 1
        rows.append((name, outcome, device, reason))
    return rows, counts


def _wheel_files(paths: Sequence[Path]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        out += sorted(p.glob("*.whl")) if p.is_dir() else [p]
    return out


def check_tvm_ffi_matches_cache(kernel_cache: Path, wheels: Sequence[Path]) -> None:
    """The apache-tvm-ffi wheel brought to the GPU host must be the version the kernel cache was
    compiled against (kernel_cache.json: the stack's own, the one the image ships), or the run
    would test a combination no image contains."""
    import json

    from tools.kernel_cache.actions import CACHE_JSON_NAME
    from tools.kernel_cache.tree import AOT_SUBDIR
    meta = kernel_cache / AOT_SUBDIR / CACHE_JSON_NAME
    if not meta.is_file():
        return
    want = json.loads(meta.read_text()).get("toolchain", {}).get("tvm_ffi_version")
    brought = {w.name.split("-")[1]: w for w in _wheel_files(wheels)
               if w.name.startswith("apache_tvm_ffi-")}
    if want and brought and want not in brought:
        got = ", ".join(sorted(brought))
        raise UserError(f"--wheel apache_tvm_ffi {got}: the kernel cache {kernel_cache} was compiled "
                        f"against apache-tvm-ffi {want} (the stack's own); bring that wheel "
                        f"(pip download apache-tvm-ffi=={want} --no-deps for this Python)")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", type=Path, action="append", default=[], help="wheel or directory of wheels (repeat)")
    ap.add_argument("--kernel-cache", type=Path, help="directory holding flashinfer/data/aot for this GPU's arch")
    ap.add_argument("--only", action="append", default=[],
                    help="the module subset the kernel cache was built with (comma separated, repeat)")
    ap.add_argument("--junit", type=Path, required=True, help="where to write the JUnit XML report")
    ap.add_argument("--tests", nargs="*", default=[str(ROOT / "tests" / "gpu")], help="test files or directories")
    ap.add_argument("-k", dest="keyword", help="pytest -k expression")
    args = ap.parse_args(argv)
    for w in args.wheel:
        if not w.exists():
            raise UserError(f"--wheel {w}: no such file or directory")
    if args.kernel_cache and not (args.kernel_cache / "flashinfer" / "data" / "aot").is_dir():
        raise UserError(f"--kernel-cache {args.kernel_cache}: no flashinfer/data/aot inside; pass a kernel cache output")
    if args.kernel_cache:
        check_tvm_ffi_matches_cache(args.kernel_cache, args.wheel)
    env = dict(os.environ)
    env["KIMI_GPU_WHEELS"] = os.pathsep.join(str(w.absolute()) for w in args.wheel)
    if args.kernel_cache:
        env["KIMI_GPU_KERNEL_CACHE"] = str(args.kernel_cache.absolute())
    if args.only:
        env["KIMI_GPU_KERNEL_CACHE_ONLY"] = ",".join(args.only)
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-v", "-s", "-rs", "-o", "junit_family=xunit1",
           f"--junitxml={args.junit.absolute()}", *args.tests]
    if args.keyword:
        cmd += ["-k", args.keyword]
    rc = subprocess.run(cmd, env=env, cwd=ROOT).returncode
    if not args.junit.is_file():
        raise UserError(f"pytest wrote no report to {args.junit} (exit {rc}); see its output above")
    rows, counts = summarize(args.junit)
    width = max((len(r[0]) for r in rows), default=4)
    print(f"\n{'test':<{width}}  {'outcome':<8} {'device':<24} reason")
    for name, outcome, device, reason in rows:
        print(f"{name:<{width}}  {outcome:<8} {device:<24} {reason}")
    print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    return rc


if __name__ == "__main__":
    sys.exit(run_cli(main))
