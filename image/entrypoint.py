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

Stdlib only: it runs as the image's PID 1 before anything else is imported.
"""
from __future__ import annotations

import os
import sys
from typing import Mapping, Sequence

ISSUE = "kvcache-ai/Mooncake#2511"
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


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


def main(argv: Sequence[str]) -> int:
    message = refusal(argv, os.environ)
    if message:
        print(message, file=sys.stderr)
        return 2
    os.execvp("python3", ["python3", "-m", "sglang.launch_server", *argv])
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
