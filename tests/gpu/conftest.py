"""GPU suite policy.

- No GPU is a failure, not a pass: a GPU test that finds no CUDA device fails loudly, unless
  KIMI_K3_ALLOW_NO_GPU=1 says explicitly that this run may skip (e.g. a dry run on a laptop).
- Each test declares the architectures it needs with `@pytest.mark.arch("sm90", "sm120")`; on
  another GPU it is skipped with a reason naming the found and the needed architecture.
- The device each test ran on is printed and written into the JUnit report.
- Under Bazel, pytest's JUnit XML goes to XML_OUTPUT_FILE (as in the CPU suite).
"""
from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "arch(*names): GPU architectures the test needs, e.g. sm90, sm120")
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml and not getattr(config.option, "xmlpath", None):
        config.option.xmlpath = xml


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
