"""Count test cases from bazel-testlogs for .ci/run and print `N passed, N failed` last.

Each test target of the patterns (the README's test command) writes pytest's JUnit XML to test.xml, e.g.
//tests/cpu/kernel_cache:spec_check -> bazel-testlogs/tests/cpu/kernel_cache/spec_check/test.xml
(a test_suite under tests/cpu may expand to a test in another package, such as
//sglang_patches:check -> bazel-testlogs/sglang_patches/check/test.xml). A target without a report (build failure, crash
before pytest started) counts as one failure, so nothing is lost.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bazel-rc", type=int, required=True)
    ap.add_argument("--elapsed", type=int, default=0)
    ap.add_argument("--pattern", action="append", required=True,
                    help="a target pattern of the test command (repeat for each)")
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
    if args.bazel_rc != 0 and failed == 0:
        print(f"bazel test exited {args.bazel_rc} without a failing report: counting it as a failure")
        failed += 1
    print(f"{len(targets)} test targets, {args.elapsed} s")
    line = f"{passed} passed, {failed} failed"
    print(line + (f", {skipped} skipped" if skipped else ""))
    return 0 if failed == 0 and args.bazel_rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
