"""The artifact cache root every stage shares (CAS, git mirrors, kernel objects, rootfs tars, the
local registry): $KIMI_K3_CACHE, else ${XDG_CACHE_HOME:-~/.cache}/kimi-k3-build. tools/bazel
computes the same path in shell (it runs before any Python) and exports KIMI_K3_CACHE."""
from __future__ import annotations

import os
from pathlib import Path

ENV = "KIMI_K3_CACHE"


def cache_root() -> Path:
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kimi-k3-build"
