"""GPU suite policy and set-up.

- No GPU is a failure, not a pass: a GPU test that finds no CUDA device fails loudly, unless
  KIMI_K3_ALLOW_NO_GPU=1 says explicitly that this run may skip (e.g. a dry run on a laptop).
- Each test declares the architectures it needs with `@pytest.mark.arch("sm90", "sm120")`; on
  another GPU it is skipped with a reason naming the found and the needed architecture.
- The device each test ran on is printed and recorded in the JUnit report.
- What is under test is the stack's output, not whatever is installed: KIMI_GPU_WHEELS (paths
  separated by os.pathsep: wheels or directories of wheels, e.g. the patched FlashInfer wheel and
  Mooncake) and KIMI_GPU_KERNEL_CACHE (the prebuilt cache for this GPU's arch) are laid out into
  one site directory put first on sys.path (tools/gpu_site.py).
- FLASHINFER_DISABLE_JIT=1 unless KIMI_K3_GPU_ALLOW_JIT=1: the first call must compile nothing;
  a module missing from the cache is a named error or a skip naming the module.
- Under Bazel, pytest's JUnit XML goes to XML_OUTPUT_FILE (as in the CPU suite).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

if os.environ.get("KIMI_K3_GPU_ALLOW_JIT") != "1":
    os.environ["FLASHINFER_DISABLE_JIT"] = "1"

CACHED_MODULES: list[str] = []


def _prepare_site() -> None:
    # os.pathsep-separated (tools/run_gpu_suite.py) or space-separated (Bazel's $(rootpaths)).
    raw = os.environ.get("KIMI_GPU_WHEELS", "").replace(os.pathsep, " ")
    wheels = [Path(p).absolute() for p in raw.split() if p]
    cache = os.environ.get("KIMI_GPU_KERNEL_CACHE")
    if not wheels and not cache:
        return
    root = Path(__file__).absolute().parents[2]
    sys.path.insert(0, str(root))
    from tools import gpu_site

    site = Path(tempfile.mkdtemp(prefix="kimi-gpu-site-", dir=os.environ.get("TEST_TMPDIR")))
    CACHED_MODULES.extend(gpu_site.prepare(site, wheels, Path(cache).absolute() if cache else None))
    sys.path.insert(0, str(site))
    print(f"gpu site: {site} (kernel cache modules: {', '.join(CACHED_MODULES) or 'none'})")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "arch(*names): GPU architectures the test needs, e.g. sm90, sm120")
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml and not getattr(config.option, "xmlpath", None):
        config.option.xmlpath = xml
    _prepare_site()


def require_cached_module(name: str) -> None:
    """Skip, naming the module and how to build it, when the prebuilt cache lacks it."""
    if os.environ.get("FLASHINFER_DISABLE_JIT") != "1":
        return
    if name not in CACHED_MODULES:
        pytest.skip(f"FlashInfer module {name} is not in the prebuilt kernel cache "
                    f"(has: {', '.join(CACHED_MODULES) or 'none'}); build it with "
                    f"`tools/bazel build //kernel_cache:cache --//kernel_cache:arch=<this GPU>`")


def _device() -> tuple[str, str] | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    return torch.cuda.get_device_name(0), f"sm{major}{minor}"


@pytest.fixture(autouse=True)
def _gpu_policy(request: pytest.FixtureRequest, record_property) -> None:
    dev = _device()
    if dev is None:
        if os.environ.get("KIMI_K3_ALLOW_NO_GPU") == "1":
            pytest.skip("no CUDA GPU, and KIMI_K3_ALLOW_NO_GPU=1 allows skipping")
        pytest.fail("no CUDA GPU visible: GPU tests fail without one (set KIMI_K3_ALLOW_NO_GPU=1 to skip explicitly)")
    name, arch = dev
    record_property("device", f"{name} ({arch})")
    print(f"device: {name} ({arch})")
    marker = request.node.get_closest_marker("arch")
    if marker and arch not in marker.args:
        pytest.skip(f"needs {'/'.join(marker.args)}; this GPU is {name} ({arch})")


def kernel_cache_meta() -> dict:
    """kernel_cache.json of the cache installed in the flashinfer package under test."""
    import flashinfer

    meta = Path(flashinfer.__file__).parent / "data" / "aot" / "kernel_cache.json"
    if not meta.is_file():
        pytest.fail(f"no kernel cache installed: {meta} is missing (set KIMI_GPU_KERNEL_CACHE)")
    return json.loads(meta.read_text())
