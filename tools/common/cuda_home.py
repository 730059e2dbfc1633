"""The image's CUDA home: /usr/local/cuda, a directory of two links into the CUDA wheels' root
(`include`, `lib64`), with no `bin/`, so no compiler.

Why the image needs one at all: CUDA_HOME is unset in the image, and the libraries that look for
a CUDA home without it resolve /usr/local/cuda (torch, FlashInfer, SGLang's JIT, sgl-kernel,
DeepGEMM). DeepGEMM's import asserts that the directory exists (sgl-deep-gemm 0.2.3.post2
`find_cuda_home`, called at import), and SGLang's Kimi-K3 model module imports DeepGEMM
(models.kimi_k3 -> models.deepseek_v2 -> dsa_indexer). With no CUDA home the model class is not
found and no server starts. An H100 replay with the host's toolkit moved away found this.

Why links and not the wheels' root itself: that root holds `bin/nvcc` (torch's CUDA wheels bring
it), and a reachable nvcc changes every SGLang JIT key (its environment fingerprint holds
`nvcc --version`) and lets SGLang and DeepGEMM start compiles the image cannot finish (no host
compiler). SGLang keys its JIT modules on this directory too (its `toolkit` anchor exists only
where the directory does), so the image's layer, the launch-profile check's root and the SGLang
JIT build (tools/jit_cache/sglang_aot.py) all take it from here (a ground helper: both stages
use it).
"""
from __future__ import annotations

import os
from pathlib import Path

CUDA_HOME = "usr/local/cuda"  # image path, relative to /
# Link name -> what it points at, under the image's site-packages.
TARGETS = {"include": "nvidia/cu13/include", "lib64": "nvidia/cu13/lib"}


def links(site_packages: str) -> dict[str, str]:
    """Link name -> target relative to CUDA_HOME (the same text wherever the root is mounted),
    for the image's site-packages (an image path)."""
    site = site_packages.strip("/")
    return {name: os.path.relpath(f"{site}/{target}", CUDA_HOME) for name, target in sorted(TARGETS.items())}


def make(root: Path, site_packages: str) -> Path:
    """The CUDA home under `root` (an image root being assembled); returns its path."""
    home = root / CUDA_HOME
    home.mkdir(parents=True, exist_ok=True)
    for name, target in links(site_packages).items():
        link = home / name
        if not os.path.lexists(link):
            link.symlink_to(target)
    return home
