"""GPU suite policy and set-up.

- No GPU is a failure, not a pass: a GPU test that finds no CUDA device fails loudly, unless
  KIMI_K3_ALLOW_NO_GPU=1 says explicitly that this run may skip (e.g. a dry run on a laptop).
  The same holds for the imports the suite lives on: test modules import torch (and FlashInfer)
  through `import_or_fail`, so a host whose torch is missing or broken is a collection error,
  never a skipped module (KIMI_K3_ALLOW_NO_GPU=1 turns it into a skip).
- Each test declares the architectures it needs with `@pytest.mark.arch("sm90", "sm120")`; on
  another GPU it is skipped with a reason naming the found and the needed architecture.
- The device each test ran on is printed and recorded in the JUnit report.
- What is under test is the stack's output, not whatever is installed: KIMI_GPU_WHEELS (paths
  separated by os.pathsep: wheels or directories of wheels, e.g. the patched FlashInfer wheel and
  Mooncake) and KIMI_GPU_KERNEL_CACHE (the prebuilt cache for this GPU's arch) are laid out into
  one site directory put first on sys.path (tools/gpu_suite/site.py).
- FLASHINFER_DISABLE_JIT=1 unless KIMI_K3_GPU_ALLOW_JIT=1: the first call must compile nothing.
  A test names the cached module it needs with `require_cached_module`; which modules the cache
  must have comes from kernel_cache/modules.json (KIMI_GPU_KERNEL_MODULES under Bazel): every
  module declared for the cache's arch_list (its kernel_cache.json), restricted to the subset a
  `--//kernel_cache:only` build was made with (KIMI_GPU_KERNEL_CACHE_ONLY, comma separated, or
  KIMI_GPU_KERNEL_CACHE_ONLY_FILE). A declared module the cache lacks fails the test; only a
  module outside that set (declared for other archs, or left out by `only`) is skipped, with the
  reason (tools/gpu_suite/site.py module_verdict). A CUTLASS MoE test also names the runner it
  constructs (`require_cached_runner`): outside the cache's kernel selection it is skipped naming
  the selection (site.py runner_verdict).
- Under Bazel, pytest's JUnit XML goes to XML_OUTPUT_FILE (as in the CPU suite).
- Nothing runs this suite in CI (.ci/run runs the CPU suite only): run it on a GPU host with
  `tools/bazel test //tests/gpu/... --config=gpu` or tools/gpu_suite/run.py.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

if os.environ.get("KIMI_K3_GPU_ALLOW_JIT") != "1":
    os.environ["FLASHINFER_DISABLE_JIT"] = "1"

ROOT = Path(__file__).absolute().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from tools.gpu_suite import site as gpu_site  # noqa: E402

CACHED_MODULES: list[str] = []


def import_or_fail(name: str) -> ModuleType:
    """Import a module the GPU tests need (torch, flashinfer). Failing to import it is a broken
    GPU host: the error propagates (a collection error), unless KIMI_K3_ALLOW_NO_GPU=1, which
    skips the whole module with the reason."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        if os.environ.get("KIMI_K3_ALLOW_NO_GPU") == "1":
            pytest.skip(f"cannot import {name} ({e}), and KIMI_K3_ALLOW_NO_GPU=1 allows skipping",
                        allow_module_level=True)
        raise


def _prepare_site() -> None:
    # os.pathsep-separated (tools/gpu_suite/run.py) or space-separated (Bazel's $(rootpaths)).
    raw = os.environ.get("KIMI_GPU_WHEELS", "").replace(os.pathsep, " ")
    wheels = [Path(p).absolute() for p in raw.split() if p]
    cache = os.environ.get("KIMI_GPU_KERNEL_CACHE")
    if not wheels and not cache:
        return
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


def _cache_only() -> list[str]:
    only = os.environ.get("KIMI_GPU_KERNEL_CACHE_ONLY", "")
    only_file = os.environ.get("KIMI_GPU_KERNEL_CACHE_ONLY_FILE")
    if only_file:
        only += "," + Path(only_file).read_text()
    return gpu_site.parse_only(only)


def require_cached_module(name: str) -> None:
    """Run, skip or fail a test that needs FlashInfer module `name` from the prebuilt cache, as
    gpu_site.module_verdict decides (see the policy above). With JIT allowed, always run."""
    if os.environ.get("FLASHINFER_DISABLE_JIT") != "1":
        return
    modules_json = Path(os.environ.get("KIMI_GPU_KERNEL_MODULES") or gpu_site.MODULES_JSON)
    if not modules_json.is_file():
        pytest.fail(f"{modules_json}: missing; it says which modules the kernel cache must have "
                    "(set KIMI_GPU_KERNEL_MODULES to kernel_cache/modules.json)")
    verdict, why = gpu_site.module_verdict(name, installed_cache_meta(), modules_json,
                                           _cache_only())
    if verdict == "skip":
        pytest.skip(why)
    if verdict == "fail":
        pytest.fail(why)


def require_cached_runner(module: str, runner: str) -> None:
    """require_cached_module(module), then skip where the cache's kernel selection leaves the
    CUTLASS MoE `runner` out (gpu_site.runner_verdict): calling it would raise
    RuntimeError by design."""
    require_cached_module(module)
    if os.environ.get("FLASHINFER_DISABLE_JIT") != "1":
        return
    verdict, why = gpu_site.runner_verdict(module, runner, installed_cache_meta())
    if verdict == "skip":
        pytest.skip(why)


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


def installed_cache_meta() -> dict[str, Any] | None:
    """kernel_cache.json of the cache installed in the flashinfer package under test (None when
    there is none)."""
    flashinfer = import_or_fail("flashinfer")
    meta = Path(flashinfer.__file__).parent / "data" / "aot" / "kernel_cache.json"
    return json.loads(meta.read_text()) if meta.is_file() else None


def kernel_cache_meta() -> dict:
    """kernel_cache.json of the cache installed in the flashinfer package under test."""
    meta = installed_cache_meta()
    if meta is None:
        pytest.fail("no kernel cache installed: flashinfer/data/aot/kernel_cache.json is missing "
                    "(set KIMI_GPU_KERNEL_CACHE)")
    return meta
