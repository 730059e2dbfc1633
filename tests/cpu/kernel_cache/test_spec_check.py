"""`//kernel_cache:spec_check` (in CI through //tests/cpu/kernel_cache:kernel_cache_bazel): defs.bzl writes each
compile/link action's spec in Starlark at analysis time; every one must be exactly what
tools/kernel_cache object_spec/link_spec derive from the selected checked-in plan (one
format, two writers). Needs only the plan and the spec files: no tree, no nvcc, no compiling.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tools import kernel_cache as kc


def _env_path(var: str) -> Path:
    value = os.environ.get(var)
    if not value:
        pytest.fail(f"{var} is unset: run this through Bazel (bazel test //kernel_cache:spec_check)")
    return Path(value)


def test_bazel_spec_files_equal_the_tools_specs() -> None:
    plan = kc.read_plan(_env_path("KIMI_KC_PLAN"))
    files = [Path(p) for p in os.environ.get("KIMI_KC_SPECS", "").split()]
    assert files, "KIMI_KC_SPECS is empty: run this through Bazel"
    seen = set()
    for f in files:
        module = f.parent.name.removesuffix("_specs")
        want = (kc.link_spec(plan, module) if f.name == "link.json"
                else kc.object_spec(plan, module, f.name.removesuffix(".json")))
        assert json.loads(f.read_text()) == want, f
        seen.add((module, f.name))
    # One spec per object and one link spec per module of the plan (of the
    # --//kernel_cache:only subset when one is set): none left unchecked.
    only = kc.parse_only([_env_path("KIMI_KC_ONLY_FILE").read_text()])
    modules = kc.select_modules(plan, only)["modules"]
    expected = {(m["name"], f"{o['out']}.json") for m in modules for o in m["objects"]}
    expected |= {(m["name"], "link.json") for m in modules}
    assert seen == expected, sorted(expected ^ seen)[:5]


if __name__ == "__main__":
    xml = os.environ.get("XML_OUTPUT_FILE")
    sys.exit(pytest.main([__file__, "-v"] + ([f"--junitxml={xml}"] if xml else [])))
