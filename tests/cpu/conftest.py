"""Shared pytest setup for the CPU suite.

Under Bazel each test file is a py_test; Bazel sets XML_OUTPUT_FILE, and writing pytest's JUnit
report there lets .ci/run count test cases (not just targets) from bazel-testlogs.
"""
from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml and not getattr(config.option, "xmlpath", None):
        config.option.xmlpath = xml
