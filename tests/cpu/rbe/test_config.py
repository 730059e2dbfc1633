"""tools/rbe config: BuildGrid's generated config, the processes' command lines, and that
.bazelrc's `build:rbe` and //rbe:platform ask for exactly what the cluster serves."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).absolute().parents[3]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tools.common.errors import UserError  # noqa: E402
from tools.rbe import config, exec_root  # noqa: E402

LAYOUT = config.Layout(Path("/state/rbe/cluster"))


def test_bgd_config_serves_one_instance_on_loopback() -> None:
    text = config.bgd_config(LAYOUT, 50123, "main")
    assert 'address: "127.0.0.1:50123"' in text
    assert "insecure-mode: true" in text
    assert re.search(r'^  - name: "main"$', text, re.M)
    for service in ("!action-cache", "!execution", "!cas", "!bytestream"):
        assert f"      - {service}\n" in text
    assert "!disk-storage" not in text  # the blobs are casd's alone
    assert "!lru-action-cache" in text and "!sql-scheduler" in text
    assert 'connection-string: "postgresql+psycopg://postgres@/bgd?host=/run/postgresql"' in text
    # Loopback polling, not BuildGrid's 1 s defaults (the floor of a round trip).
    for key in ("poll-interval: 0.1", "bot-poll-interval: 0.1", "interval: 0.1"):
        assert f" {key}\n" in text
    # BuildGrid's default on 2 cores was 10 concurrent RPCs: a tree upload failed the build.
    assert "\nthread-pool-size: 256\n" in text and "\nmaximum-concurrent-rpcs: 65536\n" in text
    jobs = int(re.search(r"^build:rbe --jobs=(\d+)$", (REPO_ROOT / ".bazelrc").read_text(), re.M).group(1))
    assert config.THREAD_POOL_SIZE > jobs + config.MAX_WORKERS
    # No tab (YAML refuses it) and every anchor used is defined before it.
    assert "\t" not in text
    anchors = re.findall(r"&(\w+)", text)
    for alias in re.findall(r"\*(\w+)", text):
        assert alias in anchors


def test_bgd_config_property_set_is_the_platform() -> None:
    text = config.bgd_config(LAYOUT, config.DEFAULT_PORT, "main")
    assert "!static-property-set" in text
    props = re.search(r"properties: \[(.*)\]$", text, re.M).group(1)
    pairs = dict(re.findall(r'\["([^"]+)", "([^"]+)"\]', props))
    assert pairs == config.PLATFORM == {"OSFamily": "linux", "worker-root": "bazel-root"}


def test_instance_names() -> None:
    assert config.check_instance("main") is None
    assert config.check_instance("team/main") is None
    assert "reserved" in config.check_instance("main/blobs")
    for bad in ("", "a b", "/main", "main/", "a//b", 'x"y'):
        assert config.check_instance(bad), bad


def test_one_casd_stores_every_blob_once_and_workers_bind_the_root() -> None:
    """BuildGrid's storage and every worker's CAS are the one casd: no remote behind it, the
    cluster's instance served locally, so a blob lies on the disk once."""
    casd = config.casd_argv(LAYOUT, "main")
    assert "--local-server-instance=main" in casd
    assert not [a for a in casd if a.startswith(("--cas-remote", "--proxy-instance", "--remote"))]
    assert "--bind=unix:/state/rbe/cluster/run/casd.sock" in casd
    assert casd[-1] == "/state/rbe/cluster/data/casd"
    text = config.bgd_config(LAYOUT, 50123, "main")
    assert re.search(r'- !remote-storage &cas\n    url: "unix:/state/rbe/cluster/run/casd.sock"\n'
                     r'    instance-name: "main"\n', text)
    actions = exec_root.ExecRoot(Path("/sealed"), Path("/py"), Path("/cache/venvs"))
    worker = config.worker_argv(LAYOUT, 1, "http://127.0.0.1:50051", "main", actions.runner_binds())
    assert worker[0] == "/usr/bin/buildbox-worker" and worker[-1] == "rbe-worker-1"
    assert "--cas-remote=unix:/state/rbe/cluster/run/casd.sock" in worker
    assert "--buildbox-run=/usr/bin/buildbox-run-bubblewrap" in worker
    # An action sees the sealed root's system directories, the interpreter and the venvs; nothing
    # of the cluster's own root.
    binds = [a.split("=", 2)[2] for a in worker if a.startswith("--runner-arg=--ro-bind-mount=")]
    assert binds == [f"/sealed{d}:{d}" for d in ("/usr", "/bin", "/lib", "/lib64", "/etc")] + \
        ["/py:/py", "/cache/venvs:/cache/venvs"]
    assert "--platform=OSFamily=linux" in worker and "--platform=worker-root=bazel-root" in worker


def _record(cache: Path, root: Path, prefix: Path) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    (cache / exec_root.RECORD).write_text(f'{{"python_prefix": "{prefix}", "root": "{root}"}}\n')


def test_exec_root_is_the_sealed_root_tools_bazel_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache, root, prefix = tmp_path / "cache", tmp_path / "sealed", tmp_path / "py"
    (root / "usr" / "bin").mkdir(parents=True)
    prefix.mkdir()
    monkeypatch.setenv("KIMI_K3_CACHE", str(cache))
    with pytest.raises(UserError, match=r"sealed-root.json: not found: .*run `tools/bazel version` once"):
        exec_root.find()
    _record(cache, tmp_path / "gone", prefix)
    with pytest.raises(UserError, match=r"the sealed root .*gone/usr/bin is not a directory"):
        exec_root.find()
    _record(cache, root, prefix)
    found = exec_root.find()
    assert found == exec_root.ExecRoot(root, prefix, cache / "venvs") and (cache / "venvs").is_dir()
    assert found.host_paths() == [str(root), str(prefix), str(cache / "venvs")]


def test_tools_bazel_writes_the_record_the_cluster_reads() -> None:
    """One source for the sealed root's path: tools/bazel computes it and writes the record."""
    text = (REPO_ROOT / "tools" / "bazel").read_text()
    assert f"exec_root_file=$cache_root/{exec_root.RECORD}" in text
    assert '{"python_prefix": "%s", "root": "%s"}' in text


def test_postgres_has_no_tcp_listener() -> None:
    argv = config.postgres_argv(LAYOUT)
    assert "listen_addresses=" in argv and "unix_socket_directories=/run/postgresql" in argv


def test_bazel_platform_matches_the_cluster() -> None:
    build = (REPO_ROOT / "rbe" / "BUILD.bazel").read_text()
    block = re.search(r"exec_properties = \{(.*?)\}", build, re.S).group(1)
    assert dict(re.findall(r'"([^"]+)": "([^"]+)"', block)) == config.bazel_platform_properties()


def test_bazelrc_rbe_reaches_the_cluster() -> None:
    lines = [l.split(None, 1)[1] for l in (REPO_ROOT / ".bazelrc").read_text().splitlines()
             if l.startswith("build:rbe ")]
    assert f"--remote_executor=grpc://127.0.0.1:{config.DEFAULT_PORT}" in lines
    assert f"--remote_instance_name={config.DEFAULT_INSTANCE}" in lines
    assert "--extra_execution_platforms=//rbe:platform" in lines
    # user.bazelrc is imported after these lines, so a user's own executor wins.
    text = (REPO_ROOT / ".bazelrc").read_text()
    assert text.index("build:rbe --remote_executor") < text.index("try-import %workspace%/user.bazelrc")


def test_up_removes_only_the_stores_of_earlier_layouts(tmp_path: Path) -> None:
    lay = config.Layout(tmp_path)
    for d in ("cas", "casd-0", "casd-12", "casd", "pg", "casd-notes", "casd-1.bak"):
        (lay.data / d).mkdir(parents=True)
    assert [p.name for p in lay.superseded] == ["cas", "casd-0", "casd-12"]


def test_large_input_roots_fit() -> None:
    """The main job's SGLang JIT and Triton actions take the image's installed trees (tens of
    thousands of files, GBs): over 100 connections BuildGrid cancelled half the uploads, and a
    4G casd evicted blobs of the tree it was staging (the action aborted)."""
    lines = [l.split(None, 1)[1] for l in (REPO_ROOT / ".bazelrc").read_text().splitlines()
             if l.startswith("build:rbe ")]
    connections = [int(l.split("=", 1)[1]) for l in lines if l.startswith("--remote_max_connections=")]
    assert connections and connections[-1] <= 4
    assert any(l.startswith("--remote_timeout=") and int(l.split("=", 1)[1]) >= 600 for l in lines)
    casd = config.casd_argv(LAYOUT, "main")
    quota = [a.split("=", 1)[1] for a in casd if a.startswith("--quota-high=")]
    assert quota == [config.CASD_QUOTA] and int(config.CASD_QUOTA.rstrip("G")) >= 16
    # A casd that may not evict what it fetched in its lifetime refuses every staging once full.
    assert "--protect-session-blobs" not in casd
    worker = config.worker_argv(LAYOUT, 1, "http://127.0.0.1:50051", "main", [])
    # Not copy-or-link: it copies every input (all executable, casd's objects read-only), so an
    # input root of GBs would be on the disk twice while its action runs.
    assert "--runner-arg=--staging-mode=fuse" in worker


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
