"""tools/pins/pypi.py: wheel selection and stack closures, against a fake index on 127.0.0.1.

The closure test runs the real `pip install --dry-run --report` (pip from the test interpreter)
against tiny wheels this file builds, so it checks the pip flags as well as the lock writing.
"""
from __future__ import annotations

import hashlib
import http.server
import io
import json
import subprocess
import sys
import threading
import zipfile
from pathlib import Path
from typing import Any, Iterator

import pytest

REPO_ROOT = Path(__file__).absolute().parents[3]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tools.pins import lock as lockfile  # noqa: E402

from tools.pins import pypi as pypi_lock
from tools.common.errors import UserError  # noqa: E402


def make_wheel(project: str, version: str, tag: str = "py3-none-any", requires: tuple[str, ...] = ()) -> tuple[str, bytes]:
    dist = f"{project.replace('-', '_')}-{version}"
    metadata = "\n".join(["Metadata-Version: 2.1", f"Name: {project}", f"Version: {version}",
                          *(f"Requires-Dist: {r}" for r in requires)]) + "\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(f"{dist}.dist-info/METADATA", metadata)
        zf.writestr(f"{dist}.dist-info/WHEEL", f"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: {tag}\n")
        zf.writestr(f"{dist}.dist-info/RECORD", "")
    return f"{dist}-{tag}.whl", buf.getvalue()


class FakeIndex:
    """A PEP 503 (HTML) + PEP 691 (JSON) simple index of in-memory files."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.projects: dict[str, list[str]] = {}
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/simple"

    def add(self, project: str, filename: str, body: bytes) -> None:
        self.files[filename] = body
        self.projects.setdefault(pypi_lock.normalize(project), []).append(filename)

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def reply(self, body: bytes, content_type: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                parts = [p for p in self.path.split("/") if p]
                if len(parts) == 2 and parts[0] == "files" and parts[1] in index.files:
                    self.reply(index.files[parts[1]], "application/octet-stream")
                    return
                if len(parts) == 2 and parts[0] == "simple" and parts[1] in index.projects:
                    names = index.projects[parts[1]]
                    if "json" in self.headers.get("Accept", ""):
                        files = [{"filename": n, "url": f"../../files/{n}", "size": len(index.files[n]),
                                  "hashes": {"sha256": hashlib.sha256(index.files[n]).hexdigest()}} for n in names]
                        self.reply(json.dumps({"meta": {"api-version": "1.1"}, "files": files}).encode(),
                                   pypi_lock.SIMPLE_JSON)
                        return
                    links = "".join(f'<a href="../../files/{n}#sha256={hashlib.sha256(index.files[n]).hexdigest()}">{n}</a>\n'
                                    for n in names)
                    self.reply(f"<html><body>{links}</body></html>".encode(), "text/html")
                    return
                self.send_error(404)

        return Handler


@pytest.fixture()
def index(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeIndex]:
    monkeypatch.setenv("KIMI_K3_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("KIMI_K3_MIRROR", raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    fake = FakeIndex()
    yield fake
    fake.httpd.shutdown()
    fake.httpd.server_close()


def pin_for(index: FakeIndex, filename: str, project: str, version: str) -> dict[str, Any]:
    body = index.files[filename]
    return {"kind": "file", "package": {"name": project, "version": version}, "filename": filename,
            "urls": [index.url.replace("/simple", f"/files/{filename}")],
            "sha256": hashlib.sha256(body).hexdigest(), "size": len(body)}


def fake_stack(index: FakeIndex, tmp_path: Path, sglang_requires: tuple[str, ...],
               overrides: list[str] | None = None) -> Path:
    for project, version, tag, requires in [
        ("sglang", "1.0", "cp311-cp311-manylinux_2_34_x86_64", sglang_requires),
        ("flashinfer-python", "1.0", "py3-none-any", ("dep-a>=1",)),
        ("dep-a", "1.0", "py3-none-any", ()),
        ("dep-a", "0.9", "py3-none-any", ()),
        ("dep-b", "2.0", "py3-none-any", ()),
        ("torch", "2.0", "cp311-cp311-manylinux_2_28_x86_64", ("dep-a",)),
        ("torch", "2.0", "cp311-cp311-manylinux_2_28_aarch64", ()),
        ("tile", "1.0", "cp311-cp311-manylinux2014_x86_64", ()),
    ]:
        filename, body = make_wheel(project, version, tag, requires)
        index.add(project, filename, body)
    index.add("tile", "tile-1.0rc5.tar.gz", b"not a real sdist")
    stack: dict[str, Any] = {"sglang": "sglang-1.0", "flashinfer": "flashinfer-python-1.0"}
    if overrides:
        stack["closure_overrides"] = overrides
    lock = tmp_path / "pins.lock.json"
    lockfile.write(lock, {"schema_version": 1, "pins": {
        "sglang-1.0": pin_for(index, "sglang-1.0-cp311-cp311-manylinux_2_34_x86_64.whl", "sglang", "1.0"),
        "flashinfer-python-1.0": pin_for(index, "flashinfer_python-1.0-py3-none-any.whl", "flashinfer-python", "1.0"),
    }, "stacks": {"s": stack}})
    return lock


def test_lock_closure_records_every_wheel_of_the_stack(index: FakeIndex, tmp_path: Path) -> None:
    lock = fake_stack(index, tmp_path, ("dep-a==1.0", "torch==2.0", "dep-b>=2; extra == 'x'"))
    summary = pypi_lock.lock_closure(lock, "s", index_url=index.url)
    assert summary["wheels"] == 4 and summary["flashinfer_companions"] == []
    loaded = lockfile.load(lock)
    stack = loaded.stacks["s"]
    assert stack.wheels == ("dep-a-1.0", "flashinfer-python-1.0", "sglang-1.0", "torch-2.0")
    assert stack.roles["torch"] == "torch-2.0"
    torch = loaded.pins["torch-2.0"]
    assert isinstance(torch, lockfile.FilePin)
    assert torch.filename == "torch-2.0-cp311-cp311-manylinux_2_28_x86_64.whl"  # not the aarch64 one
    assert torch.size == len(index.files[torch.filename])
    assert torch.sha256 == hashlib.sha256(index.files[torch.filename]).hexdigest()
    assert lock.read_text() == lockfile.canonical_text(json.loads(lock.read_text()))


def test_lock_closure_needs_override_for_a_source_only_pin(index: FakeIndex, tmp_path: Path) -> None:
    lock = fake_stack(index, tmp_path, ("tile==1.0rc5", "dep-a"))
    with pytest.raises(UserError, match="pip could not resolve"):
        pypi_lock.lock_closure(lock, "s", index_url=index.url)
    lock = fake_stack(index, tmp_path, ("tile==1.0rc5", "dep-a"), overrides=["tile==1.0"])
    pypi_lock.lock_closure(lock, "s", index_url=index.url)
    wheels = lockfile.load(lock).stacks["s"].wheels
    assert "tile-1.0" in wheels and "sglang-1.0" in wheels


def test_apply_overrides_rejects_an_unused_override() -> None:
    assert pypi_lock.apply_overrides(["Cuda_Tile==1.6.0rc5", "x"], ["cuda-tile==1.6.0"], "s") == ["cuda-tile==1.6.0", "x"]
    with pytest.raises(UserError, match="not a requirement of s"):
        pypi_lock.apply_overrides(["x"], ["y==1"], "s")


def test_compatible_platforms_expand_older_manylinux() -> None:
    tags = pypi_lock.compatible_platforms("manylinux_2_34_x86_64")
    assert tags[0] == "manylinux_2_34_x86_64" and "manylinux_2_28_x86_64" in tags and "manylinux2014_x86_64" in tags
    assert "manylinux_2_35_x86_64" not in tags
    assert pypi_lock.compatible_platforms("win_amd64") == ["win_amd64"]


@pytest.mark.parametrize(("filename", "ok"), [
    ("a-1-cp311-cp311-manylinux_2_34_x86_64.whl", True),
    ("a-1-cp311-cp311-manylinux_2_35_x86_64.whl", False),
    ("a-1-cp310-abi3-manylinux2014_x86_64.whl", True),
    ("a-1-cp312-abi3-manylinux2014_x86_64.whl", False),
    ("a-1-cp310-cp310-manylinux2014_x86_64.whl", False),
    ("a-1-py3-none-any.whl", True),
    ("a-1-py2.py3-none-any.whl", True),
    ("a-1-cp311-cp311-manylinux_2_28_aarch64.whl", False),
])
def test_wheel_compatibility(filename: str, ok: bool) -> None:
    wheel = pypi_lock.parse_wheel_filename(filename)
    assert wheel is not None
    compatible = (pypi_lock.python_rank(wheel, "3.11") is not None
                  and pypi_lock.platform_rank(wheel, "manylinux_2_34_x86_64") is not None)
    assert compatible == ok



# ---------------------------------------------------------------------------------------------
# lockfile.py validation: whole-value patterns, unreadable locks


def schema_lock(tmp_path: Path, pins: dict[str, Any], stacks: dict[str, Any] | None = None) -> Path:
    path = tmp_path / "pins.lock.json"
    path.write_text(json.dumps({"schema_version": 1, "pins": pins, "stacks": stacks or {}}))
    return path


def a_file_pin(**override: Any) -> dict[str, Any]:
    return {"kind": "file", "filename": "a.whl", "urls": ["https://example.com/a.whl"], "sha256": "a" * 64,
            **override}


def a_diff_pin(**override: Any) -> dict[str, Any]:
    return {"kind": "git_diff", "repository": "https://h/o/r", "commit": "1" * 40, "commit_tree": "2" * 40,
            "parent": "3" * 40, "parent_tree": "4" * 40, "filename": "g.diff", "sha256": "b" * 64, **override}


@pytest.mark.parametrize(("pins", "stacks", "expected"), [
    ({"a": a_file_pin(sha256="a" * 64 + "\n")}, {}, "pin 'a': sha256 must be 64 lowercase hex chars"),
    ({"a": a_file_pin(filename="a.whl\n")}, {}, "pin 'a': filename must be a plain file name"),
    ({"a\n": a_file_pin()}, {}, "pin name 'a\\n' must match"),
    ({"g": a_diff_pin(commit="1" * 40 + "\n")}, {}, "pin 'g': commit must be a full 40-char lowercase hex"),
    ({"a": a_file_pin()}, {"s": {"sglang": "a", "closure_overrides": ["x==1\n"]}},
     "stack 's': closure_overrides must hold NAME==VERSION requirements"),
])
def test_patterns_match_the_whole_value_not_a_trailing_newline(tmp_path: Path, pins: dict[str, Any],
                                                               stacks: dict[str, Any], expected: str) -> None:
    lock = schema_lock(tmp_path, pins, stacks)
    with pytest.raises(UserError) as e:
        lockfile.load(lock)
    message = str(e.value)
    assert "\n" not in message and message.startswith(str(lock)) and expected in message, message
    from tools import fetch

    with pytest.raises(UserError):  # `verify` refuses it too, instead of passing a lock that can never fetch
        fetch.main(["verify", "--lock", str(lock)])


def test_is_sha256_is_exact() -> None:
    assert lockfile.is_sha256("0123456789abcdef" * 4)
    for bad in ("a" * 64 + "\n", "A" * 64, "a" * 63, "a" * 65, "../" + "a" * 61, ""):
        assert not lockfile.is_sha256(bad), bad


def test_unreadable_lock_is_a_one_line_error(tmp_path: Path) -> None:
    latin1 = tmp_path / "latin1.json"
    latin1.write_bytes('{"schema_version": 1, "pins": {}, "stacks": {"s": {"description": "caf\u00e9"}}}'
                       .encode("latin-1"))
    with pytest.raises(UserError) as e:
        lockfile.load(latin1)
    message = str(e.value)
    assert "\n" not in message and message.startswith(str(latin1)) and "is not UTF-8 text (byte 0xe9" in message
    with pytest.raises(UserError, match="is a directory, not a lock file"):
        lockfile.load(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "tools.fetch", "verify", "--lock", str(latin1)],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr

if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
