"""pytest setup for image/ tests: the CPU suite's JUnit hook (XML_OUTPUT_FILE for .ci/run)."""
from tests.cpu.conftest import pytest_configure  # noqa: F401
