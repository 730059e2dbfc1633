"""The GPU recipe's docs (docs/GPU_RUN.md, README.md's "GPU tests") name only what exists and
hold commands a newcomer can paste: every `python3 -m tools....` is a module of this checkout,
every `tools/....py` a file, and the command blocks of docs/GPU_RUN.md have no `<placeholder>`.
"""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).absolute().parents[3]
GPU_RUN = ROOT / "docs" / "GPU_RUN.md"
README = ROOT / "README.md"
# A module named after `-m`; a trailing `.<module>` or `.X|Y` is a pattern, not a module.
_MODULE = re.compile(r"python3? -m (tools(?:\.\w+)*)(?![\w.]*[<|])")
_FILE = re.compile(r"\b(tools/[\w/]+\.py)\b")
_FENCE = re.compile(r"^```(?:sh|bash)?\n(.*?)^```", re.M | re.S)
_PLACEHOLDER = re.compile(r"<[A-Za-z][\w .-]*>")


def _gpu_texts() -> dict[str, str]:
    readme = README.read_text()
    start = readme.index("\n## GPU tests")
    end = readme.find("\n## ", start + 1)
    return {"docs/GPU_RUN.md": GPU_RUN.read_text(),
            "README.md 'GPU tests'": readme[start:end if end > 0 else None]}


def test_the_gpu_docs_name_only_modules_and_files_that_exist() -> None:
    for where, text in _gpu_texts().items():
        for module in sorted(set(_MODULE.findall(text))):
            assert importlib.util.find_spec(module) is not None, f"{where}: no module {module}"
        for rel in sorted(set(_FILE.findall(text))):
            assert (ROOT / rel).is_file(), f"{where}: no file {rel}"


def test_the_gpu_run_commands_have_no_placeholders() -> None:
    blocks = _FENCE.findall(GPU_RUN.read_text())
    assert blocks, "docs/GPU_RUN.md has no command block"
    for block in blocks:
        assert not _PLACEHOLDER.findall(block), (block, _PLACEHOLDER.findall(block))


def test_the_gpu_run_is_the_bundle_and_its_run_sh() -> None:
    text = GPU_RUN.read_text()
    assert "tools/bazel run --config=pypi //tools/gpu_suite:bundle -- --out" in text
    assert re.search(r"^sh \S+/run\.sh$", text, re.M), "docs/GPU_RUN.md: no `sh DIR/run.sh` line"
    assert "docs/GPU_RUN.md" in _gpu_texts()["README.md 'GPU tests'"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
