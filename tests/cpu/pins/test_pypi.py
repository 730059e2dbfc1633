"""tools/pins/pypi.py: add-pypi, wheel selection and stack closures, against a fake index on 127.0.0.1.

The closure test runs the real `pip install --dry-run --report` (pip from the test interpreter)
against tiny wheels this file builds, so it checks the pip flags as well as the lock writing.
"""
from __future__ import annotations

import hashlib
import http.server
import io
import json
import os
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

from tools.common.errors import UserError  # noqa: E402
from tools.pins import lock as lockfile  # noqa: E402
from tools.pins import pypi as pypi_lock  # noqa: E402


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
    """A PEP 503 (HTML) + PEP 691 (JSON) simple index of in-memory files; `metadata` files are
    served as PEP 658 `<file>.metadata` with the sha256 in `core_metadata` (both may differ, to
    play a broken index). `hits` counts the GETs of each file."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.projects: dict[str, list[str]] = {}
        self.metadata: dict[str, bytes] = {}
        self.core_metadata: dict[str, str] = {}
        self.hits: dict[str, int] = {}
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/simple"

    def add(self, project: str, filename: str, body: bytes) -> None:
        self.files[filename] = body
        self.projects.setdefault(pypi_lock.normalize(project), []).append(filename)

    def add_metadata(self, filename: str, text: str) -> None:
        self.metadata[filename] = text.encode()
        self.core_metadata[filename] = hashlib.sha256(text.encode()).hexdigest()

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
                if len(parts) == 2 and parts[0] == "files":
                    index.hits[parts[1]] = index.hits.get(parts[1], 0) + 1
                if len(parts) == 2 and parts[0] == "files" and parts[1] in index.files:
                    self.reply(index.files[parts[1]], "application/octet-stream")
                    return
                if len(parts) == 2 and parts[0] == "files" and parts[1].endswith(".metadata") \
                        and parts[1][:-len(".metadata")] in index.metadata:
                    self.reply(index.metadata[parts[1][:-len(".metadata")]], "text/plain")
                    return
                if len(parts) == 2 and parts[0] == "simple" and parts[1] in index.projects:
                    names = index.projects[parts[1]]
                    if "json" in self.headers.get("Accept", ""):
                        files = [{"filename": n, "url": f"../../files/{n}", "size": len(index.files[n]),
                                  "hashes": {"sha256": hashlib.sha256(index.files[n]).hexdigest()},
                                  **({"core-metadata": {"sha256": index.core_metadata[n]}}
                                     if n in index.core_metadata else {})} for n in names]
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


SGLANG_WHEEL = "sglang-1.0-cp311-cp311-manylinux_2_34_x86_64.whl"


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


def metadata_text(project: str, version: str, requires: tuple[str, ...]) -> str:
    return "\n".join(["Metadata-Version: 2.1", f"Name: {project}", f"Version: {version}",
                      *(f"Requires-Dist: {r}" for r in requires)]) + "\n"


def test_closure_overrides_read_pep658_metadata_without_the_wheel(index: FakeIndex, tmp_path: Path) -> None:
    requires = ("tile==1.0rc5", "dep-a")
    lock = fake_stack(index, tmp_path, requires, overrides=["tile==1.0"])
    index.add_metadata(SGLANG_WHEEL, metadata_text("sglang", "1.0", requires))
    pypi_lock.lock_closure(lock, "s", index_url=index.url)
    wheels = lockfile.load(lock).stacks["s"].wheels
    assert "tile-1.0" in wheels and "sglang-1.0" in wheels and "dep-a-1.0" in wheels
    assert index.hits.get(SGLANG_WHEEL, 0) == 0 and index.hits[SGLANG_WHEEL + ".metadata"] == 1


def test_closure_overrides_refuse_metadata_the_index_does_not_vouch_for(index: FakeIndex, tmp_path: Path) -> None:
    # The index lists a metadata hash, but serves other bytes (no tile pin): the wheel itself is
    # read instead (hash-checked against the lock), so the override still finds its requirement.
    requires = ("tile==1.0rc5", "dep-a")
    lock = fake_stack(index, tmp_path, requires, overrides=["tile==1.0"])
    index.add_metadata(SGLANG_WHEEL, metadata_text("sglang", "1.0", requires))
    index.metadata[SGLANG_WHEEL] = metadata_text("sglang", "1.0", ("dep-a",)).encode()
    pypi_lock.lock_closure(lock, "s", index_url=index.url)
    assert "tile-1.0" in lockfile.load(lock).stacks["s"].wheels
    assert index.hits[SGLANG_WHEEL] == 1


def test_closure_overrides_read_only_the_locked_wheel(index: FakeIndex, tmp_path: Path) -> None:
    # The lock's sglang sha256 is not what the index and the URL serve: neither the index's
    # metadata nor the wheel at the URL may stand in for it.
    requires = ("tile==1.0rc5", "dep-a")
    lock = fake_stack(index, tmp_path, requires, overrides=["tile==1.0"])
    index.add_metadata(SGLANG_WHEEL, metadata_text("sglang", "1.0", requires))
    raw = json.loads(lock.read_text())
    raw["pins"]["sglang-1.0"]["sha256"] = "0" * 64
    lockfile.write(lock, raw)
    before = lock.read_bytes()
    with pytest.raises(UserError) as e:
        pypi_lock.lock_closure(lock, "s", index_url=index.url)
    message = str(e.value)
    assert "\n" not in message and "pin 'sglang-1.0': could not read the wheel's Requires-Dist" in message
    assert "0" * 64 in message and lock.read_bytes() == before


def test_add_pypi_picks_the_platform_wheel_and_writes_a_fetchable_pin(index: FakeIndex, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    wanted = b"the cp311 manylinux2014 wheel"
    for filename, body in [
        ("widget_kernel-1.2.0.tar.gz", b"sdist"),
        ("widget_kernel-1.2.0-cp310-cp310-manylinux2014_x86_64.whl", b"cp310"),
        ("widget_kernel-1.2.0-cp311-cp311-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", wanted),
        ("widget_kernel-1.2.0-cp311-cp311-manylinux_2_35_x86_64.whl", b"glibc too new"),
        ("widget_kernel-1.2.0-cp311-cp311-manylinux_2_28_aarch64.whl", b"arm"),
        ("widget_kernel-1.2.0-py3-none-any.whl", b"generic"),
        ("widget_kernel-1.3.0-cp311-cp311-manylinux_2_34_x86_64.whl", b"other version"),
    ]:
        index.add("widget-kernel", filename, body)
    lock = tmp_path / "pins.lock.json"
    lockfile.write(lock, {"schema_version": 1, "pins": {}, "stacks": {}})
    assert pypi_lock.main(["add-pypi", "--lock", str(lock), "--index-url", index.url, "Widget_Kernel==1.2.0"]) == 0
    name = capsys.readouterr().out.strip()
    assert name == "widget-kernel-1.2.0"
    filename = "widget_kernel-1.2.0-cp311-cp311-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"
    pin = json.loads(lock.read_text())["pins"][name]
    assert pin == {"kind": "file", "package": {"name": "widget-kernel", "version": "1.2.0"}, "filename": filename,
                   "urls": [index.url.replace("/simple", f"/files/{filename}")],
                   "sha256": hashlib.sha256(wanted).hexdigest(), "size": len(wanted)}
    assert lock.read_text() == lockfile.canonical_text(json.loads(lock.read_text()))
    assert index.hits.get(filename, 0) == 0  # the index's sha256 and size: no wheel download
    # The pin is fetchable with the fetcher, as written.
    fetched = subprocess.run([sys.executable, "-m", "tools.fetch", "fetch", "--lock", str(lock), "--cache",
                              str(tmp_path / "c"), "--pin", name], capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert fetched.returncode == 0, fetched.stderr
    assert Path(fetched.stdout.strip()).read_bytes() == wanted
    with pytest.raises(UserError, match="no wheel of that version"):
        pypi_lock.main(["add-pypi", "--lock", str(lock), "--index-url", index.url, "widget-kernel==9.9"])
    with pytest.raises(UserError, match="exact pin NAME==VERSION"):
        pypi_lock.main(["add-pypi", "--lock", str(lock), "--index-url", index.url, "widget-kernel>=1"])


def test_add_pypi_prefers_pure_wheel_when_no_binary_fits(index: FakeIndex, tmp_path: Path) -> None:
    for filename, body in [("tool-2.0-cp312-abi3-manylinux_2_17_x86_64.whl", b"abi3 312"),
                           ("tool-2.0-py3-none-any.whl", b"pure"),
                           ("tool-2.0-cp38-abi3-manylinux_2_17_x86_64.whl", b"abi3 38")]:
        index.add("tool", filename, body)
    lock = tmp_path / "pins.lock.json"
    lockfile.write(lock, {"schema_version": 1, "pins": {}, "stacks": {}})
    pypi_lock.main(["add-pypi", "--lock", str(lock), "--index-url", index.url, "tool==2.0", "--pin-name", "t"])
    assert json.loads(lock.read_text())["pins"]["t"]["filename"] == "tool-2.0-cp38-abi3-manylinux_2_17_x86_64.whl"


def test_pypi_tools_do_not_import_the_fetcher() -> None:
    # The package graph is tools.common <- tools.pins.lock <- tools.fetch, with tools.pins.pypi
    # beside fetch: an import of tools.fetch here would make pins <-> fetch a circle again.
    code = ("import sys, tools.pins.pypi, tools.pins.venv_lock; "
            "print(sorted(m for m in sys.modules if m.startswith('tools.fetch')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", (proc.stdout, proc.stderr)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
