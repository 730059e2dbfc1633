"""tools/bench: running the newcomer's commands side by side (the `both` figure), and the fresh
HOME of --fresh-home."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).absolute().parents[3]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tools.bench.__main__ import fresh_home_env  # noqa: E402
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


def test_a_fresh_home_moves_every_cache_and_keeps_only_the_pip_configuration(tmp_path: Path) -> None:
    """Under --fresh-home nothing the user's runs provisioned is found: the cache root and the
    sealed root follow the new HOME (the variables that would pin them elsewhere are dropped),
    and the pip configuration, the machine's set-up, is there as the user has it."""
    user = tmp_path / "user"
    wheels = str(tmp_path / "wheels")  # where the user's pip finds packages
    conf = f"[global]\nfind-links = {wheels}\n"
    (user / ".config" / "pip").mkdir(parents=True)
    (user / ".config" / "pip" / "pip.conf").write_text(conf)
    env = {"HOME": str(user), "PATH": "/usr/bin", "XDG_CACHE_HOME": str(user / "xdg"),
           "KIMI_K3_CACHE": str(user / "kimi"), "KIMI_K3_SEALED_ROOT_DIR": str(user / "root"),
           "PIP_FIND_LINKS": wheels}
    fresh = fresh_home_env(env, tmp_path / "home")
    assert fresh == {"HOME": str(tmp_path / "home"), "PATH": "/usr/bin", "PIP_FIND_LINKS": wheels}
    assert (tmp_path / "home" / ".config" / "pip" / "pip.conf").read_text() == conf
    assert sorted(p.name for p in (tmp_path / "home").iterdir()) == [".config"]
    # Where tools/bazel and tools/common/cache.py then put the caches: under the new HOME.
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); from tools.common.cache import cache_root; "
             "print(cache_root())")
    out = subprocess.run([sys.executable, "-c", probe, str(REPO_ROOT)], env=fresh, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == str(tmp_path / "home" / ".cache" / "kimi-k3-build")
    launcher = (REPO_ROOT / "tools" / "bazel").read_text()
    assert "root_parent=${KIMI_K3_SEALED_ROOT_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kimi-k3-bazel-root}" in launcher


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
