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
JIT build (tools/jit_cache/sglang_aot.py) all take it from here.
"""
from __future__ import annotations

import os
from pathlib import Path

from tools.image.layer_contents import Entry, LayerContents
from tools.image.wheel_install import SITE_PACKAGES

CUDA_HOME = "usr/local/cuda"  # image path, relative to /
# Link name -> target, relative to CUDA_HOME (the same text wherever the root is mounted).
LINKS = {
    name: os.path.relpath(f"{SITE_PACKAGES}/nvidia/cu13/{target}", CUDA_HOME)
    for name, target in (("include", "include"), ("lib64", "lib"))
}


def add_to_layer(contents: LayerContents) -> None:
    """The CUDA home's entries in a layer (the layer that installs the CUDA wheels)."""
    contents.add(Entry(CUDA_HOME, "dir", 0o755), "--cuda-home")
    for name, target in sorted(LINKS.items()):
        contents.add(Entry(f"{CUDA_HOME}/{name}", "symlink", 0o777, linkname=target), "--cuda-home")


def make(root: Path) -> Path:
    """The CUDA home under `root` (an image root being assembled); returns its path."""
    home = root / CUDA_HOME
    home.mkdir(parents=True, exist_ok=True)
    for name, target in sorted(LINKS.items()):
        link = home / name
        if not os.path.lexists(link):
            link.symlink_to(target)
    return home
