"""Real upstream artifacts the CPU tests read, fetched and verified through the lock (never
GitHub-only inputs): `artifacts = FLASHINFER_WHEEL | ...` in a cpu_test sets each variable to
the pinned file's runfiles path (tests/cpu/conftest.py artifact()). The pins are the stacks'
roles in the lock (ROLE_PINS), so a version bump needs no edit here."""

load("//tools/pins:defs.bzl", "ROLE_PINS")

def _pin(stack, role):
    return "@pins//:" + ROLE_PINS[stack][role]

FLASHINFER_WHEEL = {"KIMI_TEST_FLASHINFER_WHEEL": _pin("default", "flashinfer")}

FLASHINFER_PYPI_WHEEL = {"KIMI_TEST_FLASHINFER_PYPI_WHEEL": _pin("pypi", "flashinfer")}

SGLANG_WHEEL = {"KIMI_TEST_SGLANG_WHEEL": _pin("default", "sglang")}

SGLANG_PYPI_WHEEL = {"KIMI_TEST_SGLANG_PYPI_WHEEL": _pin("pypi", "sglang")}
