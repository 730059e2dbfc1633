"""Count test cases from bazel-testlogs for .ci/run and print `N passed, N failed` last.

Each test target of the patterns (the README's test command) writes pytest's JUnit XML to test.xml, e.g.
//tests/cpu/kernel_cache:spec_check -> bazel-testlogs/tests/cpu/kernel_cache/spec_check/test.xml
(a test_suite under tests/cpu may expand to a test in another package, such as
//sglang_patches:check -> bazel-testlogs/sglang_patches/check/test.xml). A target without a report (build failure, crash
before pytest started) counts as one failure, so nothing is lost.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

# Bazel's timeout of each test size (seconds), unless the target sets `timeout`.
SIZE_TIMEOUT = {"small": 60, "medium": 300, "large": 900, "enormous": 3600}
TIMEOUT_SECONDS = {"short": 60, "moderate": 300, "long": 900, "eternal": 3600}
# A test may use at most this share of its limit: the rest is room for a machine twice as
# loaded (a build beside the tests, a slower CI runner) before the limit kills it.
LIMIT_SHARE = 0.5
# `//pkg:name   PASSED in 12.3s` (or `(cached) PASSED`, FAILED, TIMEOUT ...) in Bazel's summary.
SUMMARY_LINE = re.compile(r"^(//\S+)\s+(?:\(cached\)\s+)?[A-Z ]+? in (\d+(?:\.\d+)?)s$")


def test_limits(targets: list[str]) -> dict[str, tuple[int, str]]:
    """target -> (its timeout in seconds, 'size S' or 'timeout T'), from the BUILD attributes."""
    if not targets:
        return {}
    q = subprocess.run(["tools/bazel", "query", "--output=xml", "set(%s)" % " ".join(targets)],
                       capture_output=True, text=True)
    return limits_of_query_xml(q.stdout)


def limits_of_query_xml(text: str) -> dict[str, tuple[int, str]]:
    limits = {}
    for rule in ET.fromstring(text or "<query/>").iter("rule"):
        attrs = {a.get("name"): a.get("value") for a in rule if a.get("name") in ("size", "timeout")}
        size = attrs.get("size") or "medium"
        if attrs.get("timeout") in TIMEOUT_SECONDS:
            limits[rule.get("name")] = (TIMEOUT_SECONDS[attrs["timeout"]], f"timeout {attrs['timeout']}")
        else:
            limits[rule.get("name")] = (SIZE_TIMEOUT.get(size, 300), f"size {size}")
    return limits


def log_lines(log: Path) -> list[str]:
    """The lines of Bazel's output, none when the log cannot be read."""
    try:
        return log.read_text(errors="replace").splitlines()
    except OSError:
        return []


def durations(log: Path) -> dict[str, float]:
    """target -> seconds, from the test summary of Bazel's output (cached results keep their time)."""
    found = {}
    for line in log_lines(log):
        m = SUMMARY_LINE.match(line.strip())
        if m:
            found[m.group(1)] = float(m.group(2))
    return found


def slow_tests(targets: list[str], times: dict[str, float], limits: dict[str, tuple[int, str]]) -> list[str]:
    """One line per target without a time, or over LIMIT_SHARE of its limit."""
    problems = []
    for t in targets:
        if t not in times:
            problems.append(f"{t}: no time in Bazel's test summary")
        elif t not in limits:
            problems.append(f"{t}: no size or timeout found by bazel query")
        elif times[t] > LIMIT_SHARE * limits[t][0]:
            seconds, what = limits[t]
            problems.append(f"{t}: took {times[t]:.1f} s, over {LIMIT_SHARE:.0%} of its {seconds} s limit ({what}); "
                            "give it the next size up in its BUILD file, or make it cheaper")
    return problems


# `INFO: 327 processes: 221 internal, 26 local, 80 linux-sandbox.` (Bazel's count of the command's
# spawns by the strategy that ran or answered each one; "disk cache hit" and "remote cache hit" too).
PROCESSES_LINE = re.compile(r"^INFO: (\d+) process(?:es)?(?:: (.*?))?\.$")
# Strategies that isolate nothing: an action run so may read what it does not declare.
UNISOLATED = ("processwrapper-sandbox",)
# Execution requirements that take an action out of the sandbox.
EXEMPTING = ("no-sandbox", "local")


def processes_by_strategy(log: Path) -> dict[str, int]:
    """Bazel's last `INFO: N processes: ...` line of the log, as strategy -> count."""
    found: dict[str, int] = {}
    for line in log_lines(log):
        m = PROCESSES_LINE.match(line.strip())
        if m:
            found = {}
            for part in (m.group(2) or "").split(", "):
                count, _, strategy = part.partition(" ")
                if count.isdigit():
                    found[strategy] = int(count)
    return found


def load_exemptions(path: Path) -> list[dict]:
    """The listed sandbox exemptions: [{"mnemonic", "label" (fnmatch), "why"}], each with a reason."""
    entries = json.loads(path.read_text())["exemptions"]
    for i, e in enumerate(entries):
        if set(e) != {"mnemonic", "label", "why"} or not all(isinstance(e[k], str) and e[k] for k in e):
            raise ValueError(f"{path}: exemption {i} needs exactly a non-empty mnemonic, label and why")
    return entries


def exempt_actions(aquery: dict) -> list[tuple[str, str, list[str]]]:
    """(mnemonic, label, the exempting requirements) of each action of an aquery jsonproto output
    whose execution info takes it out of the sandbox."""
    labels = {t["id"]: t["label"] for t in aquery.get("targets", [])}
    found = []
    for a in aquery.get("actions", []):
        info = {kv["key"] for kv in a.get("executionInfo", [])}
        why = sorted(info & set(EXEMPTING))
        if why:
            found.append((a.get("mnemonic", "?"), labels.get(a.get("targetId"), "?"), why))
    return found


def unlisted_exemptions(actions: list[tuple[str, str, list[str]]], listed: list[dict]) -> list[str]:
    """One line per exempt action that no listed exemption names (its mnemonic and label)."""
    problems = []
    for mnemonic, label, why in sorted(set((m, l, tuple(w)) for m, l, w in actions)):
        if not any(e["mnemonic"] == mnemonic and fnmatch.fnmatchcase(label, e["label"]) for e in listed):
            problems.append(f"{label}: action {mnemonic} runs unsandboxed ({', '.join(why)}) and .ci/sandbox_exemptions.json "
                            "does not list it: let it run in linux-sandbox, or list it with the reason")
    return problems


def sandbox_problems(log: Path | None, patterns: list[str], exemptions: Path) -> list[str]:
    """Prints the command's processes by strategy; returns one line per unisolated strategy used and
    per unlisted exemption among the actions the patterns build (bazel aquery)."""
    problems = []
    if log is not None:
        counts = processes_by_strategy(log)
        print("processes by strategy: " + (", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "none counted"))
        for strategy in UNISOLATED:
            if counts.get(strategy):
                problems.append(f"{counts[strategy]} actions ran in {strategy}, which isolates nothing: every action "
                                "runs in linux-sandbox (.bazelrc), or local with a listed exemption")
    q = subprocess.run(["tools/bazel", "aquery", "--output=jsonproto", "--include_commandline=false",
                        "--include_artifacts=false", f"deps(set({' '.join(patterns)}))"],
                       capture_output=True, text=True)
    if q.returncode != 0:
        return problems + [f"bazel aquery of the test command's actions failed: {q.stderr.strip().splitlines()[-1:]}"]
    return problems + unlisted_exemptions(exempt_actions(json.loads(q.stdout or "{}")), load_exemptions(exemptions))


def written_by_pytest(suites: list[ET.Element]) -> bool:
    """Whether a JUnit report is pytest's (its suites are named "pytest"; the report Bazel writes
    for a test that wrote none has one suite named after the target and one case)."""
    return bool(suites) and all(s.get("name") == "pytest" for s in suites)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bazel-rc", type=int, required=True)
    ap.add_argument("--elapsed", type=int, default=0)
    ap.add_argument("--pattern", action="append", required=True,
                    help="a target pattern of the test command (repeat for each)")
    ap.add_argument("--bazel-log", type=Path,
                    help="Bazel's output of the test command: each test's time is checked against its limit")
    ap.add_argument("--sandbox-exemptions", type=Path,
                    help="the listed sandbox exemptions: every action the patterns build runs in linux-sandbox or "
                    "is listed there, and none ran in processwrapper-sandbox")
    ap.add_argument("--check", action="append", default=[], metavar="NAME=RC",
                    help="a check CI ran beside the test command (its exit status): one case, passed or failed")
    args = ap.parse_args()
    # Exactly the targets `bazel test PATTERN...` runs: a wildcard skips `manual` targets (a target
    # named explicitly runs all the same), and .bazelrc's --test_tag_filters=-gpu drops GPU tests
    # (a stale report of either must not count).
    parts = []
    for pattern in args.pattern:
        tests = f"tests({pattern})"
        skipped = f"attr(tags, '\\bgpu\\b', {tests})"
        if pattern.endswith(("...", ":all", ":*")):
            skipped += f" + attr(tags, '\\bmanual\\b', {tests})"
        parts.append(f"({tests} except ({skipped}))")
    q = subprocess.run(["tools/bazel", "query", " + ".join(parts)], capture_output=True, text=True)
    targets = [t for t in q.stdout.split() if t.startswith("//")]
    # The pytest files (tests/defs.bzl tags them): only pytest's own report counts for them.
    q = subprocess.run(["tools/bazel", "query", f"attr(tags, '\\bpytest\\b', {' + '.join(parts)})"],
                       capture_output=True, text=True)
    pytest_targets = {t for t in q.stdout.split() if t.startswith("//")}
    passed = failed = skipped = 0
    for t in targets:
        pkg, name = t[2:].split(":")
        xml = Path("bazel-testlogs") / pkg / name / "test.xml"
        try:
            root = ET.parse(xml).getroot()
        except (OSError, ET.ParseError):
            print(f"{t}: no test report (build or start-up failure)")
            failed += 1
            continue
        suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
        if t in pytest_targets and not written_by_pytest(suites):
            print(f"{t}: ran no pytest case (the report is the one Bazel writes when the test writes "
                  f"none); end its file with `if __name__ == \"__main__\": sys.exit(pytest.main([__file__, \"-v\"]))`")
            failed += 1
            continue
        t_fail = t_skip = t_total = 0
        for s in suites:
            t_total += int(s.get("tests", 0))
            t_fail += int(s.get("failures", 0)) + int(s.get("errors", 0))
            t_skip += int(s.get("skipped", 0))
        if t_total == 0:
            print(f"{t}: report lists no test cases")
            failed += 1
            continue
        passed += t_total - t_fail - t_skip
        failed += t_fail
        skipped += t_skip
    if args.bazel_log is not None:
        # Near its limit, a test passes on an idle machine and times out beside a build: that is
        # a failure now, not a flake later. Fix it by giving the target the size its time needs
        # (or making the test cheaper), never by raising this share.
        for problem in slow_tests(targets, durations(args.bazel_log), test_limits(targets)):
            print(problem)
            failed += 1
    if args.sandbox_exemptions is not None:
        # Hermetic by enforcement: an action that is not sandboxed says why, in the list.
        for problem in sandbox_problems(args.bazel_log, args.pattern, args.sandbox_exemptions):
            print(problem)
            failed += 1
    for check in args.check:
        name, _, rc = check.rpartition("=")
        if rc == "0":
            passed += 1
        else:
            print(f"{name}: failed (exit {rc})")
            failed += 1
    if args.bazel_rc != 0 and failed == 0:
        print(f"bazel test exited {args.bazel_rc} without a failing report: counting it as a failure")
        failed += 1
    print(f"{len(targets)} test targets, {args.elapsed} s")
    line = f"{passed} passed, {failed} failed"
    print(line + (f", {skipped} skipped" if skipped else ""))
    return 0 if failed == 0 and args.bazel_rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
