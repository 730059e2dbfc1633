"""tools/bench/profile.py: the top actions of a Bazel JSON trace profile, on generated profiles."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).absolute().parents[3]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tools.bench.profile import action_rows, critical_path, load_events, report  # noqa: E402
from tools.common.errors import UserError  # noqa: E402


def _action(name: str, target: str, ts: float, dur: float, mnemonic: str | None = None) -> dict:
    args = {"target": target}
    if mnemonic:
        args["mnemonic"] = mnemonic
    return {"cat": "action processing", "name": name, "ph": "X", "ts": ts * 1e6, "dur": dur * 1e6,
            "pid": 1, "tid": 7, "args": args}


def _profile(tmp_path: Path) -> Path:
    events = [
        _action("Scanning the image with syft", "//image:image_sbom", 0, 120, "ImageSbom"),
        _action("Testing //tests/cpu/kernel_cache:test_kernel_cache", "//tests/cpu/kernel_cache:test_kernel_cache", 10, 100),
        _action("Compiling a.cu", "//kernel_cache:sm120_cache", 20, 30, "KernelCacheCompile"),
        _action("Compiling b.cu", "//kernel_cache:sm120_cache", 50, 30, "KernelCacheCompile"),
        {"cat": "critical path component", "name": "action 'Scanning the image'", "ph": "X", "ts": 0, "dur": 120e6},
        {"cat": "general information", "name": "Build", "ph": "X", "ts": 0, "dur": 200e6},
        {"name": "thread_name", "ph": "M", "args": {"name": "x"}},
    ]
    path = tmp_path / "p.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"otherData": {}, "traceEvents": events}).encode()))
    return path


def test_actions_summed_per_target_and_mnemonic_largest_first(tmp_path: Path) -> None:
    rows = action_rows(load_events(_profile(tmp_path)))
    assert [(r.target, r.mnemonic, r.seconds, r.count) for r in rows] == [
        ("//image:image_sbom", "ImageSbom", 120.0, 1),
        ("//tests/cpu/kernel_cache:test_kernel_cache", "TestRunner", 100.0, 1),
        ("//kernel_cache:sm120_cache", "KernelCacheCompile", 60.0, 2),
    ]
    assert rows[2].what == "2 actions"
    by_mnemonic = action_rows(load_events(_profile(tmp_path)), by="mnemonic")
    assert [(r.mnemonic, r.seconds) for r in by_mnemonic][0] == ("ImageSbom", 120.0)


def test_report_names_wall_total_critical_path_and_the_rest(tmp_path: Path) -> None:
    text = report(_profile(tmp_path), top=2, by="target")
    assert "run 200 s wall, 4 actions and tests, 280 s in them, critical path 120 s (1 actions)" in text
    assert "| 1 | `//image:image_sbom` | ImageSbom | 120.0 | 42.9% |" in text
    assert "| | 1 others | | 60.0 | 21.4% | |" in text
    assert critical_path(load_events(_profile(tmp_path))) == [("action 'Scanning the image'", 120.0)]


@pytest.mark.parametrize("content,says", [
    (None, "no such profile"),
    (b"\x1f\x8bnot gzip", "not a Bazel JSON trace profile"),
    (b'{"traceEvents": 3}', "no traceEvents list"),
])
def test_a_bad_profile_is_one_line(tmp_path: Path, content: bytes | None, says: str) -> None:
    path = tmp_path / "bad.json.gz"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(UserError, match=says):
        load_events(path)
    proc = subprocess.run([sys.executable, "-m", "tools.bench.profile", str(path)], cwd=REPO_ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and says in proc.stderr


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
