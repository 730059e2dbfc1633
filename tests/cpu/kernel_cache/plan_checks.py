"""Checks and helpers shared by test_kernel_cache.py and test_selection.py."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tests.cpu.conftest import env_path

from tools.kernel_cache.plan import describe_drift, make_plan, read_plan
from tools.kernel_cache.tree import REPO_ROOT


def assert_plan_matches_flashinfer(tree: Path, plan_name: str, tc: Any) -> None:
    """The checked-in plan's commands are what FlashInfer's generators emit. #4460 changes file
    contents, not commands, so the wheel (markers not enforced) gives the same plan apart from
    the source digest; the digest itself is checked against the patch gate's tree by
    `python3 -m tools.kernel_cache plan --check`, `build --plan` and gen-sources. A kernel selection copies
    sources #4460 changes (the binding), so there the generated-sources digest is left out too."""
    checked_in = read_plan(REPO_ROOT / "kernel_cache" / plan_name)
    fresh = make_plan(tree, REPO_ROOT / "kernel_cache" / "modules.json",
                      checked_in["arch"], checked_in["variant"], tc,
                      enforce_markers=False, selection=checked_in.get("selection", "full"))
    for plan in (checked_in, fresh):
        plan["patched_source_digest"] = plan["source_markers"] = None
        for m in plan["modules"]:
            if "kernel_selection" in m:
                m["gen_digest"] = None
    assert describe_drift(checked_in, fresh) is None


def stage_output(var: str, suffix: str) -> Path:
    """The one file (or directory) whose name ends with `suffix` among the outputs of a
    kernel_cache_config_files target that Bazel passes in `var` (tests/cpu/kernel_cache/
    BUILD.bazel: $(rootpaths ...), space-separated), e.g. "_aot", ".cuda.o", ".bzl"."""
    paths = [Path(p) for p in str(env_path(var)).split()]
    found = [p for p in paths if p.name.endswith(suffix)]
    assert len(found) == 1 and found[0].exists(), (var, suffix, [p.name for p in paths])
    return Path(os.path.abspath(found[0]))
