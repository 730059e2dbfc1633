"""First-use compiles: the sites by kind and what the first-use caches cost (a benchmark that
prints tables, not a test).

    python3 -m tools.bench.first_use [--build] [--roots N] [--record docs/measurements/DAY.md] [--keep]

Table 1 (no build): per stack, from its checked-in jit_cache/inventory.<stack>.json, per kind the
sites the launch profiles reach, how many are prebuilt and how many are gaps (and of those in the
startup tier).

Table 2 (--build): in N fresh clones of HEAD (default 2), each with its own output root and an
empty disk cache (Bazel cold), first the image layers the SGLang JIT build runs on
(`tools/bazel build --config=pypi //jit_cache:sglang_jit_12_0f_image_inputs`: the base tar and
the installed trees of the layers below SGLang's JIT layer), then, timed one by one, what each
first-use cache layer adds to the main job (`tools/bazel build --config=pypi //image:layer_<L>`:
sglang_jit, the modules of jit_cache/sglang_modules.json for 12.0f; triton, Triton's driver module and the kernels of
jit_cache/triton_calls.json for 12.0; each layer written), with the layer's compressed size and
digest. Every root must give the same digest for each layer (exit 1 otherwise). The
downloads' cache and the sealed Bazel root are kept, as in `python3 -m tools.bench`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from tools.bench.runs import REPO_ROOT, clone, machine, run, shutdown
from tools.common.errors import UserError, run_cli

ELAPSED_RE = re.compile(r"INFO: Elapsed time: ([\d.]+)s, Critical Path: ([\d.]+)s")
# The first-use cache layers the main job adds above what they are built on, timed one by one.
LAYERS = ("sglang_jit", "triton")
# What the SGLang JIT build runs on: the image's base tar and installed layer trees (the rule's
# output group, so the list of layers stays in jit_cache/BUILD.bazel).
BELOW = "//jit_cache:sglang_jit_12_0f_image_inputs"


def sites_table(inventory_dir: Path) -> str:
    lines = ["| stack | SGLang | kind | reached | prebuilt | gap | gap in startup tier |", "|---|---|---|---|---|---|---|"]
    for path in sorted(inventory_dir.glob("inventory.*.json")):
        inv = json.loads(path.read_text())
        startup_gaps: dict[str, int] = {}
        for site in inv["sites"].values():
            if site["status"] == "gap" and site["tier"] == "startup":
                startup_gaps[site["kind"]] = startup_gaps.get(site["kind"], 0) + 1
        for kind, c in sorted(inv["counts"].items()):
            lines.append(f"| {inv['stack']} | {inv['sglang_version']} | {kind} | {c['reached']} | {c['prebuilt']} | "
                         f"{c['gap']} | {startup_gaps.get(kind, 0)} |")
    return "\n".join(lines) + "\n"


def _descriptor(clone_dir: Path, layer: str) -> dict[str, Any]:
    """The layer's descriptor from the clone's last build (bazel-bin is that build's configuration)."""
    return json.loads((clone_dir / "bazel-bin" / "image" / f"layer_{layer}.layer.json").read_text())


def build_rows(work: Path, roots: int, keep: bool) -> tuple[list[str], bool]:
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("KIMI_K3_BAZEL_OUTPUT_ROOT", "KIMI_K3_DISK_CACHE"))}
    rows: list[str] = []
    digests: dict[str, set[str]] = {}
    for i in range(roots):
        name = f"root-{i + 1}"
        clone(work / name)
        env = base_env | {"KIMI_K3_BAZEL_OUTPUT_ROOT": str(work / f"out-{name}"),
                          "KIMI_K3_DISK_CACHE": str(work / f"disk-{name}")}
        try:
            rc, below_s, _ = run(["tools/bazel", "build", "--config=pypi", BELOW], work / name, env,
                                 work / f"{name}-below.log")
            if rc != 0:
                raise UserError(f"{name}: `tools/bazel build --config=pypi {BELOW}` failed (exit {rc}); "
                                f"see {work / name}-below.log")
            for layer in LAYERS:
                label = f"//image:layer_{layer}"
                rc, secs, out = run(["tools/bazel", "build", "--config=pypi", label], work / name, env,
                                    work / f"{name}-{layer}.log")
                if rc != 0:
                    raise UserError(f"{name}: `tools/bazel build --config=pypi {label}` failed (exit {rc}); "
                                    f"see {work / name}-{layer}.log")
                m = ELAPSED_RE.findall(out)
                bazel = f"Bazel {float(m[-1][0]):.0f} s, critical path {float(m[-1][1]):.0f} s" if m else "no Bazel summary"
                desc = _descriptor(work / name, layer)
                digests.setdefault(layer, set()).add(desc["digest"])
                rows.append(f"| {name} | {below_s:.0f} s | `{layer}` | {secs:.0f} s ({bazel}) | "
                            f"{desc['size'] / 1e6:.2f} MB | `{desc['digest'][:19]}...` |")
        finally:
            shutdown(work / name, env)
            if not keep:
                for d in (f"out-{name}", f"disk-{name}", name):
                    subprocess.run(["rm", "-rf", "--one-file-system", str(work / d)], check=False)
    return rows, all(len(d) == 1 for d in digests.values())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--build", action="store_true", help="also time the first-use cache layers cold, in --roots output roots")
    p.add_argument("--roots", type=int, default=2, help="fresh clones and output roots for --build (default 2)")
    p.add_argument("--inventory-dir", type=Path, default=REPO_ROOT / "jit_cache")
    p.add_argument("--record", type=Path, help="append the tables to this measurements file")
    p.add_argument("--keep", action="store_true", help="keep the clones and output roots")
    args = p.parse_args(argv)
    if args.roots < 1:
        raise UserError(f"--roots {args.roots}: give 1 or more")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                            text=True, check=True).stdout.strip()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = f"Commit {commit}, {when}, {machine()}.\n\nSites the launch profiles reach, by kind:\n\n" + \
        sites_table(args.inventory_dir)
    same = True
    if args.build:
        work = Path(tempfile.mkdtemp(prefix="kimi-k3-bench-first-use."))
        try:
            rows, same = build_rows(work, args.roots, args.keep)
        finally:
            if not args.keep:
                subprocess.run(["rm", "-rf", "--one-file-system", str(work)], check=False)
            else:
                print(f"[bench] kept {work}", file=sys.stderr)
        text += ("\nThe first-use cache layers, cold (own output root, empty disk cache), after the layers they "
                 f"are built on:\n\n| root | `build --config=pypi {BELOW}` | layer | `build --config=pypi "
                 "//image:layer_<layer>` (the main job's extra) | layer size | layer digest |\n"
                 "|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n" +
                 f"\n{'Every root gave the same digest for each layer.' if same else '**The roots gave different layer digests.**'}\n")
    print(text)
    if args.record:
        with open(args.record, "a") as f:
            f.write("\n## `python3 -m tools.bench.first_use" + (" --build" if args.build else "") + "`\n\n" + text)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(run_cli(main))
