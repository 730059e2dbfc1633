"""`//tests/cpu/kernel_cache:spec_check` (in the CPU suite): tools/kernel_cache/defs.bzl writes
each compile/link action's spec in Starlark at analysis time; every one must be exactly what
tools/kernel_cache/actions.py object_spec/link_spec derive from the selected checked-in plan (one
format, two writers). Needs only the plan and the spec files: no tree, no nvcc, no compiling.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.cpu.conftest import env_path
from tools.kernel_cache.actions import link_spec, object_spec
from tools.kernel_cache.plan import parse_only, read_plan, select_modules


def test_bazel_spec_files_equal_the_tools_specs() -> None:
    plan = read_plan(env_path("KIMI_KC_PLAN"))
    files = [Path(p) for p in os.environ.get("KIMI_KC_SPECS", "").split()]
    assert files, "KIMI_KC_SPECS is empty: run this through Bazel"
    seen = set()
    for f in files:
        module = f.parent.name.removesuffix("_specs")
        want = (link_spec(plan, module) if f.name == "link.json"
                else object_spec(plan, module, f.name.removesuffix(".json")))
        assert json.loads(f.read_text()) == want, f
        seen.add((module, f.name))
    # One spec per object and one link spec per module of the plan (of the
    # --//kernel_cache:only subset when one is set): none left unchecked.
    only = parse_only([env_path("KIMI_KC_ONLY_FILE").read_text()])
    modules = select_modules(plan, only)["modules"]
    expected = {(m["name"], f"{o['out']}.json") for m in modules for o in m["objects"]}
    expected |= {(m["name"], "link.json") for m in modules}
    assert seen == expected, sorted(expected ^ seen)[:5]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
