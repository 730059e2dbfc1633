"""tools/bench/runs.py: running the newcomer's commands side by side (the `both` figure)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).absolute().parents[3]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tools.bench.runs import run_together  # noqa: E402


def test_jobs_run_at_once_each_to_its_log_with_its_own_status(tmp_path: Path) -> None:
    """Each job waits for the other's file, so they finish only if both run at the same time; the
    failing one's status is its own, and each log holds only its job's output."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    wait = "for i in $(seq 100); do [ -e {f} ] && break; sleep 0.1; done; [ -e {f} ]"
    env = dict(os.environ)
    jobs = [(["bash", "-c", f"touch {a}/ready; {wait.format(f=b / 'ready')} && echo one"], a, env, tmp_path / "a.log"),
            (["bash", "-c", f"touch {b}/ready; {wait.format(f=a / 'ready')} && echo two; exit 3"], b, env,
             tmp_path / "b.log")]
    (rc_a, secs_a, out_a), (rc_b, secs_b, out_b) = run_together(jobs)
    assert (rc_a, out_a) == (0, "one\n")
    assert (rc_b, out_b) == (3, "two\n")
    assert 0 < secs_a < 10 and 0 < secs_b < 10


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
