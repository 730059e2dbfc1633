"""The CI counter (.ci/count_results.py): times from Bazel's summary, limits from the BUILD
attributes, and the check that fails a test running near its limit (so a suite that passes on an
idle machine cannot time out beside a build unnoticed)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.cpu.conftest import env_path


def counter(name: str = "count_results", env: str = "KIMI_CI_COUNT_RESULTS"):
    spec = importlib.util.spec_from_file_location(name, env_path(env))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SUMMARY = """\
INFO: Build completed successfully, 12 total actions
//tests/cpu/image:test_profiles                                          PASSED in 13.8s
//tests/cpu/kernel_cache:test_selection                         (cached) PASSED in 612.0s
//tests/cpu/pins:test_lock                                               FAILED in 2s
//tests/cpu/pins:test_slow                                              TIMEOUT in 60.1s

Executed 3 out of 4 tests: 2 tests pass and 2 fail locally.
"""

QUERY = """<?xml version="1.1" encoding="UTF-8" standalone="no"?>
<query version="2">
  <rule class="py_test" location="/w/tests/cpu/image/BUILD.bazel:1:9" name="//tests/cpu/image:test_profiles">
    <string name="name" value="test_profiles"/><string name="size" value="small"/>
  </rule>
  <rule class="py_test" location="/w/BUILD.bazel:2:9" name="//tests/cpu/kernel_cache:test_selection">
    <string name="size" value="enormous"/>
  </rule>
  <rule class="py_test" location="/w/BUILD.bazel:3:9" name="//tests/cpu/pins:test_lock">
    <string name="size" value="small"/><string name="timeout" value="long"/>
  </rule>
  <rule class="py_test" location="/w/BUILD.bazel:4:9" name="//tests/cpu/pins:test_slow"/>
</query>
"""


def test_times_come_from_the_summary_cached_ones_included(tmp_path: Path) -> None:
    log = tmp_path / "bazel.log"
    log.write_text(SUMMARY)
    assert counter().durations(log) == {
        "//tests/cpu/image:test_profiles": 13.8, "//tests/cpu/kernel_cache:test_selection": 612.0,
        "//tests/cpu/pins:test_lock": 2.0, "//tests/cpu/pins:test_slow": 60.1}


def test_limits_follow_size_and_an_explicit_timeout() -> None:
    assert counter().limits_of_query_xml(QUERY) == {
        "//tests/cpu/image:test_profiles": (60, "size small"),
        "//tests/cpu/kernel_cache:test_selection": (3600, "size enormous"),
        "//tests/cpu/pins:test_lock": (900, "timeout long"),
        "//tests/cpu/pins:test_slow": (300, "size medium"),  # Bazel's default size
    }


def test_a_test_over_half_its_limit_fails_naming_the_fix() -> None:
    c = counter()
    limits = c.limits_of_query_xml(QUERY)
    targets = sorted(limits)
    times = {"//tests/cpu/image:test_profiles": 30.5, "//tests/cpu/kernel_cache:test_selection": 612.0,
             "//tests/cpu/pins:test_lock": 2.0}
    problems = c.slow_tests(targets, times, limits)
    assert problems == [
        "//tests/cpu/image:test_profiles: took 30.5 s, over 50% of its 60 s limit (size small); "
        "give it the next size up in its BUILD file, or make it cheaper",
        "//tests/cpu/pins:test_slow: no time in Bazel's test summary",
    ]
    assert c.slow_tests(targets[:1], {targets[0]: 30.0}, limits) == []  # exactly half is within


def test_only_pytest_reports_count_for_pytest_targets() -> None:
    import xml.etree.ElementTree as ET
    c = counter()
    pytest_report = ET.fromstring('<testsuites name="pytest tests"><testsuite name="pytest" tests="3"/></testsuites>')
    # What Bazel writes for a test that wrote no report: one suite named after the target, one case.
    bazel_report = ET.fromstring('<testsuites><testsuite name="tests/cpu/pins/test_x" tests="1" failures="0">'
                                 '<testcase name="tests/cpu/pins/test_x" status="run"/></testsuite></testsuites>')
    assert c.written_by_pytest(pytest_report.findall("testsuite"))
    assert not c.written_by_pytest(bazel_report.findall("testsuite"))
    assert not c.written_by_pytest([])

# The summary line of a cold test command, as Bazel prints it.
PROCESSES = "INFO: 368 processes: 253 internal, 88 linux-sandbox, 27 local.\n"


def test_processes_by_strategy_come_from_the_last_count(tmp_path: Path) -> None:
    log = tmp_path / "bazel.log"
    log.write_text("INFO: 4 processes: 1 internal, 3 processwrapper-sandbox.\n" + SUMMARY + PROCESSES)
    assert counter().processes_by_strategy(log) == {"internal": 253, "linux-sandbox": 88, "local": 27}
    log.write_text("INFO: 1 process: 1 internal.\n")
    assert counter().processes_by_strategy(log) == {"internal": 1}


def test_processwrapper_actions_fail_ci(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c = counter()
    log = tmp_path / "bazel.log"
    log.write_text("INFO: 9 processes: 4 internal, 2 linux-sandbox, 3 processwrapper-sandbox.\n")
    exemptions = tmp_path / "exemptions.json"
    exemptions.write_text(json.dumps({"exemptions": []}))

    class NoActions:
        returncode, stdout, stderr = 0, "{}", ""

    monkeypatch.setattr(c.subprocess, "run", lambda *a, **k: NoActions())
    problems = c.sandbox_problems(log, ["//tests/cpu/..."], exemptions)
    assert len(problems) == 1 and "3 actions ran in processwrapper-sandbox" in problems[0], problems
    log.write_text(PROCESSES)
    assert c.sandbox_problems(log, ["//tests/cpu/..."], exemptions) == []


AQUERY = {
    "targets": [{"id": 1, "label": "//image:layer_torch"}, {"id": 2, "label": "//tests/cpu/x:test_y"},
                {"id": 3, "label": "//pkg:sandboxed"}],
    "actions": [
        {"targetId": 1, "mnemonic": "OciLayer", "executionInfo": [{"key": "no-sandbox"}, {"key": "no-remote"}]},
        {"targetId": 2, "mnemonic": "TestRunner", "executionInfo": [{"key": "local"}]},
        {"targetId": 3, "mnemonic": "Genrule", "executionInfo": [{"key": "no-remote"}]},
        {"targetId": 3, "mnemonic": "Genrule"},
    ],
}


def test_an_unlisted_exemption_fails_naming_the_action() -> None:
    c = counter()
    actions = c.exempt_actions(AQUERY)
    assert sorted(actions) == [("OciLayer", "//image:layer_torch", ["no-sandbox"]),
                               ("TestRunner", "//tests/cpu/x:test_y", ["local"])]
    listed = [{"mnemonic": "OciLayer", "label": "//image:*", "why": "reads trees by lstat"}]
    problems = c.unlisted_exemptions(actions, listed)
    assert len(problems) == 1 and problems[0].startswith("//tests/cpu/x:test_y: action TestRunner runs unsandboxed (local)")
    listed.append({"mnemonic": "TestRunner", "label": "//tests/cpu/x:test_y", "why": "needs root"})
    assert c.unlisted_exemptions(actions, listed) == []


def test_an_exemption_without_a_reason_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "exemptions.json"
    f.write_text(json.dumps({"exemptions": [{"mnemonic": "OciLayer", "label": "//image:*", "why": ""}]}))
    with pytest.raises(ValueError, match="exemption 0 needs exactly a non-empty mnemonic, label and why"):
        counter().load_exemptions(f)


def test_the_checked_in_exemptions_each_say_why() -> None:
    listed = counter().load_exemptions(env_path("KIMI_CI_SANDBOX_EXEMPTIONS"))
    assert listed and all(len(e["why"]) > 20 for e in listed)


@pytest.mark.parametrize("line, counts", [
    ("INFO: 3 processes: 1 internal, 2 remote.", {"internal": 1, "remote": 2}),
    ("INFO: 5 processes: 4 remote cache hit, 1 internal.", {"remote cache hit": 4, "internal": 1}),
    ("INFO: 1 process: 1 internal.", {"internal": 1}),
    ("", {}),
])
def test_remote_smoke_reads_bazels_process_counts(line: str, counts: dict) -> None:
    smoke = counter("remote_smoke", "KIMI_CI_REMOTE_SMOKE")
    assert smoke.process_counts(f"INFO: Analyzed target //a:b\n{line}\nINFO: Build completed\n") == counts


if __name__ == "__main__":
    import sys

    import pytest
    sys.exit(pytest.main([__file__, "-v"]))
