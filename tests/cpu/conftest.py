"""Shared pytest setup for the CPU suite.

Under Bazel each test file is a py_test; Bazel sets XML_OUTPUT_FILE, and writing pytest's JUnit
report there lets .ci/run count test cases (not just targets) from bazel-testlogs.
"""
from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).absolute().parents[2]
PINS_LOCK = REPO_ROOT / "third_party" / "pins.lock.json"


def pytest_configure(config: pytest.Config) -> None:
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml and not getattr(config.option, "xmlpath", None):
        config.option.xmlpath = xml


def env_path(var: str) -> Path:
    """A path Bazel passes in an environment variable (a target's `env`, e.g. `$(rootpath ...)`);
    unset fails the test, naming the variable: such tests run only through Bazel."""
    value = os.environ.get(var)
    if not value:
        pytest.fail(f"{var} is unset: run this test through Bazel (tools/bazel test <target>), which sets it")
    return Path(value)


def artifact(var: str) -> Path:
    """A real upstream artifact named by an environment variable (Bazel sets it from a pin, see
    tests/defs.bzl `artifacts`); unset or missing fails the test loudly, never skips it."""
    value = os.environ.get(var)
    if not value:
        pytest.fail(f"{var} is unset: Bazel sets it from the pinned artifact; for a local run export it to the file")
    path = Path(value)
    if not path.is_file():
        pytest.fail(f"{var}={value} is not a file: point it at the pinned artifact")
    return path


def pinned_toolchain_paths() -> tuple[str, str]:
    """(CUDA root, compiler userland) of the kernel cache's pinned toolchain, located by the
    identity files a test gets as data (tests/cpu/kernel_cache/BUILD.bazel TOOLCHAIN_ENV)."""
    return (str(env_path("KIMI_KC_CUDA_IDENTITY").absolute().parent),
            str(env_path("KIMI_KC_USERLAND_IDENTITY").absolute().parent))


@lru_cache(maxsize=1)
def pins_lock() -> dict[str, Any]:
    """third_party/pins.lock.json as data (every CPU test has it: //tests/cpu:conftest's data)."""
    return json.loads(PINS_LOCK.read_text())


def stack_pin(stack: str, role: str) -> str:
    """The pin name of a stack's role (sglang, flashinfer, torch, ...) in the lock."""
    return pins_lock()["stacks"][stack][role]


def stack_version(stack: str, role: str) -> str:
    """The upstream version of a stack's role: stacks -> pins -> package.version in the lock, so
    tests follow a version bump instead of naming versions."""
    return pins_lock()["pins"][stack_pin(stack, role)]["package"]["version"]
