"""What Triton compiles at the first prefill of a Kimi-K3 KDA layer, measured on this machine
without a GPU (a benchmark that prints a table, not a test; issue #27's Triton groundwork):

    python3 -m tools.bench.triton_first_use [--heads 3,24] [--batch 64 [--batch 64,100 ...]] [--keep DIR]

Builds the image's installed trees (`tools/bazel build --config=pypi
//jit_cache:sglang_jit_12_0f_image_inputs`), then runs tools/jit_cache/triton_worker.py under the
image's python3.11 over them: SGLang's own KDA prefill call (the Triton KDA backend's chunk_kda,
as kda_backend.forward_extend makes it) for each local head count (Kimi-K3's 96 KDA heads over
TP32: 3, TP4: 24), with Triton's launch path against a stand-in SM120 device, twice, each call
in a fresh process over one TRITON_CACHE_DIR. The first pass compiles what a server's first request
compiles (every config of an autotuned kernel); the second must find every kernel in Triton's disk
cache (Triton's own key lookup for 12.0): exit 1 otherwise.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Sequence

from tools.bench.runs import REPO_ROOT, machine
from tools.common.errors import UserError, run_cli

INPUTS = "//jit_cache:sglang_jit_12_0f_image_inputs"


def image_inputs() -> tuple[Path, list[Path]]:
    bazel = str(REPO_ROOT / "tools" / "bazel")
    subprocess.run([bazel, "build", "--config=pypi", INPUTS], cwd=REPO_ROOT, check=True)
    out = subprocess.run([bazel, "cquery", "--config=pypi", "--output=files", INPUTS], cwd=REPO_ROOT,
                         check=True, capture_output=True, text=True).stdout.split()
    paths = [REPO_ROOT / p for p in out]
    tars = [p for p in paths if p.name.endswith(".tar")]
    if len(tars) != 1:
        raise UserError(f"{INPUTS}: expected one base tar among {out}")
    return tars[0], [p for p in paths if p not in tars]


def run_bench(heads: list[int], batches: list[list[int]], keep: Path | None) -> int:
    from tools.image.wheel_install import SITE_PACKAGES
    from tools.jit_cache.sglang_aot import ImagePython
    from tools.jit_cache.triton_aot import DEVICES, run_calls

    base, trees = image_inputs()
    calls = [{"call": "sglang_kda_prefill", "args": {"heads": h, "sequences": b}, "kernels": []}
             for h in heads for b in batches]
    ok = True
    with tempfile.TemporaryDirectory(prefix="triton-first-use-") as scratch_dir:
        scratch = Path(scratch_dir)
        image = ImagePython(scratch, base, trees, "/" + SITE_PACKAGES, "12.0f")
        cache = scratch / "triton-cache"
        # Each call in its own process, as each server process starts cold: an autotuner's
        # in-memory results must not carry from one head count to the next.
        first = run_calls(image, DEVICES["12.0"], calls, cache, "first")
        second = run_calls(image, DEVICES["12.0"], calls, cache, "second")
        files = [p for p in cache.rglob("*") if p.is_file()]
        size = sum(p.stat().st_size for p in files)
        needed = sum(p.stat().st_size for p in files if p.suffix in (".cubin", ".json"))
        print(f"machine: {machine()}")
        print("| KDA heads | sequence lengths | pass 1: kernels compiled (by kernel) | pass 1 s | pass 2: disk hits | pass 2 compiled | pass 2 s |")
        print("|---|---|---|---|---|---|---|")
        for a, b in zip(first, second):
            for row in (a, b):
                if "error" in row:
                    ok = False
                    print(f"error: {row['call']} {row['args']}: {row['error']}", file=sys.stderr)
            by_kernel = ", ".join(f"{n} {c}" for n, c in sorted(Counter(k.split(":")[-1] for k in a["compiled"]).items()))
            print(f"| {a['args']['heads']} | {','.join(map(str, a['args']['sequences']))} | {len(a['compiled'])} ({by_kernel}) | "
                  f"{a['seconds']:.1f} | {len(b['hits'])} | {len(b['compiled'])} | {b['seconds']:.1f} |")
            ok = ok and not b["compiled"] and bool(b["hits"])
        print(f"Triton cache: {len(list(cache.iterdir()))} entries, {size / 1e6:.1f} MB "
              f"({needed / 1e6:.1f} MB of .cubin and .json)")
        if keep:
            import shutil
            shutil.copytree(cache, keep, dirs_exist_ok=True)
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m tools.bench.triton_first_use",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--heads", default="3,24", help="KDA local head counts (comma separated)")
    ap.add_argument("--batch", action="append", help="a prefill batch's sequence lengths, comma separated (repeat; default 64)")
    ap.add_argument("--keep", type=Path, help="copy the Triton cache there")
    args = ap.parse_args(argv)
    try:
        heads = [int(h) for h in args.heads.split(",") if h]
        batches = [[int(n) for n in b.split(",") if n] for b in (args.batch or ["64"])]
    except ValueError:
        raise UserError(f"--heads {args.heads} / --batch {args.batch}: not comma-separated integers") from None
    return run_bench(heads, batches, args.keep)


if __name__ == "__main__":
    sys.exit(run_cli(main))
