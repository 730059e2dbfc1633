"""First-call times of SGLang's JIT modules on this GPU, with the shipped cache (no compiler
reachable) and without it (SGLang compiles with the host's nvcc, as a server does today):

    python3 -m tools.gpu_suite.first_call --cache DIR --runtime gpu_host.json \
        --cuda-home /usr/local/cuda --ninja-wheel ninja-*.whl

Run by the bundle's `sh run.sh --sglang-jit` after the proof (tools/gpu_suite/host.py), with the
SGLang site on PYTHONPATH. Each (case, mode) runs in a fresh process: the first call is SGLang's
entry point on prepared inputs, timed to torch.cuda.synchronize() (module lookup, load or compile,
launch); the second call is the same again. Prints a table; exit 1 if a "shipped" run compiled.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, Sequence

from tools.common.errors import UserError, run_cli
from tools.jit_cache.sglang_aot import load_runtime

ROOT = Path(__file__).absolute().parents[2]


def measure(case_name: str) -> dict[str, Any]:
    """In this process: one case's first and second call (seconds) and the loader's counts."""
    import torch

    from tools.gpu_suite import sglang_jit_cases as cases

    case = next(c for c in cases.CASES if c.name == case_name)
    counts = cases.count_loader()
    device = torch.device("cuda")
    torch.zeros(1, device=device)
    torch.cuda.synchronize()
    call, finish = case.setup(device)
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        result = call()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del finish, result
    return {"first_s": times[0], "second_s": times[1], "compiles": len(counts.compiles),
            "hits": len(counts.hits)}


def proof_env(cache: Path, runtime: dict[str, Any], scratch: Path) -> dict[str, str]:
    """The proof's process environment: no compiler on PATH, CUDA_HOME at the runtime's missing
    directory, Triton's ptxas at a missing file, the shipped cache, a compile raises."""
    no_tools = scratch / "no-compilers"
    no_tools.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH", "CXX")}
    return env | {"PATH": str(no_tools), "CUDA_HOME": runtime["cuda_home"],
                  "TRITON_PTXAS_PATH": runtime["cuda_home"] + "/bin/ptxas",
                  "SGLANG_JIT_CACHE_DIR": str(cache), "SGLANG_CRASH_ON_JIT_COMPILE": "1"}


def ninja_bin(ninja_wheel: Path, scratch: Path) -> Path:
    """The ninja binary of the bundle's ninja wheel (its .data/scripts, which the site leaves
    out), in a directory of its own for PATH."""
    out = scratch / "ninja-bin"
    out.mkdir(exist_ok=True)
    with zipfile.ZipFile(ninja_wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(".data/scripts/ninja")]
        if len(names) != 1:
            raise UserError(f"--ninja-wheel {ninja_wheel}: no .data/scripts/ninja in it")
        (out / "ninja").write_bytes(zf.read(names[0]))
    (out / "ninja").chmod(0o755)
    return out


def compiling_env(cuda_home: Path, ninja: Path, scratch: Path) -> dict[str, str]:
    """As a server runs today: the host's nvcc and c++, ninja, an empty SGLANG_JIT_CACHE_DIR."""
    empty = Path(tempfile.mkdtemp(prefix="sglang-jit-empty-", dir=scratch))
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_CRASH_ON_JIT_COMPILE",)}
    return env | {"PATH": os.pathsep.join([str(ninja), str(cuda_home / "bin"), "/usr/bin", "/bin"]),
                  "CUDA_HOME": str(cuda_home), "SGLANG_JIT_CACHE_DIR": str(empty)}


def run_fresh(function: str, arg: str, env: dict[str, str]) -> dict[str, Any]:
    """`module:function`(arg) in a fresh process with env: its JSON result, with wall_s; or
    {"error": the output's last lines}."""
    module, _, name = function.partition(":")
    code = (f"import json, sys; from {module} import {name}; "
            f"print('RESULT ' + json.dumps({name}(sys.argv[1])))")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, arg], env=env, cwd=ROOT,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        return {"error": " | ".join(tail)[:300], "wall_s": wall}
    return json.loads(line[len("RESULT "):]) | {"wall_s": wall}


def run_case(case_name: str, env: dict[str, str]) -> dict[str, Any]:
    return run_fresh("tools.gpu_suite.first_call:measure", case_name, env)


def print_table(what: str, rows: Sequence[tuple[str, dict[str, Any], dict[str, Any]]],
                width: int = 40, hits: bool = False) -> int:
    """The first-call table (one row per (name, shipped, no cache)); returns how many shipped
    runs failed or compiled."""
    def cell(r: dict[str, Any], key: str, fmt: str) -> str:
        return "error" if "error" in r else format(r[key], fmt)

    print(f"{what:<{width}} {'shipped: first':>15} {'second':>9} {'compiles':>8}" + (f" {'hits':>5}" if hits else "")
          + f"   {'no cache: first':>15} {'second':>9} {'compiles':>8}")
    failed = 0
    for name, s, c in rows:
        print(f"{name:<{width}} {cell(s, 'first_s', '.3f') + ' s':>15} {cell(s, 'second_s', '.4f') + ' s':>9} "
              f"{cell(s, 'compiles', 'd'):>8}" + (f" {cell(s, 'hits', 'd'):>5}" if hits else "")
              + f"   {cell(c, 'first_s', '.2f') + ' s':>15} {cell(c, 'second_s', '.4f') + ' s':>9} "
              f"{cell(c, 'compiles', 'd'):>8}")
        for mode, r in (("shipped", s), ("no cache", c)):
            if "error" in r:
                print(f"  {mode}: {r['error']}")
        failed += "error" in s or s.get("compiles", 1) != 0
    return failed


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, required=True, help="the shipped SGLang JIT cache")
    ap.add_argument("--runtime", type=Path, required=True, help="gpu_host.json (sglang_jit_runtime)")
    ap.add_argument("--cuda-home", type=Path, required=True, help="the host's CUDA root, for the compiling runs")
    ap.add_argument("--ninja-wheel", type=Path, required=True, help="the bundle's ninja wheel")
    ap.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()))
    args = ap.parse_args(argv)
    if not (args.cuda_home / "bin" / "nvcc").is_file():
        raise UserError(f"--cuda-home {args.cuda_home}: no bin/nvcc; pass the host's CUDA root "
                        "(the runs without the shipped cache compile with it)")
    runtime = load_runtime(args.runtime)
    from tools.gpu_suite import sglang_jit_cases as cases

    scratch = Path(tempfile.mkdtemp(prefix="first-call-", dir=args.scratch))
    ninja = ninja_bin(args.ninja_wheel, scratch)
    seen: set[str] = set()
    rows = []
    for case in cases.CASES:
        if case.module in seen:  # one row per module: the first call is the module's
            continue
        seen.add(case.module)
        shipped = run_case(case.name, proof_env(args.cache.absolute(), runtime, scratch))
        compiled = run_case(case.name, compiling_env(args.cuda_home, ninja, scratch))
        rows.append((case.name, shipped, compiled))

    return 1 if print_table("module call", rows) else 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
