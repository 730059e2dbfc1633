"""Real upstream artifacts the CPU tests read, fetched and verified through the lock (never
GitHub-only inputs): `artifacts = FLASHINFER_WHEEL | ...` in a cpu_test sets each variable to
the pinned file's runfiles path (tests/cpu/conftest.py artifact())."""

FLASHINFER_WHEEL = {"KIMI_TEST_FLASHINFER_WHEEL": "@pins//:flashinfer-python-0.6.18"}

FLASHINFER_PYPI_WHEEL = {"KIMI_TEST_FLASHINFER_PYPI_WHEEL": "@pins//:flashinfer-python-0.7.2"}

SGLANG_WHEEL = {"KIMI_TEST_SGLANG_WHEEL": "@pins//:sglang-0.5.21"}

SGLANG_PYPI_WHEEL = {"KIMI_TEST_SGLANG_PYPI_WHEEL": "@pins//:sglang-0.5.23"}
