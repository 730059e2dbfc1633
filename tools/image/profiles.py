"""Launch profiles (image/profiles/NAME.json) and their check against an image.

Usage:
    python3 -m tools.image.profiles validate [--profiles-dir image/profiles] [--needs image/backend_needs.json]
            [--selections kernel_cache/selections.json] [--lock third_party/pins.lock.json]
        Every profile without an image: the schema (no key twice in one object, no flag twice in
        `args`), placeholders declared and used, the checkpoint facts, a kernel selection of
        kernel_cache/selections.json; the needs table's features are ones the probe knows; and the
        image entrypoint's own guard (image/entrypoint.py `refusal`) on the profile's args and env
        with the examples, for the Mooncake release of every stack of the lock. The action that
        builds the image's entrypoint layer runs the same checks (tools/image/entrypoint_layer.py).
    python3 -m tools.image.profiles show NAME [--profiles-dir image/profiles]
        The command `kimi-k3-entrypoint --print-profile NAME` prints, with the placeholders'
        example values (the image's own entrypoint code resolves it).

The check itself runs through the smoke test (`python3 -m tools.image.smoke --layout L --profile
kimi-k3`, or `--launch-profile NAME`): tools/image/profile_probe.py runs inside the unpacked image
with the image's python3 and SGLang (how, and which SGLang steps it skips: its docstring and the
README "Launch profiles"); profile_verdicts.py builds its request and judges its results:
- a probe failure (entrypoint, guard, SGLang's parser, a resolution step, check_server_args) is
  one line naming the profile, the stage and SGLang's message (which names the argument);
- the profile's needs: its kernel selection must be the image kernel cache's (or `full`); every
  FlashInfer module that image/backend_needs.json lists for the profile's checkpoint
  architecture and for the values SGLang resolved (e.g. moe_runner_backend=flashinfer_mxfp4) must
  be in the cache, with the CUTLASS MoE runners it names compiled in; every feature it lists
  (e.g. SiTU in the MXFP4 CUTLASS MoE) must pass its probe in the image.
The kernel cache is the image's (flashinfer/data/aot/kernel_cache.json and its modules' .so
files), or, for an image assembled without its kernel-cache layer (the CPU suite's), the checked-in
plan the cache would be built from (--kernel-cache-plan).
- the first-use inventory (jit_cache/inventory.<stack>.json, --inventory): every site it marks
  `prebuilt` that the profile reaches must be in the image: a FlashInfer module in the kernel
  cache above, an SGLang JIT build (call and args) in the image's
  /usr/share/kimi-k3/sglang-jit/kimi-k3-sglang-jit.json with its .so present at the recorded
  sha256. A prebuilt site of a kind the check cannot look up fails too (it would pass unchecked).

The jobs live one per module: launch_profiles (the format, loading, the checks without an image),
backend_needs (image/backend_needs.json), image_caches (what the image holds ahead of first use),
profile_verdicts (the probe's request and output, the verdicts); profiles.py is the CLI.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from tools.common.errors import UserError, run_cli
from tools.image.backend_needs import load_needs
from tools.image.launch_profiles import (DEFAULT_LOCK, DEFAULT_NEEDS, DEFAULT_PROFILES_DIR, DEFAULT_SELECTIONS,
                                         check_profiles, load_entrypoint, load_profiles, select_profiles)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate", help="schema of every profile and of the needs table")
    v.add_argument("--profiles-dir", type=Path, default=DEFAULT_PROFILES_DIR)
    v.add_argument("--needs", type=Path, default=DEFAULT_NEEDS)
    v.add_argument("--selections", type=Path, default=DEFAULT_SELECTIONS)
    v.add_argument("--lock", type=Path, default=DEFAULT_LOCK)
    s = sub.add_parser("show", help="the command --print-profile prints, with the example values")
    s.add_argument("name")
    s.add_argument("--profiles-dir", type=Path, default=DEFAULT_PROFILES_DIR)
    args = p.parse_args(argv)
    profiles = load_profiles(args.profiles_dir)
    if args.command == "validate":
        load_needs(args.needs)
        check_profiles(profiles, args.selections, args.lock)
        for name in profiles:
            print(f"ok   {name}")
        return 0
    (profile,) = select_profiles(profiles, [args.name], "profile")
    entrypoint = load_entrypoint()
    examples = {k: spec["example"] for k, spec in profile.data.get("placeholders", {}).items()}
    try:
        cmd_args, env = entrypoint.resolve_profile(profile.name, examples, str(args.profiles_dir))
    except entrypoint.ProfileError as e:
        raise UserError(str(e)) from None
    print(entrypoint.profile_command(cmd_args, env))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
