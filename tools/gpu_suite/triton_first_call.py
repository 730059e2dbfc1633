"""First-call times of the Triton calls built ahead of time, on this GPU, with the shipped cache
(no compiler reachable: the proof's environment) and without it (an empty TRITON_CACHE_DIR, the
host's ptxas and C compiler, as a server compiles today):

    python3 -m tools.gpu_suite.triton_first_call --cache SHIPPED --cuda-home CUDA_ROOT

Run by the bundle's `sh run.sh --triton` after the proof (tools/gpu_suite/host.py), with the
Triton site and the SGLang site on PYTHONPATH. Each (call, mode) runs in a fresh process: the
first call is SGLang's own function (tools/jit_cache/triton_worker.py sglang_kda_prefill) on the
GPU, timed to torch.cuda.synchronize() (cache lookups or compiles, autotuning, launches); the
second is the same again. Prints a table; exit 1 if a shipped run compiled.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from tools.common.errors import UserError, run_cli
from tools.gpu_suite.first_call import print_table, run_fresh

ROOT = Path(__file__).absolute().parents[2]
MANIFEST = "kimi-k3-triton.json"  # tools/jit_cache/triton_aot.py MANIFEST


def measure(args_json: str) -> dict[str, Any]:
    """In this process: one call's first and second time (seconds) and Triton's compiles."""
    import torch
    from triton import knobs

    from tools.jit_cache.triton_worker import import_sglang, sglang_kda_prefill

    import_sglang()

    events: list[bool] = []
    knobs.compilation.listener = lambda *, src, metadata, metadata_group, times, cache_hit: events.append(cache_hit)
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        sglang_kda_prefill(**json.loads(args_json), device="cuda")
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {"first_s": times[0], "second_s": times[1], "compiles": events.count(False), "hits": events.count(True)}


def run_call(args: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    return run_fresh("tools.gpu_suite.triton_first_call:measure", json.dumps(args), env)


def compiling_env(cuda_home: Path, scratch: Path) -> dict[str, str]:
    """As a server runs today: an empty Triton cache, the host's ptxas (the proof's Triton has
    only a stand-in) and C compiler (Triton's driver module), the Python headers it has."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_CACHE_DIR", "TRITON_LIBCUDA_PATH")}
    return env | {"TRITON_CACHE_DIR": tempfile.mkdtemp(prefix="triton-empty-", dir=scratch),
                  "TRITON_PTXAS_PATH": str(cuda_home / "bin" / "ptxas"),
                  "PATH": os.pathsep.join([str(cuda_home / "bin"), "/usr/bin", "/bin"])}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, required=True, help="the shipped Triton cache (its manifest lists the calls)")
    ap.add_argument("--cuda-home", type=Path, required=True, help="the host's CUDA root, for the compiling runs")
    ap.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()))
    args = ap.parse_args(argv)
    if not (args.cuda_home / "bin" / "ptxas").is_file():
        raise UserError(f"--cuda-home {args.cuda_home}: no bin/ptxas; pass the host's CUDA root "
                        "(the runs without the shipped cache compile with it)")
    calls = json.loads((args.cache / MANIFEST).read_text())["calls"]
    scratch = Path(tempfile.mkdtemp(prefix="triton-first-call-", dir=args.scratch))
    from tools.jit_cache.triton_aot import bind

    def shipped_env() -> dict[str, str]:  # a fresh directory per run: no earlier run's autotune results
        bound = Path(tempfile.mkdtemp(prefix="triton-bound-", dir=scratch))
        bind(args.cache, bound)
        return dict(os.environ, TRITON_CACHE_DIR=str(bound))

    rows = [(c, run_call(c["args"], shipped_env()), run_call(c["args"], compiling_env(args.cuda_home, scratch)))
            for c in calls]

    named = [(f"{c['call']} {json.dumps(c['args'], sort_keys=True)}", shipped, compiled)
             for c, shipped, compiled in rows]
    return 1 if print_table("call", named, width=44, hits=True) else 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
