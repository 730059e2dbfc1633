#!/usr/bin/python3
"""Image entrypoint: refuse a known-bad Mooncake configuration, then exec SGLang's server.

Mooncake cannot register GPU memory that PyTorch allocated with expandable segments
(kvcache-ai/Mooncake#2511; not fixed in 0.3.12.post1, the fix landed later), so a server with
Mooncake transfer and `expandable_segments:True` fails late, at the first KV transfer. This
guard fails at start instead, with the reason.

Mooncake transfer counts as configured when any of these holds:
- `--disaggregation-mode prefill|decode` and the transfer backend is mooncake (SGLang's default
  for `--disaggregation-transfer-backend`);
- `--hicache-storage-backend mooncake` (Mooncake store registers the host KV pool);
- $MOONCAKE_CONFIG_PATH or $MOONCAKE_MASTER is set (Mooncake store configured by environment).
Both PYTORCH_CUDA_ALLOC_CONF and its newer alias PYTORCH_ALLOC_CONF are checked.

Launch profiles (image/profiles/, shipped in /usr/share/kimi-k3/profiles): `--profile NAME` starts
the profile's SGLang arguments with its environment, placeholders (`${MODEL_PATH}`, ...) taken
from the container's environment, through the same guard; `--print-profile NAME` prints that
command instead. tools/image/profiles.py checks each shipped profile against this image with
these same functions, so what an operator starts is what was checked.

Stdlib only: it runs as the image's PID 1 before anything else is imported (the profile
functions import json and shlex when they are used).
"""
from __future__ import annotations

import os
import re
import sys
from typing import Mapping, Sequence

ISSUE = "kvcache-ai/Mooncake#2511"
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
# image/constants.bzl PROFILES_DIR (tests/cpu/image checks that the two agree).
PROFILES_DIR = "/usr/share/kimi-k3/profiles"
PROFILE_NAME = re.compile(r"[a-z0-9][a-z0-9.-]*")
PLACEHOLDER = re.compile(r"\$\{([A-Z][A-Z0-9_]*)\}")


def option_value(args: Sequence[str], name: str) -> str | None:
    """The last value of `--name VALUE` or `--name=VALUE` in args (argparse semantics)."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def mooncake_configured(args: Sequence[str], env: Mapping[str, str]) -> str | None:
    """Why Mooncake transfer is configured, or None."""
    mode = (option_value(args, "--disaggregation-mode") or "null").lower()
    backend = (option_value(args, "--disaggregation-transfer-backend") or "mooncake").lower()
    if mode in ("prefill", "decode") and backend == "mooncake":
        return f"--disaggregation-mode {mode} with the mooncake transfer backend"
    if (option_value(args, "--hicache-storage-backend") or "").lower() == "mooncake":
        return "--hicache-storage-backend mooncake"
    for var in ("MOONCAKE_CONFIG_PATH", "MOONCAKE_MASTER"):
        if env.get(var):
            return f"${var} is set"
    return None


def expandable_segments_on(env: Mapping[str, str]) -> str | None:
    """The variable that turns expandable segments on, or None (entries are key:value, comma-separated)."""
    for var in ALLOC_CONF_VARS:
        for item in env.get(var, "").split(","):
            key, _, value = item.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() == "true":
                return var
    return None


def refusal(args: Sequence[str], env: Mapping[str, str]) -> str | None:
    """The error line if this configuration must not start, else None."""
    var = expandable_segments_on(env)
    reason = mooncake_configured(args, env) if var else None
    if var and reason:
        return (f"error: {var} sets expandable_segments:True while Mooncake transfer is configured "
                f"({reason}); Mooncake cannot register expandable-segment memory ({ISSUE}, not fixed in "
                f"0.3.12.post1): remove expandable_segments:True from {var} or disable Mooncake transfer")
    return None


class ProfileError(Exception):
    """A profile that cannot be started: one line naming the profile and the fix."""


def load_profile(name: str, profiles_dir: str = PROFILES_DIR) -> dict:
    import json

    if not PROFILE_NAME.fullmatch(name):
        raise ProfileError(f"profile {name!r}: not a profile name (lower-case letters, digits, '-', '.')")
    try:
        with open(os.path.join(profiles_dir, name + ".json")) as f:
            return json.load(f)
    except FileNotFoundError:
        shipped = sorted(n[:-5] for n in os.listdir(profiles_dir) if n.endswith(".json")) \
            if os.path.isdir(profiles_dir) else []
        raise ProfileError(f"profile {name!r}: not in {profiles_dir}; this image has: "
                           f"{', '.join(shipped) or 'none'}") from None
    except (OSError, ValueError) as e:
        raise ProfileError(f"profile {name!r}: unreadable ({e}); rebuild the image") from None


def substitute(text: str, values: Mapping[str, str], name: str, placeholders: Mapping[str, Mapping[str, str]]) -> str:
    """`text` with each ${KEY} replaced by values[KEY]; KEY must be a declared placeholder."""
    def value_of(match: re.Match[str]) -> str:
        key = match.group(1)
        spec = placeholders.get(key)
        if spec is None:
            raise ProfileError(f"profile {name}: ${{{key}}} is not one of its placeholders; declare it or remove it")
        value = values.get(key, "")
        if not value:
            raise ProfileError(f"profile {name}: placeholder {key} is not set ({spec.get('description', '')}); "
                               f"set it in the container's environment, e.g. {key}={spec.get('example', '')}")
        return value
    return PLACEHOLDER.sub(value_of, text)


def resolve_profile(name: str, values: Mapping[str, str], profiles_dir: str = PROFILES_DIR) -> tuple[list[str], dict[str, str]]:
    """The SGLang arguments and the environment of profile `name`, placeholders from `values`."""
    profile = load_profile(name, profiles_dir)
    placeholders = profile.get("placeholders", {})
    args = [substitute(a, values, name, placeholders) for a in profile["args"]]
    env = {k: substitute(v, values, name, placeholders) for k, v in profile.get("env", {}).items()}
    return args, env


def profile_command(args: Sequence[str], env: Mapping[str, str]) -> str:
    """The shell command that starts what `--profile` starts."""
    import shlex

    return shlex.join(["env", *(f"{k}={v}" for k, v in sorted(env.items())), "kimi-k3-entrypoint", *args])


def main(argv: Sequence[str]) -> int:
    if argv[:1] in (["--profile"], ["--print-profile"]):
        if len(argv) != 2:
            print(f"error: {argv[0]} NAME takes no other arguments: a profile is started as it was checked; "
                  "change the profile (image/profiles/NAME.json) instead", file=sys.stderr)
            return 2
        try:
            args, env = resolve_profile(argv[1], os.environ)
        except ProfileError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if argv[0] == "--print-profile":
            print(profile_command(args, env))
            message = refusal(args, {**os.environ, **env})
            if message:
                print(message, file=sys.stderr)
                return 2
            return 0
        os.environ.update(env)
        argv = args
    message = refusal(argv, os.environ)
    if message:
        print(message, file=sys.stderr)
        return 2
    os.execvp("python3", ["python3", "-m", "sglang.launch_server", *argv])
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
