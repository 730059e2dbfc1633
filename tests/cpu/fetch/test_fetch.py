"""tools/fetch: verified fetch through the CAS, mirrors, git pins, add-git-diff, verify.

Everything runs against fixtures this file makes under tmp_path: an HTTP server on 127.0.0.1
(in a thread), a lock file, and bare git repositories. No network beyond loopback.
"""
from __future__ import annotations

import hashlib
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest

REPO_ROOT = Path(__file__).absolute().parents[3]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tools.common.errors import UserError  # noqa: E402
from tools.fetch import cli as fetch  # noqa: E402  (fetch.main: the CLI in-process)
from tools.fetch import git as fetch_git  # noqa: E402
from tools.fetch import place, sources  # noqa: E402
from tools.pins import lock as lockfile  # noqa: E402
from tests.cpu.fetch.fetch_testing import (  # noqa: E402
    GIT_ENV, cas_entries, git, one_line, run_main, write_lock)

# The CLI as users run it (`python3 -m tools.fetch`), with the repository root importable.
FETCH_CLI = [sys.executable, "-m", "tools.fetch"]
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)


# ---------------------------------------------------------------------------------------------
# Fixtures: a loopback HTTP server, lock files, git repositories


@dataclass
class Route:
    body: bytes
    # full | half (close after half the body) | half_once (half on the first request only)
    # | slow (trickle, for the kill and race tests) | endless (no Content-Length; `body` repeated
    # up to `repeat` times, i.e. until the client hangs up, within a bound)
    mode: str = "full"
    content_type: str = "application/octet-stream"
    chunk_delay_s: float = 0.02
    announce: int | None = None  # a Content-Length other than len(body)
    repeat: int = 1
    endless_delay_s: float = 0.0  # between repeats of an endless body (a download still running)


@dataclass
class Server:
    routes: dict[str, Route] = field(default_factory=dict)
    hits: dict[str, int] = field(default_factory=dict)
    # endless routes: bytes written, and how the body ended ("complete" or "cut" by the client)
    sent: dict[str, int] = field(default_factory=dict)
    ended: dict[str, str] = field(default_factory=dict)
    httpd: http.server.ThreadingHTTPServer | None = None

    @property
    def base(self) -> str:
        assert self.httpd is not None
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def url(self, path: str) -> str:
        return self.base + path

    def stop(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None


def _handler(server: Server) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # keep pytest output clean
            pass

        def do_GET(self) -> None:
            path = self.path
            route = server.routes.get(path)
            server.hits[path] = server.hits.get(path, 0) + 1
            if route is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", route.content_type)
            if route.mode != "endless":  # HTTP/1.0 without a length: the body runs until close
                self.send_header("Content-Length", str(route.announce if route.announce is not None
                                                       else len(route.body)))
            self.end_headers()
            if route.mode == "endless":
                server.sent[path] = 0
                try:
                    for _ in range(route.repeat):  # bounded, so a broken fetcher cannot fill the disk
                        self.wfile.write(route.body)
                        server.sent[path] += len(route.body)
                        time.sleep(route.endless_delay_s)
                    self.wfile.flush()
                    server.ended[path] = "complete"
                except (BrokenPipeError, ConnectionResetError):
                    server.ended[path] = "cut"
                return
            try:
                if route.mode == "half" or (route.mode == "half_once" and server.hits[path] == 1):
                    self.wfile.write(route.body[: len(route.body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                elif route.mode == "slow":
                    for start in range(0, len(route.body), 64 * 1024):
                        self.wfile.write(route.body[start:start + 64 * 1024])
                        self.wfile.flush()
                        time.sleep(route.chunk_delay_s)
                else:
                    self.wfile.write(route.body)
            except (BrokenPipeError, ConnectionResetError):
                pass

    return Handler


@pytest.fixture()
def server() -> Iterator[Server]:
    srv = Server()
    srv.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(srv))
    srv.httpd.daemon_threads = True
    thread = threading.Thread(target=srv.httpd.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def hermetic_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Never touch the user's cache or mirrors, and never go through a proxy for loopback.
    monkeypatch.delenv("KIMI_K3_MIRROR", raising=False)
    monkeypatch.setenv("KIMI_K3_CACHE", str(tmp_path / "env-cache"))
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_pin(url: str | list[str], data: bytes, filename: str = "artifact.bin", **extra: Any) -> dict[str, Any]:
    urls = [url] if isinstance(url, str) else url
    return {"kind": "file", "filename": filename, "urls": urls, "sha256": sha(data), "size": len(data), **extra}


def closed_port_url(path: str = "/x") -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}{path}"  # nothing listens there any more: connection refused


def tmp_entries(cache: Path) -> list[Path]:
    tmp = cache / "tmp"
    return sorted(tmp.iterdir()) if tmp.exists() else []


def wait_ended(server: Server, path: str) -> str:
    deadline = time.monotonic() + 30
    while path not in server.ended:
        assert time.monotonic() < deadline, "the server never finished the body"
        time.sleep(0.02)
    return server.ended[path]


@dataclass
class GitOrigin:
    work: Path
    bare: Path
    url: str
    parent: str
    commit: str
    parent_tree: str
    commit_tree: str
    diff: bytes


@pytest.fixture()
def git_origin(tmp_path: Path) -> GitOrigin:
    """A work tree with two commits (text edit, new binary file, non-ASCII name) and a bare
    clone at .../origin/acme/widget.git, served as a file:// URL."""
    work = tmp_path / "work"
    work.mkdir()
    git("init", "-q", cwd=work)
    (work / "csrc").mkdir()
    (work / "csrc" / "moe.cu").write_text("int act(int x) { return x; }\n" * 3)
    (work / "README.md").write_text("widget\n")
    git("add", "-A", cwd=work)
    git("commit", "-qm", "base", cwd=work)
    parent = git("rev-parse", "HEAD", cwd=work)
    (work / "csrc" / "moe.cu").write_text("int act(int x) { return x * 2; }\n" * 3)
    (work / "data.bin").write_bytes(bytes(range(256)) * 4)
    (work / "naïve.py").write_text("print('situ')\n")
    git("add", "-A", cwd=work)
    git("commit", "-qm", "feature", cwd=work)
    commit = git("rev-parse", "HEAD", cwd=work)
    git("commit", "-q", "--allow-empty", "-m", "later", cwd=work)  # the pinned commit is not the tip
    bare = tmp_path / "origin" / "acme" / "widget.git"
    bare.parent.mkdir(parents=True)
    git("clone", "-q", "--bare", str(work), str(bare))
    diff = subprocess.run(["git", "-c", "core.quotepath=off", "diff", "--binary", "--full-index", "--no-color",
                           "--no-ext-diff", "--no-textconv", "--no-renames", parent, commit], cwd=work, env=GIT_ENV,
                          check=True, capture_output=True).stdout
    return GitOrigin(work=work, bare=bare, url=f"file://{bare}", parent=parent, commit=commit,
                     parent_tree=git("rev-parse", f"{parent}^{{tree}}", cwd=work),
                     commit_tree=git("rev-parse", f"{commit}^{{tree}}", cwd=work), diff=diff)


def diff_pin(origin: GitOrigin, repository: str | None = None, **override: Any) -> dict[str, Any]:
    pin = {"kind": "git_diff", "repository": repository or origin.url, "commit": origin.commit,
           "commit_tree": origin.commit_tree, "parent": origin.parent, "parent_tree": origin.parent_tree,
           "filename": "widget-feature.diff", "sha256": sha(origin.diff)}
    pin.update(override)
    return pin


def tree_pin(origin: GitOrigin, **override: Any) -> dict[str, Any]:
    pin = {"kind": "git_tree", "repository": origin.url, "commit": origin.commit, "tree": origin.commit_tree}
    pin.update(override)
    return pin


# ---------------------------------------------------------------------------------------------
# Lock schema


GOOD_SHA = "a" * 64


def good_file_pin() -> dict[str, Any]:
    return {"kind": "file", "filename": "a.whl", "urls": ["https://example.com/a.whl"], "sha256": GOOD_SHA, "size": 1}


@pytest.mark.parametrize(
    ("pins", "stacks", "expected"),
    [
        ({"x": {**good_file_pin(), "sha256": "abc"}}, {}, "pin 'x': sha256 must be 64 lowercase hex chars, got 'abc'"),
        ({"x": {**good_file_pin(), "sha256": "A" * 64}}, {}, "pin 'x': sha256 must be 64 lowercase hex chars"),
        ({"x": {k: v for k, v in good_file_pin().items() if k != "urls"}}, {}, "pin 'x': urls is missing"),
        ({"x": {**good_file_pin(), "kind": "tarball"}}, {}, "pin 'x': kind must be one of file, git_diff, git_tree"),
        ({"x": {**good_file_pin(), "sha265": GOOD_SHA}}, {}, "pin 'x': field 'sha265' is not part of the schema"),
        ({"x": {**good_file_pin(), "urls": ["ftp://h/a"]}}, {}, "pin 'x': urls must hold only"),
        ({"x": {**good_file_pin(), "size": -1}}, {}, "pin 'x': size must be a non-negative integer"),
        ({"x": {**good_file_pin(), "filename": "../a.whl"}}, {}, "pin 'x': filename must be a plain file name"),
        ({"x": good_file_pin(), "y": {**good_file_pin(), "sha256": "b" * 64}}, {},
         "pin 'y': filename 'a.whl' is also used by pin 'x'"),
        ({"g": {"kind": "git_diff", "repository": "https://h/o/r", "commit": "1" * 40, "commit_tree": "2" * 40,
                "parent": "3" * 39, "parent_tree": "4" * 40, "filename": "g.diff", "sha256": GOOD_SHA}}, {},
         "pin 'g': parent must be a full 40-char lowercase hex git object id"),
        ({"t": {"kind": "git_tree", "repository": "https://h/o/r", "commit": "1" * 40}}, {}, "pin 't': tree is missing"),
        ({"x": good_file_pin()}, {"default": {"sglang": "sglang-9.9"}},
         "stack 'default': sglang names unknown pin 'sglang-9.9'"),
        ({"x": good_file_pin()}, {"default": {"wheels": ["x", "x"]}}, "stack 'default': wheels lists pin 'x' twice"),
    ],
)
def test_schema_errors_name_pin_and_field(tmp_path: Path, pins: dict[str, Any], stacks: dict[str, Any],
                                          expected: str) -> None:
    lock = write_lock(tmp_path, pins, stacks)
    with pytest.raises(UserError) as e:
        lockfile.load(lock)
    message = one_line(e.value)
    assert message.startswith(str(lock)), message
    assert expected in message


def test_schema_rejects_bad_json_duplicate_keys_and_version(tmp_path: Path) -> None:
    path = tmp_path / "l.json"
    path.write_text('{"schema_version": 1, "pins": {"x": {}, "x": {}}}')
    with pytest.raises(UserError, match="key 'x' appears twice"):
        lockfile.load(path)
    path.write_text('{"schema_version": 1, "pins": {')
    with pytest.raises(UserError, match="invalid JSON at line 1"):
        lockfile.load(path)
    path.write_text('{"schema_version": 2, "pins": {}}')
    with pytest.raises(UserError, match="schema_version must be 1"):
        lockfile.load(path)
    with pytest.raises(UserError, match="lock file not found"):
        lockfile.load(tmp_path / "missing.json")


def test_project_lock_is_valid_and_canonical() -> None:
    lock = lockfile.load(lockfile.DEFAULT_LOCK)
    assert {"default", "pypi"} <= set(lock.stacks)
    for stack in lock.stacks.values():  # every role and patch pin of every stack is a pin
        assert set(stack.pin_names()) <= set(lock.pins), stack.name
    assert "flashinfer-pr4460" in lock.stacks["default"].pin_names()
    assert "flashinfer-pr4460" not in lock.stacks["pypi"].pin_names()  # the pypi stack needs no GitHub input
    text = lockfile.DEFAULT_LOCK.read_text()
    assert text == lockfile.canonical_text(json.loads(text)), "run `python3 -m tools.fetch format`"


def test_canonical_writer_is_deterministic(tmp_path: Path) -> None:
    pins = {"b": {**good_file_pin(), "filename": "b.whl", "size": 3, "package": {"version": "1", "name": "b"}},
            "a": good_file_pin()}
    data = {"stacks": {"s": {"wheels": ["a", "b"], "description": "d", "sglang": "a"}}, "pins": pins,
            "schema_version": 1}
    out = tmp_path / "lock.json"
    lockfile.write(out, data)
    first = out.read_bytes()
    lockfile.write(out, json.loads(first))
    assert out.read_bytes() == first
    assert first.endswith(b"}\n") and b'\n  "pins": {\n    "a": {\n      "kind": "file"' in first
    assert b'"package": {"name": "b", "version": "1"}' in first


# ---------------------------------------------------------------------------------------------
# file pins


def test_fetch_from_origin_then_cache_hit_without_network(tmp_path: Path, server: Server) -> None:
    data = os.urandom(300_000)
    server.routes["/a.bin"] = Route(data)
    lock = write_lock(tmp_path, {"a": file_pin(server.url("/a.bin"), data)})
    cache = tmp_path / "cache"
    path = run_main("fetch", "--lock", str(lock), "--cache", str(cache), "--pin", "a")
    assert Path(path) == cache / "cas" / "sha256" / sha(data)
    assert Path(path).read_bytes() == data
    server.stop()
    assert run_main("fetch", "--lock", str(lock), "--cache", str(cache), "--pin", "a") == path
    assert tmp_entries(cache) == []


def test_downloads_in_one_process_look_their_host_up_once(tmp_path: Path, server: Server,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A resolver that drops a query costs glibc a 5 s timeout per lookup, so a set of hundreds of
    .debs must not look the mirror's host up per file. The first lookup fails here, and a failure
    is not remembered: the retry looks the host up again and the rest reuse that answer."""
    import socket

    real = socket.getaddrinfo
    lookups: list[str] = []

    def counting(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "localhost":
            lookups.append(host)
            if len(lookups) == 1:
                raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", counting)
    monkeypatch.setattr(sources, "RETRY_DELAY_S", 0.0)
    # A port of its own: the process may have looked up localhost for another test's server.
    host = f"http://localhost:{server.httpd.server_address[1]}"
    blobs = {f"/{i}.deb": os.urandom(1000 + i) for i in range(5)}
    pins = {}
    for path, data in blobs.items():
        server.routes[path] = Route(data)
        pins[path.strip("/").replace(".", "_")] = file_pin(host + path, data, filename=path.strip("/"))
    lock = write_lock(tmp_path, pins)
    cache = tmp_path / "cache"
    for name in pins:
        fetch.main(["fetch", "--lock", str(lock), "--cache", str(cache), "--pin", name])
    assert len(cas_entries(cache)) == 5
    assert lookups == ["localhost", "localhost"], lookups


def test_hash_mismatch_from_origin_names_input_expected_actual(tmp_path: Path, server: Server) -> None:
    server.routes["/a.bin"] = Route(b"evil bytes")
    good = b"good bytes"
    lock = write_lock(tmp_path, {"a": file_pin(server.url("/a.bin"), good)})
    cache = tmp_path / "cache"
    with pytest.raises(UserError) as e:
        fetch.main(["fetch", "--lock", str(lock), "--cache", str(cache), "--pin", "a"])
    message = one_line(e.value)
    assert "pin 'a'" in message and server.url("/a.bin") in message
    assert f"expected {sha(good)}" in message and f"actual {sha(b'evil bytes')}" in message
    assert cas_entries(cache) == [] and tmp_entries(cache) == []


def test_mirror_used_while_origin_unreachable(tmp_path: Path) -> None:
    data = b"wheel bytes" * 1000
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / "artifact.bin").write_bytes(data)
    lock = write_lock(tmp_path, {"a": file_pin(closed_port_url(), data)})
    path = run_main("fetch", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--mirror", str(mirror),
                    "--pin", "a")
    assert Path(path).read_bytes() == data


def test_mirror_from_env_and_cache_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = b"from env mirror"
    mirror = tmp_path / "m2"
    mirror.mkdir()
    (mirror / "artifact.bin").write_bytes(data)
    monkeypatch.setenv("KIMI_K3_MIRROR", f"{tmp_path / 'absent'}:{mirror}")
    lock = write_lock(tmp_path, {"a": file_pin(closed_port_url(), data)})
    path = run_main("fetch", "--lock", str(lock), "--pin", "a")
    assert Path(path).is_relative_to(tmp_path / "env-cache")


def test_corrupt_mirror_file_is_an_error_naming_the_path(tmp_path: Path) -> None:
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / "artifact.bin").write_bytes(b"tampered")
    lock = write_lock(tmp_path, {"a": file_pin(closed_port_url(), b"original")})
    with pytest.raises(UserError) as e:
        fetch.main(["fetch", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--mirror", str(mirror),
                    "--pin", "a"])
    message = one_line(e.value)
    assert str(mirror / "artifact.bin") in message and sha(b"original") in message and sha(b"tampered") in message
    # The re-pin hint names the commands as they are now run.
    assert "`python3 -m tools.pins.pypi add-pypi` or `python3 -m tools.fetch add-git-diff`" in message


def test_unreachable_everywhere_lists_sources_and_fill_hint(tmp_path: Path) -> None:
    url = closed_port_url()
    lock = write_lock(tmp_path, {"a": file_pin(url, b"x")})
    with pytest.raises(UserError) as e:
        fetch.main(["fetch", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--pin", "a"])
    message = one_line(e.value)
    assert url in message and "-m tools.fetch mirror --pin a" in message


def test_flipped_byte_in_cache_fails_then_evict_recovers(tmp_path: Path, server: Server) -> None:
    data = os.urandom(50_000)
    server.routes["/a.bin"] = Route(data)
    lock = write_lock(tmp_path, {"a": file_pin(server.url("/a.bin"), data)})
    cache = tmp_path / "cache"
    path = Path(run_main("fetch", "--lock", str(lock), "--cache", str(cache), "--pin", "a"))
    corrupt = bytearray(data)
    corrupt[1234] ^= 0x01
    path.chmod(0o644)
    path.write_bytes(bytes(corrupt))
    with pytest.raises(UserError) as e:
        fetch.main(["fetch", "--lock", str(lock), "--cache", str(cache), "--pin", "a"])
    message = one_line(e.value)
    assert "pin 'a'" in message and str(path) in message
    assert f"expected sha256 {sha(data)}" in message and f"actual {sha(bytes(corrupt))}" in message
    assert "-m tools.fetch evict --pin a" in message
    run_main("evict", "--lock", str(lock), "--cache", str(cache), "--pin", "a")
    assert not path.exists()
    assert Path(run_main("fetch", "--lock", str(lock), "--cache", str(cache), "--pin", "a")).read_bytes() == data


def test_truncated_download_leaves_no_entry(tmp_path: Path, server: Server) -> None:
    data = os.urandom(200_000)
    server.routes["/a.bin"] = Route(data, mode="half")
    lock = write_lock(tmp_path, {"a": file_pin(server.url("/a.bin"), data)})
    cache = tmp_path / "cache"
    with pytest.raises(UserError) as e:
        fetch.main(["fetch", "--lock", str(lock), "--cache", str(cache), "--pin", "a"])
    assert f"connection closed after 100000 of {len(data)} bytes" in one_line(e.value)
    assert cas_entries(cache) == [] and tmp_entries(cache) == []
    assert server.hits["/a.bin"] == 2  # a dropped connection is retried once


def test_dropped_connection_then_success_is_verified(tmp_path: Path, server: Server) -> None:
    data = os.urandom(200_000)
    server.routes["/a.bin"] = Route(data, mode="half_once")
    lock = write_lock(tmp_path, {"a": file_pin(server.url("/a.bin"), data)})
    path = run_main("fetch", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--pin", "a")
    assert Path(path).read_bytes() == data and tmp_entries(tmp_path / "c") == []


def fetch_cmd(lock: Path, cache: Path, pin: str, *extra: str) -> list[str]:
    return [*FETCH_CLI, "fetch", "--lock", str(lock), "--cache", str(cache), "--pin", pin, *extra]


def test_killed_download_leaves_no_entry_and_next_fetch_succeeds(tmp_path: Path, server: Server) -> None:
    data = os.urandom(4 << 20)
    server.routes["/a.bin"] = Route(data, mode="slow", chunk_delay_s=0.05)  # ~3 s for the body
    lock = write_lock(tmp_path, {"a": file_pin(server.url("/a.bin"), data)})
    cache = tmp_path / "cache"
    proc = subprocess.Popen(fetch_cmd(lock, cache, "a"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 20
    while not any(p.stat().st_size > 0 for p in tmp_entries(cache)):
        assert time.monotonic() < deadline and proc.poll() is None, "download never started"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert cas_entries(cache) == []
    assert len(tmp_entries(cache)) == 1  # the killed writer's temp file, never in cas/
    server.routes["/a.bin"] = Route(data)
    assert Path(run_main("fetch", "--lock", str(lock), "--cache", str(cache), "--pin", "a")).read_bytes() == data
    assert tmp_entries(cache) == []  # the stale temp file was cleaned under the entry lock


def test_concurrent_fetches_produce_one_entry(tmp_path: Path, server: Server) -> None:
    data = os.urandom(1 << 20)
    server.routes["/a.bin"] = Route(data, mode="slow", chunk_delay_s=0.03)
    lock = write_lock(tmp_path, {"a": file_pin(server.url("/a.bin"), data)})
    cache = tmp_path / "cache"
    procs = [subprocess.Popen(fetch_cmd(lock, cache, "a"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    paths = {out.strip() for out, _ in results}
    assert paths == {str(cache / "cas" / "sha256" / sha(data))}
    assert cas_entries(cache) == [cache / "cas" / "sha256" / sha(data)]
    assert server.hits["/a.bin"] == 1  # the second waited on the entry lock, then hit the cache


def test_unpinned_input_lists_close_names(tmp_path: Path) -> None:
    lock = write_lock(tmp_path, {"demo-1.0.1": file_pin("https://e/s.whl", b"s", "s.whl"),
                                 "demo-1.0.3": file_pin("https://e/t.whl", b"t", "t.whl")})
    with pytest.raises(UserError) as e:
        fetch.main(["fetch", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--pin", "demo-1.0.2"])
    message = one_line(e.value)
    assert "pin 'demo-1.0.2' is not in the lock" in message and "demo-1.0.1" in message


def test_out_places_a_verified_copy_atomically(tmp_path: Path, server: Server) -> None:
    data = b"payload" * 100
    server.routes["/a.bin"] = Route(data)
    lock = write_lock(tmp_path, {"a": file_pin(server.url("/a.bin"), data)})
    out = tmp_path / "out" / "sub" / "a.whl"
    printed = run_main("fetch", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--pin", "a", "--out", str(out))
    assert printed == str(out) and out.read_bytes() == data
    printed = run_main("fetch", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--pin", "a", "--out",
                       str(out), "--copy")
    assert out.read_bytes() == data and sorted(p.name for p in out.parent.iterdir()) == ["a.whl"]


def test_endless_body_stops_one_byte_past_the_pinned_size(tmp_path: Path, server: Server) -> None:
    data = os.urandom(300_000)
    chunk = os.urandom(64 * 1024)
    server.routes["/a.bin"] = Route(chunk, mode="endless", repeat=1024)  # up to 64 MiB, no Content-Length
    lock = write_lock(tmp_path, {"a": file_pin(server.url("/a.bin"), data)})
    cache = tmp_path / "cache"
    with pytest.raises(UserError) as e:
        fetch.main(["fetch", "--lock", str(lock), "--cache", str(cache), "--pin", "a"])
    message = one_line(e.value)
    assert f"{server.url('/a.bin')}: more than 300000 bytes, the lock's size" in message
    # The fetcher hung up: the server could not write its bounded 64 MiB.
    assert wait_ended(server, "/a.bin") == "cut" and server.sent["/a.bin"] < 64 * 1024 * 1024
    assert server.hits["/a.bin"] == 1  # a wrong file is not retried
    assert cas_entries(cache) == [] and tmp_entries(cache) == []


def test_content_length_above_the_pinned_size_is_refused_before_the_body(tmp_path: Path, server: Server) -> None:
    data = os.urandom(300_000)
    big = os.urandom(16 * len(data))
    server.routes["/a.bin"] = Route(big)
    lock = write_lock(tmp_path, {"a": file_pin(server.url("/a.bin"), data)})
    cache = tmp_path / "cache"
    with pytest.raises(UserError) as e:
        fetch.main(["fetch", "--lock", str(lock), "--cache", str(cache), "--pin", "a"])
    message = one_line(e.value)
    assert f"Content-Length {len(big)} is more than 300000 bytes, the lock's size" in message
    assert "not downloaded" in message and server.hits["/a.bin"] == 1
    assert cas_entries(cache) == [] and tmp_entries(cache) == []


def test_a_pin_without_size_is_refused_before_any_download(tmp_path: Path, server: Server) -> None:
    # The size caps every read of a source; without it an endless body would go to disk unbounded.
    server.routes["/a.bin"] = Route(os.urandom(64 * 1024), mode="endless", repeat=1024)
    pin = file_pin(server.url("/a.bin"), b"the pinned bytes")
    del pin["size"]
    lock = write_lock(tmp_path, {"a": pin})
    cache = tmp_path / "cache"
    with pytest.raises(UserError) as e:
        fetch.main(["fetch", "--lock", str(lock), "--cache", str(cache), "--pin", "a"])
    message = one_line(e.value)
    assert message.startswith(f"{lock}: pin 'a': size is missing") and "add-pypi" in message, message
    assert server.hits == {} and not cache.exists()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_download_leaves_no_part_file(tmp_path: Path, server: Server, signum: int) -> None:
    """SIGTERM (what `kill`, Bazel and CI send) and Ctrl-C unwind the fetcher: the `.part` goes."""
    server.routes["/a.bin"] = Route(os.urandom(64 * 1024), mode="endless", repeat=1600, endless_delay_s=0.01)
    lock = write_lock(tmp_path, {"a": {**file_pin(server.url("/a.bin"), b"x"), "size": 1 << 30}})
    cache = tmp_path / "cache"
    proc = subprocess.Popen(fetch_cmd(lock, cache, "a"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while not any(p.stat().st_size > 0 for p in tmp_entries(cache)):
            assert time.monotonic() < deadline and proc.poll() is None, "download never started"
            time.sleep(0.02)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    expected = "error: terminated by SIGTERM" if signum == signal.SIGTERM else "error: interrupted"
    assert proc.returncode == 128 + signum and err.splitlines()[-1] == expected, (proc.returncode, err)
    assert "Traceback" not in err, err
    assert tmp_entries(cache) == [] and cas_entries(cache) == []
    assert wait_ended(server, "/a.bin") == "cut"


def test_oversized_mirror_file_is_read_only_to_size_plus_one(tmp_path: Path, server: Server,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    data = os.urandom(100_000)
    server.routes["/a.bin"] = Route(data)
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    # The file grows after the size check (stat says the right size): the read itself is capped.
    (mirror / "artifact.bin").write_bytes(os.urandom(len(data) * 40))
    real_stat = Path.stat

    def lying_stat(self: Path, **kw: Any) -> os.stat_result:
        st = real_stat(self, **kw)
        if self.name == "artifact.bin" and self.parent == mirror:
            return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, st.st_uid, st.st_gid,
                                   len(data), int(st.st_atime), int(st.st_mtime), int(st.st_ctime)))
        return st

    monkeypatch.setattr(Path, "stat", lying_stat)
    read: list[int] = []
    real_copy = sources.copy_stream_verified

    def counting_copy(*args: Any, **kwargs: Any) -> tuple[str, int]:
        digest, got = real_copy(*args, **kwargs)
        read.append(got)
        return digest, got

    monkeypatch.setattr(sources, "copy_stream_verified", counting_copy)
    lock = write_lock(tmp_path, {"a": file_pin(server.url("/a.bin"), data)})
    path = run_main("fetch", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--mirror", str(mirror),
                    "--pin", "a")
    assert Path(path).read_bytes() == data
    assert read == [len(data) + 1, len(data)]  # the mirror: stopped at size + 1; then the origin


def mirror_with(tmp_path: Path, name: str, body: bytes) -> Path:
    mirror = tmp_path / name
    mirror.mkdir()
    (mirror / "artifact.bin").write_bytes(body)
    return mirror


def test_bad_mirrors_fall_through_to_a_good_source_and_are_reported(tmp_path: Path, server: Server,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    data = os.urandom(50_000)
    flipped = bytearray(data)
    flipped[777] ^= 0x40
    wrong = mirror_with(tmp_path, "wrong", bytes(flipped))  # right size, wrong bytes
    short = mirror_with(tmp_path, "short", data[:-10])
    long = mirror_with(tmp_path, "long", data + b"tail")
    good = mirror_with(tmp_path, "good", data)
    lock = write_lock(tmp_path, {"a": file_pin(closed_port_url(), data)})
    path = run_main("fetch", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--mirror", str(wrong),
                    "--mirror", str(short), "--mirror", str(long), "--mirror", str(good), "--pin", "a")
    assert Path(path).read_bytes() == data
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if "warning" in ln]
    assert len(warnings) == 3, warnings
    assert str(wrong / "artifact.bin") in warnings[0] and f"actual {sha(bytes(flipped))}" in warnings[0]
    assert str(short / "artifact.bin") in warnings[1] and f"{len(data) - 10} bytes" in warnings[1]
    assert str(long / "artifact.bin") in warnings[2] and f"{len(data) + 4} bytes" in warnings[2]
    # A corrupt mirror before a good origin: the origin serves it.
    server.routes["/a.bin"] = Route(data)
    lock = write_lock(tmp_path, {"a": file_pin(server.url("/a.bin"), data)})
    path = run_main("fetch", "--lock", str(lock), "--cache", str(tmp_path / "c2"), "--mirror", str(wrong),
                    "--pin", "a")
    assert Path(path).read_bytes() == data and server.hits["/a.bin"] == 1


def test_every_source_bad_names_each_source_and_its_problem(tmp_path: Path, server: Server) -> None:
    data = os.urandom(20_000)
    wrong = mirror_with(tmp_path, "wrong", os.urandom(len(data)))
    short = mirror_with(tmp_path, "short", data[:100])
    server.routes["/a.bin"] = Route(os.urandom(len(data)))
    server.routes["/b.bin"] = Route(data, announce=len(data) * 2, mode="half")  # too long, announced
    lock = write_lock(tmp_path, {"a": file_pin([server.url("/a.bin"), server.url("/b.bin")], data)})
    cache = tmp_path / "c"
    with pytest.raises(UserError) as e:
        fetch.main(["fetch", "--lock", str(lock), "--cache", str(cache), "--mirror", str(wrong), "--mirror",
                    str(short), "--mirror", str(tmp_path / "absent"), "--pin", "a"])
    message = one_line(e.value)
    for part in (f"mirror file {wrong / 'artifact.bin'}: sha256 mismatch: expected {sha(data)}",
                 f"mirror file {short / 'artifact.bin'}: 100 bytes, the lock says {len(data)}",
                 f"mirror {tmp_path / 'absent'}: no artifact.bin",
                 f"{server.url('/a.bin')}: sha256 mismatch: expected {sha(data)}",
                 f"{server.url('/b.bin')}: Content-Length {len(data) * 2} is more than {len(data)} bytes"):
        assert part in message, (part, message)
    assert "a source served wrong bytes" in message
    assert cas_entries(cache) == [] and tmp_entries(cache) == []


def test_mirror_command_repairs_a_corrupt_file_in_its_target(tmp_path: Path, server: Server,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    data = os.urandom(30_000)
    server.routes["/a.bin"] = Route(data)
    target = mirror_with(tmp_path, "target", bytes(len(data)))  # right size, all zeros
    lock = write_lock(tmp_path, {"a": file_pin(server.url("/a.bin"), data)})
    run_main("mirror", "--lock", str(lock), "--cache", str(tmp_path / "c"), str(target))
    assert (target / "artifact.bin").read_bytes() == data
    err = capsys.readouterr().err
    assert f"warning: mirror file {target / 'artifact.bin'}: sha256 mismatch" in err
    assert "a: replaced a corrupt copy" in err
    assert sorted(p.name for p in target.iterdir()) == ["artifact.bin"]
    # With the pin already cached, the target file is still re-verified and repaired.
    (target / "artifact.bin").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    run_main("mirror", "--lock", str(lock), "--cache", str(tmp_path / "c"), str(target))
    assert (target / "artifact.bin").read_bytes() == data
    run_main("mirror", "--lock", str(lock), "--cache", str(tmp_path / "c"), str(target))
    assert "a: present" in capsys.readouterr().err


def test_out_rerun_leaves_no_temp_link(tmp_path: Path, server: Server) -> None:
    data = b"payload" * 100
    server.routes["/a.bin"] = Route(data)
    lock = write_lock(tmp_path, {"a": file_pin(server.url("/a.bin"), data)})
    out = tmp_path / "out" / "a.whl"
    for _ in range(3):  # reruns hardlink the same CAS entry over an existing link to it
        run_main("fetch", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--pin", "a", "--out", str(out))
    assert out.read_bytes() == data and sorted(p.name for p in out.parent.iterdir()) == ["a.whl"]
    assert out.stat().st_ino == (tmp_path / "c" / "cas" / "sha256" / sha(data)).stat().st_ino


def test_bad_out_and_cache_paths_are_one_line_errors(tmp_path: Path, server: Server,
                                                     git_origin: GitOrigin) -> None:
    data = b"payload"
    server.routes["/a.bin"] = Route(data)
    lock = write_lock(tmp_path, {"a": file_pin(server.url("/a.bin"), data), "t": tree_pin(git_origin)})
    cache = tmp_path / "c"
    outdir = tmp_path / "outdir"
    outdir.mkdir()
    with pytest.raises(UserError) as e:
        fetch.main(["fetch", "--lock", str(lock), "--cache", str(cache), "--pin", "a", "--out", str(outdir)])
    assert f"--out {outdir} is a directory" in one_line(e.value)
    assert list(outdir.iterdir()) == [] and server.hits.get("/a.bin") is None  # refused before the download
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(UserError) as e:
        fetch.main(["fetch", "--lock", str(lock), "--cache", str(cache), "--pin", "a", "--out", str(afile / "a.whl")])
    assert f"{afile} is a file, not a directory" in one_line(e.value)
    with pytest.raises(UserError) as e:  # git_tree pins unpack into a directory
        fetch.main(["fetch", "--lock", str(lock), "--cache", str(cache), "--pin", "t", "--out", str(afile)])
    assert f"--out {afile} is a file, not a directory" in one_line(e.value) and afile.read_text() == "x"
    for argv, named in ((["--cache", str(afile)], f"--cache {afile} is a file"),
                        (["--cache", str(afile / "sub")], f"--cache {afile / 'sub'}: {afile} is a file")):
        with pytest.raises(UserError) as e:
            fetch.main(["fetch", "--lock", str(lock), *argv, "--pin", "a"])
        assert named in one_line(e.value)
    with pytest.raises(UserError) as e:
        fetch.main(["mirror", "--lock", str(lock), "--cache", str(cache), str(afile)])
    assert f"mirror {afile} is a file, not a directory" in one_line(e.value)
    # Through the CLI: exit 2 and one line, no traceback.
    proc = subprocess.run(fetch_cmd(lock, afile, "a"), capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert afile.read_text() == "x"


# Unreadable, unwritable and full places. The tests run as root, whom file modes do not bind: the
# CLI runs without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (dropped from its bounding set before
# exec), so a mode denies it as it denies any user. A full disk is a 1 MiB tmpfs in a private mount
# namespace of the CLI's own.
PR_CAPBSET_DROP = 24
CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 1, 2


def without_file_mode_override() -> None:
    """preexec_fn: drop the capabilities that let root ignore file modes."""
    if os.geteuid() != 0:
        return  # file modes already apply
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), f"prctl(PR_CAPBSET_DROP, {cap})")


def run_denied(argv: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, preexec_fn=without_file_mode_override,
                          env={**os.environ, **env}, timeout=60)


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *parts: str) -> str:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    line = proc.stderr.splitlines()[-1]
    assert line.startswith("error: ") and all(part in line for part in parts), (parts, proc.stderr)
    return line


def test_unreadable_mirrors_are_skipped_sources(tmp_path: Path, server: Server) -> None:
    data = os.urandom(50_000)
    closed_dir = mirror_with(tmp_path, "closed-dir", data)
    closed_dir.chmod(0)
    closed_file = mirror_with(tmp_path, "closed-file", data)
    (closed_file / "artifact.bin").chmod(0)
    good = mirror_with(tmp_path, "good", data)
    try:
        assert run_denied([sys.executable, "-c", f"open({str(closed_file / 'artifact.bin')!r}).close()"]).returncode, \
            "the CLI's access is not really denied here"
        lock = write_lock(tmp_path, {"a": file_pin(closed_port_url(), data)})
        proc = run_denied([*fetch_cmd(lock, tmp_path / "c", "a"), "--mirror", str(closed_dir), "--mirror",
                           str(closed_file), "--mirror", str(good)])
        assert proc.returncode == 0 and proc.stdout.strip() == str(tmp_path / "c" / "cas" / "sha256" / sha(data)), \
            proc.stderr
        warnings = [line for line in proc.stderr.splitlines() if "warning" in line]
        assert len(warnings) == 2 and "Traceback" not in proc.stderr, proc.stderr
        for mirror, line in zip((closed_dir, closed_file), warnings):
            assert f"mirror file {mirror / 'artifact.bin'}: cannot read it (Permission denied" in line, line
            assert line.endswith("skipping this source"), line
        # Then the origin: an unreadable mirror is only a skipped source.
        server.routes["/a.bin"] = Route(data)
        lock = write_lock(tmp_path, {"a": file_pin(server.url("/a.bin"), data)})
        proc = run_denied([*fetch_cmd(lock, tmp_path / "c2", "a"), "--mirror", str(closed_file)])
        assert proc.returncode == 0 and server.hits["/a.bin"] == 1, proc.stderr
    finally:
        closed_dir.chmod(0o755)


def test_unwritable_or_dangling_cache_is_one_line_naming_it(tmp_path: Path) -> None:
    data = b"wheel bytes"
    mirror = mirror_with(tmp_path, "mirror", data)
    lock = write_lock(tmp_path, {"a": file_pin(closed_port_url(), data)})
    cache = tmp_path / "read-only-cache"
    cache.mkdir(mode=0o555)
    proc = run_denied([*fetch_cmd(lock, cache, "a"), "--mirror", str(mirror)])
    assert_one_line_error(proc, f"cannot write {cache / 'locks'} (Permission denied)",
                          f"make {cache} writable for this user, or pass a writable --cache")
    proc = run_denied([*FETCH_CLI, "fetch", "--lock", str(lock), "--mirror", str(mirror), "--pin", "a"],
                      KIMI_K3_CACHE=str(cache))
    assert_one_line_error(proc, "or set KIMI_K3_CACHE to a writable directory")
    assert list(cache.iterdir()) == []
    dangling = tmp_path / "cache-link"
    dangling.symlink_to(tmp_path / "gone")
    for value, named in ((dangling, f"KIMI_K3_CACHE {dangling} is a symlink to {tmp_path / 'gone'}"),
                         (dangling / "sub", f"KIMI_K3_CACHE {dangling / 'sub'}: {dangling} is a symlink to")):
        proc = subprocess.run([*FETCH_CLI, "fetch", "--lock", str(lock), "--mirror", str(mirror), "--pin", "a"],
                              capture_output=True, text=True, env={**os.environ, "KIMI_K3_CACHE": str(value)})
        assert_one_line_error(proc, named, "which does not exist; create its target or use another path")
    assert not (tmp_path / "gone").exists()


def run_on_full_disk(full: Path, argv: list[str], **env: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Run `argv` with a 1 MiB tmpfs mounted at `full` in a mount namespace of its own; returns its
    result and the files it left on that tmpfs (gone with the namespace)."""
    full.mkdir(parents=True, exist_ok=True)
    listing = full.parent / f"{full.name}.left"
    # The mount holding `full` is made private (in the new namespace only), so the tmpfs never
    # propagates out of it; not / (`unshare --propagation private`), which is no mount point where the
    # test runs chrooted. In Bazel's sandbox two mounts stack at /tmp (the launcher's bind of the
    # host's, the sandbox's own above it): findmnt names the point once per mount.
    script = ('top=$(findmnt -n -o TARGET -T "$0" | head -n 1) && mount --make-rprivate "$top" && '
              'mount -t tmpfs -o size=1m kimi-k3-full "$0" || exit 99; '
              '"$@"; rc=$?; find "$0" -type f | sort > "$0.left"; exit $rc')
    proc = subprocess.run(["unshare", "--mount", "--propagation", "unchanged", "sh", "-c", script, str(full), *argv],
                          capture_output=True, text=True, timeout=60, env={**os.environ, **env})
    assert proc.returncode != 99 and listing.exists(), f"cannot mount a tmpfs here: {proc.stderr}"
    assert "kimi-k3-full" not in Path("/proc/self/mountinfo").read_text(), "the tmpfs leaked out of its namespace"
    return proc, listing.read_text().splitlines()


NO_SPACE = "no space left on device writing"


def test_full_disk_reading_a_mirror_is_one_line_and_leaves_no_part(tmp_path: Path) -> None:
    data = os.urandom(3 << 20)  # more than the tmpfs holds
    mirror = mirror_with(tmp_path, "mirror", data)
    lock = write_lock(tmp_path, {"a": file_pin(closed_port_url(), data)})
    full = tmp_path / "full"
    proc, left = run_on_full_disk(full, [*fetch_cmd(lock, full / "cache", "a"), "--mirror", str(mirror)])
    assert_one_line_error(proc, f"{NO_SPACE} {full / 'cache' / 'tmp'}/",
                          ".part: free space or pass a --cache on a larger disk")
    assert "warning" not in proc.stderr, proc.stderr  # not a bad source: the mirror file is fine
    assert [p for p in left if "/locks/" not in p] == [], left  # entry lock files stay by design


def test_full_disk_downloading_is_not_a_network_error(tmp_path: Path, server: Server) -> None:
    data = os.urandom(3 << 20)
    server.routes["/a.bin"] = Route(data)
    lock = write_lock(tmp_path, {"a": file_pin(server.url("/a.bin"), data)})
    full = tmp_path / "full"
    proc, left = run_on_full_disk(full, [*FETCH_CLI, "fetch", "--lock", str(lock), "--pin", "a"],
                                  KIMI_K3_CACHE=str(full / "cache"))
    line = assert_one_line_error(proc, f"{NO_SPACE} {full / 'cache' / 'tmp'}/",
                                 ".part: free space or set KIMI_K3_CACHE to a larger disk")
    # One attempt, and no advice about the network or a proxy.
    assert "network" not in line and "retrying" not in proc.stderr and server.hits["/a.bin"] == 1, proc.stderr
    assert [p for p in left if "/locks/" not in p] == [], left


def test_full_disk_at_out_copy_leaves_nothing_there(tmp_path: Path) -> None:
    data = os.urandom(3 << 20)
    mirror = mirror_with(tmp_path, "mirror", data)
    lock = write_lock(tmp_path, {"a": file_pin(closed_port_url(), data)})
    full = tmp_path / "full"
    out = full / "out" / "artifact.bin"
    cache = tmp_path / "cache"
    proc, left = run_on_full_disk(full, [*fetch_cmd(lock, cache, "a", "--mirror", str(mirror)), "--out", str(out),
                                         "--copy"])
    assert_one_line_error(proc, f"{NO_SPACE} {out}: free space or put --out on a larger disk")
    assert left == [], left  # no partial copy, no temp file
    assert cas_entries(cache) == [cache / "cas" / "sha256" / sha(data)]  # the verified entry stays


def test_extract_refuses_an_interpreter_without_tar_filters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import io
    import tarfile

    tar_path = tmp_path / "t.tar"
    with tarfile.open(tar_path, "w") as tar:
        info = tarfile.TarInfo("../escape.txt")  # what the filter exists to refuse
        info.size = 3
        tar.addfile(info, io.BytesIO(b"bad"))
    dest = tmp_path / "x" / "out"
    dest.parent.mkdir()
    monkeypatch.delattr(tarfile, "data_filter")
    with pytest.raises(UserError) as e:
        place.extract_tar(tar_path, dest)
    assert "needs tarfile extraction filters" in one_line(e.value) and str(dest) in one_line(e.value)
    assert list(dest.parent.iterdir()) == [] and not (tmp_path / "x" / "escape.txt").exists()


@pytest.mark.parametrize("value", ["../../../outside", "A" * 64, "a" * 63, "a" * 64 + "\n", "a" * 65, "g" * 64])
def test_evict_sha256_accepts_only_a_sha256(tmp_path: Path, value: str) -> None:
    cache = tmp_path / "deep" / "er" / "cache"
    cache.mkdir(parents=True)
    victim = tmp_path / "outside"
    victim.write_text("keep me")
    lock = write_lock(tmp_path, {})
    with pytest.raises(UserError) as e:
        fetch.main(["evict", "--lock", str(lock), "--cache", str(cache), "--sha256", value])
    assert "pass exactly 64 lowercase hex digits" in one_line(e.value)
    assert victim.read_text() == "keep me" and list(cache.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deep", "outside", "pins.lock.json"]


def test_evict_sha256_of_an_absent_entry_is_nothing_to_evict(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    lock = write_lock(tmp_path, {})
    assert fetch.main(["evict", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--sha256", "a" * 64]) == 0
    assert "nothing to evict" in capsys.readouterr().err


def test_progress_reports_bytes_rate_and_final_line(tmp_path: Path, server: Server,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    data = os.urandom(2 << 20)
    server.routes["/a.bin"] = Route(data, mode="slow", chunk_delay_s=0.03)  # ~1 s: a few progress lines
    lock = write_lock(tmp_path, {"a": file_pin(server.url("/a.bin"), data)})
    run_main("fetch", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--pin", "a")
    err = capsys.readouterr().err.splitlines()
    assert any("ETA" in line and "MB/s" in line for line in err), err
    assert err[-1].startswith("fetch a: downloaded from") and "2.1 MB" in err[-1]


# ---------------------------------------------------------------------------------------------
# git pins


def test_git_diff_from_origin_repository(tmp_path: Path, git_origin: GitOrigin) -> None:
    lock = write_lock(tmp_path, {"d": diff_pin(git_origin)})
    out = tmp_path / "d.diff"
    run_main("fetch", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--pin", "d", "--out", str(out))
    assert out.read_bytes() == git_origin.diff
    assert b"GIT binary patch" in git_origin.diff and "naïve.py".encode() in git_origin.diff


def test_git_diff_from_mirror_bare_repository(tmp_path: Path, git_origin: GitOrigin) -> None:
    repository = "https://github.invalid/acme/widget"
    mirror = tmp_path / "mirror"
    repo = mirror / "git" / "github.invalid" / "acme" / "widget.git"
    repo.parent.mkdir(parents=True)
    git("clone", "-q", "--bare", str(git_origin.work), str(repo))
    lock = write_lock(tmp_path, {"d": diff_pin(git_origin, repository=repository)})
    path = run_main("fetch", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--mirror", str(mirror),
                    "--pin", "d")
    assert Path(path).read_bytes() == git_origin.diff


def test_git_tree_mismatch_is_an_error(tmp_path: Path, git_origin: GitOrigin) -> None:
    lock = write_lock(tmp_path, {"d": diff_pin(git_origin, commit_tree=git_origin.parent_tree)})
    with pytest.raises(UserError) as e:
        fetch.main(["fetch", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--pin", "d"])
    message = one_line(e.value)
    assert f"commit {git_origin.commit}" in message and f"has tree {git_origin.commit_tree}" in message
    assert f"commit_tree is {git_origin.parent_tree}" in message
    assert cas_entries(tmp_path / "c") == []


def test_git_missing_commit_is_an_error(tmp_path: Path, git_origin: GitOrigin) -> None:
    lock = write_lock(tmp_path, {"d": diff_pin(git_origin, commit="1" * 40)})
    with pytest.raises(UserError) as e:
        fetch.main(["fetch", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--pin", "d"])
    message = one_line(e.value)
    assert "pin 'd'" in message and git_origin.url in message


def test_git_diff_sha_mismatch_is_an_error(tmp_path: Path, git_origin: GitOrigin) -> None:
    lock = write_lock(tmp_path, {"d": diff_pin(git_origin, sha256="f" * 64)})
    with pytest.raises(UserError) as e:
        fetch.main(["fetch", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--pin", "d"])
    message = one_line(e.value)
    assert f"has sha256 {sha(git_origin.diff)}, expected {'f' * 64}" in message
    assert cas_entries(tmp_path / "c") == []


def test_git_diff_missing_everywhere_says_how_to_fill_a_mirror(tmp_path: Path, git_origin: GitOrigin) -> None:
    lock = write_lock(tmp_path, {"flashinfer-pr4460": diff_pin(git_origin, repository=f"file://{tmp_path}/gone/a/b.git")})
    with pytest.raises(UserError) as e:
        fetch.main(["fetch", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--mirror", str(tmp_path / "empty"),
                    "--pin", "flashinfer-pr4460"])
    message = one_line(e.value)
    assert "pin 'flashinfer-pr4460'" in message and "is missing" in message
    assert "python3 -m tools.fetch mirror --pin flashinfer-pr4460 --mirror DIR" in message
    assert "--from-git flashinfer-pr4460=CHECKOUT" in message
    assert "`pypi` stack builds without it (`--config=pypi`)" in message


def test_corrupt_mirror_diff_falls_through_to_the_git_origin(tmp_path: Path, git_origin: GitOrigin,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / "widget-feature.diff").write_bytes(git_origin.diff.replace(b"x * 2", b"x * 3"))
    lock = write_lock(tmp_path, {"d": diff_pin(git_origin)})
    path = run_main("fetch", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--mirror", str(mirror),
                    "--pin", "d")
    assert Path(path).read_bytes() == git_origin.diff
    assert f"warning: mirror file {mirror / 'widget-feature.diff'}: sha256 mismatch" in capsys.readouterr().err


def test_git_tree_fetch_is_deterministic_and_extracts(tmp_path: Path, git_origin: GitOrigin) -> None:
    lock = write_lock(tmp_path, {"t": tree_pin(git_origin)})
    first = Path(run_main("fetch", "--lock", str(lock), "--cache", str(tmp_path / "c1"), "--pin", "t"))
    second = Path(run_main("fetch", "--lock", str(lock), "--cache", str(tmp_path / "c2"), "--pin", "t"))
    assert first.name == second.name == sha(first.read_bytes())  # same tar bytes from two caches
    out = tmp_path / "src"
    run_main("fetch", "--lock", str(lock), "--cache", str(tmp_path / "c1"), "--pin", "t", "--out", str(out))
    assert (out / "csrc" / "moe.cu").read_text().startswith("int act(int x) { return x * 2; }")
    assert (out / "data.bin").read_bytes() == bytes(range(256)) * 4
    first.chmod(0o644)
    first.write_bytes(b"corrupt")
    with pytest.raises(UserError, match="is corrupt"):
        fetch.main(["fetch", "--lock", str(lock), "--cache", str(tmp_path / "c1"), "--pin", "t"])


def test_git_tree_mismatch(tmp_path: Path, git_origin: GitOrigin) -> None:
    lock = write_lock(tmp_path, {"t": tree_pin(git_origin, tree=git_origin.parent_tree)})
    with pytest.raises(UserError, match=f"lock's tree is {git_origin.parent_tree}"):
        fetch.main(["fetch", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--pin", "t"])


def archived_tree_pin(tmp_path: Path, origin: GitOrigin, **override: Any) -> dict[str, Any]:
    """A git_tree pin with its archive pinned too (filename + sha256), as add-git-tree writes it."""
    (tmp_path / "plain").mkdir(exist_ok=True)
    lock = write_lock(tmp_path / "plain", {"t": tree_pin(origin)})
    tar = Path(run_main("fetch", "--lock", str(lock), "--cache", str(tmp_path / "plain" / "c"), "--pin", "t"))
    return tree_pin(origin, filename="widget-tree.tar", sha256=sha(tar.read_bytes()), **override)


def test_archived_git_tree_from_a_local_checkout_fills_a_mirror_that_serves_it_offline(
        tmp_path: Path, git_origin: GitOrigin) -> None:
    # The FlashKDA path: a GitHub-only repository that this host reaches only through a mirror
    # filled from a local clone (`mirror --from-git PIN=CHECKOUT`).
    pin = archived_tree_pin(tmp_path, git_origin, repository="https://github.invalid/acme/kda")
    lock = write_lock(tmp_path, {"kda": pin})
    mirror = tmp_path / "mirror"
    run_main("mirror", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--mirror", str(mirror), "--from-git",
             f"kda={git_origin.work}")
    assert sha((mirror / "widget-tree.tar").read_bytes()) == pin["sha256"]
    assert (mirror / "git" / "github.invalid" / "acme" / "kda.git").is_dir()
    tar = Path(run_main("fetch", "--lock", str(lock), "--cache", str(tmp_path / "fresh"), "--mirror", str(mirror),
                        "--pin", "kda", "--out", str(tmp_path / "kda.tar"), "--archive"))
    assert tar == tmp_path / "kda.tar" and sha(tar.read_bytes()) == pin["sha256"]
    # The bare repository alone serves it too (the tar is rendered again, to the same bytes).
    (mirror / "widget-tree.tar").unlink()
    again = Path(run_main("fetch", "--lock", str(lock), "--cache", str(tmp_path / "fresh2"), "--mirror", str(mirror),
                          "--pin", "kda"))
    assert sha(again.read_bytes()) == pin["sha256"]


def test_archived_git_tree_without_github_or_mirror_is_one_line_saying_how_to_fill_the_mirror(
        tmp_path: Path, git_origin: GitOrigin) -> None:
    pin = archived_tree_pin(tmp_path, git_origin, repository=f"file://{tmp_path}/gone/acme/kda.git")
    lock = write_lock(tmp_path, {"flashkda": pin})
    with pytest.raises(UserError) as e:
        fetch.main(["fetch", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--mirror", str(tmp_path / "empty"),
                    "--pin", "flashkda", "--out", str(tmp_path / "out.tar"), "--archive"])
    message = one_line(e.value)
    assert message.startswith("pin 'flashkda' (widget-tree.tar) is missing")
    assert "python3 -m tools.fetch mirror --pin flashkda --mirror DIR" in message
    assert "--from-git flashkda=CHECKOUT" in message and "only targets built from it need it" in message
    assert not (tmp_path / "out.tar").exists() and cas_entries(tmp_path / "c") == [] and tmp_entries(tmp_path / "c") == []


def test_git_tree_without_archive_missing_everywhere_says_how_to_fill_the_mirror(tmp_path: Path,
                                                                                git_origin: GitOrigin) -> None:
    lock = write_lock(tmp_path, {"flashkda-cutlass": tree_pin(git_origin, repository=f"file://{tmp_path}/gone/n/c.git")})
    with pytest.raises(UserError) as e:
        fetch.main(["fetch", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--pin", "flashkda-cutlass"])
    message = one_line(e.value)
    assert message.startswith("pin 'flashkda-cutlass' is missing")
    assert "python3 -m tools.fetch mirror --pin flashkda-cutlass --mirror DIR" in message
    assert "--from-git flashkda-cutlass=CHECKOUT" in message


def test_archived_git_tree_with_another_sha256_is_refused_and_leaves_nothing(tmp_path: Path,
                                                                           git_origin: GitOrigin) -> None:
    lock = write_lock(tmp_path, {"t": tree_pin(git_origin, filename="t.tar", sha256="b" * 64)})
    with pytest.raises(UserError) as e:
        fetch.main(["fetch", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--pin", "t"])
    message = one_line(e.value)
    assert "pin 't': `git archive` of" in message and "expected " + "b" * 64 in message
    assert "python3 -m tools.fetch mirror --pin t --mirror DIR" in message
    assert cas_entries(tmp_path / "c") == [] and tmp_entries(tmp_path / "c") == []


def test_archived_git_tree_needs_filename_and_sha256_together(tmp_path: Path, git_origin: GitOrigin) -> None:
    lock = write_lock(tmp_path, {"t": tree_pin(git_origin, sha256="b" * 64)})
    with pytest.raises(UserError) as e:
        fetch.main(["verify", "--lock", str(lock)])
    assert "pin 't': filename is missing: a git_tree pin's archive needs both filename and sha256" in one_line(e.value)


def test_archive_flag_is_for_git_tree_pins_only(tmp_path: Path) -> None:
    lock = write_lock(tmp_path, {"x": good_file_pin()})
    with pytest.raises(UserError, match="fetch --archive: pin 'x' is a file pin"):
        fetch.main(["fetch", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--pin", "x", "--archive"])


def test_add_git_tree_records_tree_and_archive_sha(tmp_path: Path, git_origin: GitOrigin) -> None:
    lock = write_lock(tmp_path, {})
    run_main("add-git-tree", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--name", "kda", "--repository",
             "https://github.invalid/acme/kda", "--commit", git_origin.commit, "--from-git", str(git_origin.work))
    entry = json.loads(lock.read_text())["pins"]["kda"]
    assert entry["tree"] == git_origin.commit_tree and entry["filename"] == f"kda-{git_origin.commit[:8]}.tar"
    expected = archived_tree_pin(tmp_path, git_origin)["sha256"]
    assert entry["sha256"] == expected


# ---------------------------------------------------------------------------------------------
# mirror command


def test_mirror_fills_a_dir_that_serves_an_offline_fetch(tmp_path: Path, server: Server,
                                                          git_origin: GitOrigin) -> None:
    data = os.urandom(10_000)
    server.routes["/w.whl"] = Route(data)
    repository = git_origin.url
    lock = write_lock(tmp_path, {"w": file_pin(server.url("/w.whl"), data, "w.whl"),
                                 "d": diff_pin(git_origin), "t": tree_pin(git_origin),
                                 "other": file_pin(closed_port_url(), b"not in the stack", "o.whl")},
                      {"s": {"sglang": "w", "patch_pins": ["d", "t"]}})
    mirror = tmp_path / "mirror"
    run_main("mirror", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--mirror", str(mirror), "--stack", "s")
    assert (mirror / "w.whl").read_bytes() == data
    assert (mirror / "widget-feature.diff").read_bytes() == git_origin.diff
    assert not (mirror / "o.whl").exists()
    bare = fetch_git.mirror_repo_path(mirror, repository)
    assert bare.is_dir() and git("--git-dir", str(bare), "rev-parse", f"{git_origin.parent}^{{tree}}")
    # Offline: origin server and origin repository gone, fresh cache.
    server.stop()
    import shutil

    shutil.rmtree(git_origin.bare)
    for pin in ("w", "d", "t"):
        run_main("fetch", "--lock", str(lock), "--cache", str(tmp_path / "fresh"), "--mirror", str(mirror),
                 "--pin", pin)
    # The bare repository alone also serves the diff.
    (mirror / "widget-feature.diff").unlink()
    path = run_main("fetch", "--lock", str(lock), "--cache", str(tmp_path / "fresh2"), "--mirror", str(mirror),
                    "--pin", "d")
    assert Path(path).read_bytes() == git_origin.diff


def test_mirror_from_local_checkout(tmp_path: Path, git_origin: GitOrigin) -> None:
    lock = write_lock(tmp_path, {"flashinfer-pr4460": diff_pin(git_origin, repository="https://github.invalid/a/b")})
    mirror = tmp_path / "mirror"
    run_main("mirror", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--mirror", str(mirror), "--from-git",
             f"flashinfer-pr4460={git_origin.work}")
    assert (mirror / "widget-feature.diff").read_bytes() == git_origin.diff
    assert (mirror / "git" / "github.invalid" / "a" / "b.git").is_dir()
    with pytest.raises(UserError, match="expected PIN=CHECKOUT"):
        fetch.main(["mirror", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--mirror", str(mirror),
                    "--from-git", str(git_origin.work)])


# ---------------------------------------------------------------------------------------------
# lock editing: add-git-diff (add-pypi is tools.pins.pypi's: tests/cpu/pins/test_pypi.py), verify


def test_add_git_diff_records_trees_and_canonical_sha(tmp_path: Path, git_origin: GitOrigin) -> None:
    lock = write_lock(tmp_path, {})
    run_main("add-git-diff", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--name", "widget-pr1",
             "--repository", "https://github.invalid/acme/widget", "--commit", git_origin.commit,
             "--from-git", str(git_origin.work))
    pin = lockfile.load(lock).pins["widget-pr1"]
    assert isinstance(pin, lockfile.GitDiffPin)
    assert (pin.parent, pin.parent_tree, pin.commit_tree) == (git_origin.parent, git_origin.parent_tree,
                                                             git_origin.commit_tree)
    assert pin.sha256 == sha(git_origin.diff) and pin.filename == f"widget-pr1-{git_origin.commit[:8]}.diff"
    # The diff went into the CAS, so fetching the new pin needs no source at all.
    assert Path(run_main("fetch", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--pin",
                         "widget-pr1")).read_bytes() == git_origin.diff


def test_add_pypi_is_not_a_fetch_command(tmp_path: Path) -> None:
    # One CLI owns each command: wheel pins are tools.pins.pypi's (the fetch CLI no longer
    # imports tools.pins.pypi, which would make the package graph a circle).
    proc = subprocess.run([*FETCH_CLI, "add-pypi", "--lock", str(write_lock(tmp_path, {})), "x==1"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "run `python3 -m tools.pins.pypi add-pypi NAME==VERSION`" in proc.stderr
    # and fetch's own parser has no such command
    assert "add-pypi" not in fetch.build_parser().format_help()


def test_add_git_diff_from_a_shallow_mirror_needs_the_parent(tmp_path: Path, git_origin: GitOrigin) -> None:
    repository = "https://github.invalid/acme/widget"
    lock = write_lock(tmp_path, {"d": diff_pin(git_origin, repository=repository)})
    mirror = tmp_path / "mirror"
    run_main("mirror", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--mirror", str(mirror),
             "--from-git", f"d={git_origin.work}")  # the mirror's repository holds each commit at depth 1
    (tmp_path / "t").mkdir()
    target = write_lock(tmp_path / "t", {})
    before = target.read_bytes()
    argv = ["add-git-diff", "--lock", str(target), "--cache", str(tmp_path / "c2"), "--mirror", str(mirror),
            "--name", "widget-pr1", "--repository", repository, "--commit", git_origin.commit]
    with pytest.raises(UserError) as e:
        fetch.main(argv)
    assert "comes without its parent" in one_line(e.value) and "pass --parent PARENT" in one_line(e.value)
    assert target.read_bytes() == before
    run_main(*argv, "--parent", git_origin.parent)
    assert lockfile.load(target).pins["widget-pr1"].sha256 == sha(git_origin.diff)


def test_verify_prints_a_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lock = write_lock(tmp_path, {"a": file_pin("https://files.example/a.whl", b"a" * 2000)},
                      {"s": {"sglang": "a", "wheels": ["a"]}})
    assert fetch.main(["verify", "--lock", str(lock)]) == 0
    out = capsys.readouterr().out
    assert "a    file  2.0 KB" in out and "stack s: 1 pins (1 wheels)" in out and "OK, 1 pins, 1 stacks" in out


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


def test_extract_refuses_a_users_directory_and_replaces_its_own(tmp_path: Path) -> None:
    import io
    import tarfile

    tar_path = tmp_path / "t.tar"
    with tarfile.open(tar_path, "w") as tar:
        info = tarfile.TarInfo("src/a.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"a\n"))
    users = tmp_path / "mine"
    users.mkdir()
    (users / "notes.txt").write_text("keep\n")
    with pytest.raises(UserError) as e:
        place.extract_tar(tar_path, users)
    assert one_line(e.value).startswith(f"--out {users}: exists, is not empty and holds files that tools.fetch")
    assert [p.name for p in users.iterdir()] == ["notes.txt"]
    ours = tmp_path / "tree"
    place.extract_tar(tar_path, ours)
    place.extract_tar(tar_path, ours)  # a rerun replaces its own output
    assert (ours / "src" / "a.txt").read_bytes() == b"a\n"
