"""CPU tests of tools/patch_gate and tools/patch_gate/wheel.py on the real pinned wheels.

Inputs (Bazel fills them from pinned repositories; unset fails, never skips):
  KIMI_TEST_FLASHINFER_WHEEL       the default stack's flashinfer-python wheel
  KIMI_TEST_SGLANG_WHEEL           the default stack's sglang wheel
  KIMI_TEST_FLASHINFER_PYPI_WHEEL  the pypi stack's flashinfer-python wheel
  KIMI_TEST_SGLANG_PYPI_WHEEL      the pypi stack's sglang wheel
(versions: third_party/pins.lock.json, read through tests/cpu/conftest.py stack_version)
Fixture patches are generated here from the wheels' own files (no upstream patch bytes, no
GitHub); everything is written under pytest's tmp_path.
"""
from __future__ import annotations

import ast
import base64
import contextlib
import csv
import hashlib
import importlib.util
import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[3]

from tests.cpu.conftest import artifact, stack_pin, stack_version
from tools.common.errors import UserError, run_cli
from tools.common.jsonfmt import review_json
from tools.patch_gate import wheel as wheel_repack
from tools.patch_gate.cli import EXIT_REFUSED
from tools.patch_gate.cli import main as gate_main
from tools.patch_gate.result import STATE_APPLIES, STATE_EXCLUDED, STATE_UPSTREAM
from tools.patch_gate.patch import split_patch
from tools.patch_gate.series import read_series, resolve_series

FI_LAYOUT = REPO / "flashinfer_patches" / "wheel_layout.json"
SGL_LAYOUT = REPO / "sglang_patches" / "wheel_layout.json"
LOCK = REPO / "third_party" / "pins.lock.json"
CORE_PY = "flashinfer/fused_moe/core.py"
BINDING_SRC = "csrc/fused_moe/cutlass_backend/flashinfer_cutlass_fused_moe_binding.cu"
BINDING_WHEEL = "flashinfer/data/" + BINDING_SRC
TEST_SRC = "tests/moe/test_fixture_situ.py"
# The stacks' FlashInfer versions, from the lock (KIMI_TEST_FLASHINFER_WHEEL is the default stack's).
FI_VERSION = stack_version("default", "flashinfer")
FI_PYPI_VERSION = stack_version("pypi", "flashinfer")


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def fi_wheel() -> Path:
    return artifact("KIMI_TEST_FLASHINFER_WHEEL")


@pytest.fixture(scope="module")
def sgl_wheel() -> Path:
    return artifact("KIMI_TEST_SGLANG_WHEEL")


@pytest.fixture(scope="module")
def fi_tree(fi_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default stack's FlashInfer wheel unpacked once per module (read-only use: tests copy what they change)."""
    tree = tmp_path_factory.mktemp("fi_tree") / "tree"
    tree.mkdir()
    wheel_repack.unpack_wheel(fi_wheel, tree)
    return tree


def git_env(cwd: Path) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C", "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": os.devnull, "HOME": str(cwd), "GIT_CEILING_DIRECTORIES": str(cwd.parent)}


def make_git_patch(workdir: Path, before: dict[str, bytes], after: dict[str, bytes]) -> bytes:
    """A canonical git-format diff between two file sets (paths in the source layout)."""
    repo = workdir / "repo"
    if repo.exists():
        shutil.rmtree(repo)
    repo.mkdir(parents=True)
    env = git_env(repo)
    git = lambda *args: subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True).stdout  # noqa: E731
    git("init", "-q")
    for rel, data in before.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_bytes(data)
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@example.invalid", "commit", "-q", "--allow-empty", "-m", "before")
    for rel in before:
        (repo / rel).unlink()
    for rel, data in after.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_bytes(data)
    git("add", "-A")
    return git("diff", "--cached", "--binary", "--full-index", "--no-color", "--no-renames", "HEAD")


def insert_before(data: bytes, needle: bytes, new_line: bytes) -> bytes:
    """Insert one line before the first line containing `needle` (the fixture edit)."""
    lines = data.split(b"\n")
    index = next(i for i, line in enumerate(lines) if needle in line)
    return b"\n".join(lines[:index] + [new_line] + lines[index:])


def fixture_sources(tree: Path) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """#4460's shape from the wheel's own files: a Python edit, a csrc edit and a tests/ file."""
    core = (tree / CORE_PY).read_bytes()
    binding = (tree / BINDING_WHEEL).read_bytes()
    before = {CORE_PY: core, BINDING_SRC: binding, TEST_SRC: b"def test_old():\n    pass\n"}
    after = {
        CORE_PY: insert_before(core, b"def cutlass_fused_moe(", b"# kimi-k3 fixture: SiTU marker"),
        BINDING_SRC: insert_before(binding, b"class FusedMoeRunner", b"// kimi-k3 fixture: SiTU marker"),
        TEST_SRC: b"def test_old():\n    pass\n\n\ndef test_situ():\n    pass\n",
    }
    return before, after


def write_series(directory: Path, patches: dict[str, bytes]) -> Path:
    """A series of `file:` entries (in dict order) next to its patch files."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in patches.items():
        (directory / name).write_bytes(data)
    series = directory / "test.series"
    series.write_text("# generated by the test\n" + "".join(f"file:{name}\n" for name in patches))
    return series


def gate(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    rc = run_cli(gate_main, [str(a) for a in args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def apply_args(series: Path, target: Path, out: Path, layout: Path = FI_LAYOUT, *extra: str | Path) -> list[str | Path]:
    return ["apply", "--series", series, "--target", target, "--layout", layout, "--out-dir", out, *extra]


def check_args(series: Path, target: Path, *extra: str | Path) -> list[str | Path]:
    """`check` runs the whole gate without writing a tree: enough where only states matter."""
    return ["check", "--series", series, "--target", target, "--layout", FI_LAYOUT, *extra]


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def applied(fi_wheel: Path, fi_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The fixture series applied once to the real wheel (shared by the manifest/repack tests)."""
    base = tmp_path_factory.mktemp("applied")
    before, after = fixture_sources(fi_tree)
    series = write_series(base / "series", {"0001-fixture.patch": make_git_patch(base, before, after)})
    out, manifest, table, remapped = base / "out", base / "manifest.json", base / "table.txt", base / "remapped"
    rc = run_cli(gate_main, [str(a) for a in apply_args(series, fi_wheel, out, FI_LAYOUT, "--manifest", manifest,
                                                              "--table", table, "--remapped-dir", remapped)])
    assert rc == 0, table.read_text() if table.exists() else "gate failed"
    return {"series": series, "out": out, "manifest": manifest, "table": table, "remapped": remapped, "base": base}


# ----------------------------------------------------------------------------- remap, check, apply


def test_fixture_patch_remaps_checks_and_applies(applied: dict[str, Path], fi_tree: Path) -> None:
    table = applied["table"].read_text()
    assert re.search(r"^1\s+file:0001-fixture.patch\s+applies\s+" + re.escape(BINDING_WHEEL), table, re.M), table
    assert CORE_PY in table and f"excluded: {TEST_SRC}" in table
    out = applied["out"]
    assert b"// kimi-k3 fixture: SiTU marker" in (out / BINDING_WHEEL).read_bytes()
    assert b"# kimi-k3 fixture: SiTU marker" in (out / CORE_PY).read_bytes()
    assert not (out / "tests").exists()
    # The remapped patch is saved for review, with wheel paths only.
    remapped = next(applied["remapped"].glob("*.patch")).read_text()
    assert f"+++ b/{BINDING_WHEEL}" in remapped and f"+++ b/{CORE_PY}" in remapped and "tests/" not in remapped


def test_manifest_lists_changed_files_and_verified_count(applied: dict[str, Path], fi_tree: Path) -> None:
    raw = applied["manifest"].read_bytes()
    manifest = json.loads(raw)
    assert raw == review_json(manifest), "manifest is not canonical JSON"
    changed = {c["path"]: c for c in manifest["changed_files"]}
    assert sorted(changed) == sorted([BINDING_WHEEL, CORE_PY])
    for path, entry in changed.items():
        assert entry["sha256_before"] == sha256_hex((fi_tree / path).read_bytes())
        assert entry["sha256_after"] == sha256_hex((applied["out"] / path).read_bytes())
        assert entry["changed_by"] == ["file:0001-fixture.patch"]
    (patch,) = manifest["patches"]
    assert patch["state"] == STATE_APPLIES
    assert patch["excluded"][0]["source"] == TEST_SRC and "tests/" in patch["excluded"][0]["why"]
    record_hashed = sum(1 for line in (fi_tree / f"flashinfer_python-{FI_VERSION}.dist-info" / "RECORD").read_text().splitlines()
                        if line.split(",")[1])
    assert manifest["untouched_files_verified"] == record_hashed - 2
    assert manifest["target"]["version"] == FI_VERSION


def test_check_passes_then_names_drifted_file(applied: dict[str, Path], fi_wheel: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--series", applied["series"], "--target", fi_wheel, "--layout", FI_LAYOUT]
    rc, _, err = gate(capsys, "check", *common, "--expected-manifest", applied["manifest"])
    assert rc == 0, err
    expected = json.loads(applied["manifest"].read_text())
    for entry in expected["changed_files"]:
        if entry["path"] == CORE_PY:
            entry["sha256_after"] = "0" * 64
    drifted = tmp_path / "expected.json"
    drifted.write_bytes(review_json(expected))
    rc, _, err = gate(capsys, "check", *common, "--expected-manifest", drifted)
    assert rc == EXIT_REFUSED
    assert f"changed_files[{CORE_PY}].sha256_after" in err


def test_offsets_are_reported(fi_tree: Path, fi_wheel: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    core = (fi_tree / CORE_PY).read_bytes()
    shifted = b"\n".join(core.split(b"\n")[5:])  # the patch's author had 5 lines fewer above the edit
    patch = make_git_patch(tmp_path, {CORE_PY: shifted},
                           {CORE_PY: insert_before(shifted, b"def cutlass_fused_moe(", b"# offset fixture")})
    series = write_series(tmp_path / "series", {"0001-shifted.patch": patch})
    manifest = tmp_path / "manifest.json"
    rc, out, err = gate(capsys, *check_args(series, fi_wheel, "--manifest", manifest))
    assert rc == 0, out + err
    assert re.search(re.escape(CORE_PY) + r"\s+1\s+#1 \+5$", out, re.M), out
    files = json.loads(manifest.read_text())["patches"][0]["files"]
    assert files == [{"source": CORE_PY, "wheel": CORE_PY, "hunks": 1, "offsets": [{"hunk": 1, "lines": 5}]}]


def test_already_upstream(fi_tree: Path, fi_wheel: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before, after = fixture_sources(fi_tree)
    # The patch's post-image is exactly what the wheel ships.
    patch = make_git_patch(tmp_path, {k: after[k] for k in (CORE_PY, BINDING_SRC)}, {k: before[k] for k in (CORE_PY, BINDING_SRC)})
    series = write_series(tmp_path / "series", {"0001-upstreamed.patch": patch})
    manifest = tmp_path / "manifest.json"
    rc, out, err = gate(capsys, *check_args(series, fi_wheel, "--manifest", manifest))
    assert rc == 0, out + err
    assert re.search(r"^1\s+file:0001-upstreamed.patch\s+already upstream\s", out, re.M), out
    doc = json.loads(manifest.read_text())
    assert doc["changed_files"] == [] and doc["patches"][0]["state"] == STATE_UPSTREAM
    assert doc["untouched_files_verified"] == doc["record_files_with_hash"]


def test_series_applies_patch_n_on_top_of_1_to_n_minus_1(fi_tree: Path, fi_wheel: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    core = (fi_tree / CORE_PY).read_bytes()
    step1 = insert_before(core, b"def cutlass_fused_moe(", b"# step one")
    step2 = step1.replace(b"# step one", b"# step two")
    first = make_git_patch(tmp_path / "p1", {CORE_PY: core}, {CORE_PY: step1})
    second = make_git_patch(tmp_path / "p2", {CORE_PY: step1}, {CORE_PY: step2})
    manifest = tmp_path / "manifest.json"
    series = write_series(tmp_path / "ok", {"0001-one.patch": first, "0002-two.patch": second})
    rc, out, err = gate(capsys, *check_args(series, fi_wheel, "--manifest", manifest))
    assert rc == 0, out + err
    (entry,) = json.loads(manifest.read_text())["changed_files"]
    assert entry["changed_by"] == ["file:0001-one.patch", "file:0002-two.patch"]
    assert entry["sha256_after"] == sha256_hex(step2)
    # The same two patches in the wrong order: the second one needs the first.
    series = write_series(tmp_path / "bad", {"0002-two.patch": second, "0001-one.patch": first})
    rc, out, _ = gate(capsys, *check_args(series, fi_wheel))
    assert rc == EXIT_REFUSED
    assert re.search(r"^1\s+file:0002-two.patch\s+conflicts", out, re.M), out


def test_conflict_writes_nothing(fi_tree: Path, fi_wheel: Path, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    before, after = fixture_sources(fi_tree)
    good = make_git_patch(tmp_path / "good", before, after)
    # Written against a core.py whose line after the edit differs from the wheel's.
    core = (fi_tree / CORE_PY).read_bytes()
    lines = core.split(b"\n")
    at = next(i for i, line in enumerate(lines) if b"def cutlass_fused_moe(" in line)
    lines[at + 1] = b"    not_what_the_wheel_has,"
    foreign = b"\n".join(lines)
    bad = make_git_patch(tmp_path / "bad", {CORE_PY: foreign},
                         {CORE_PY: insert_before(foreign, b"def cutlass_fused_moe(", b"# conflicting")})
    series = write_series(tmp_path / "series", {"0001-good.patch": good, "0002-bad.patch": bad})
    parent = tmp_path / "outputs"
    out = parent / "tree"
    out.mkdir(parents=True)  # what Bazel gives the action: an empty directory
    table = tmp_path / "table.txt"
    rc, stdout, _ = gate(capsys, *apply_args(series, fi_wheel, out, FI_LAYOUT, "--table", table))
    assert rc == EXIT_REFUSED
    assert re.search(r"^1\s+file:0001-good.patch\s+applies", stdout, re.M)
    assert re.search(r"^2\s+file:0002-bad.patch\s+conflicts", stdout, re.M)
    assert re.search(re.escape(CORE_PY) + r": hunk #1 @@ .*: conflicts", stdout), stdout
    assert "REFUSED" in stdout
    assert sorted(p.name for p in parent.iterdir()) == ["tree"], "scratch left behind"
    assert list(out.iterdir()) == [] and not table.exists()
    out.rmdir()
    rc, _, _ = gate(capsys, *apply_args(series, fi_wheel, out))
    assert rc == EXIT_REFUSED and not out.exists()


# ----------------------------------------------------------------------------- binary sections


def binary_bytes(seed: str) -> bytes:
    """Deterministic bytes git treats as binary (they hold a NUL), different for each seed."""
    return b"\0" + b"".join(hashlib.sha256(f"{seed}/{i}".encode()).digest() for i in range(40))


# Where the binary file's section falls in the patch: `git diff` orders sections by path.
BINARY_POSITIONS = {"last": ["a.cu", "z.bin"], "middle": ["a.cu", "m.bin", "z.cu"], "only": ["z.bin"]}
# flashinfer/ keeps its paths (the remapped patch is the source patch byte for byte); csrc/ moves
# under flashinfer/data/ (only the paths differ).
WHEEL_PREFIX = {"flashinfer/": "flashinfer/", "csrc/": "flashinfer/data/csrc/"}


def binary_fixture(tmp_path: Path, position: str, prefix: str) -> tuple[bytes, Path, dict[str, bytes]]:
    """A real `git diff --binary` patch with the binary file at `position`, the directory target
    it applies to, and the patched files by wheel path."""
    before: dict[str, bytes] = {}
    after: dict[str, bytes] = {}
    for name in BINARY_POSITIONS[position]:
        if name.endswith(".bin"):
            before[prefix + name], after[prefix + name] = binary_bytes(f"{name} old"), binary_bytes(f"{name} new")
        else:
            before[prefix + name] = b"".join(b"int line_%d;\n" % i for i in range(8))
            after[prefix + name] = before[prefix + name].replace(b"line_3;", b"line_3 = 3;")
    patch = make_git_patch(tmp_path / "git", before, after)
    headers = [line.split(b" b/")[-1].decode() for line in patch.split(b"\n") if line.startswith(b"diff --git ")]
    assert headers == list(before) and patch.count(b"GIT binary patch") == 1, patch
    wheel = lambda rel: WHEEL_PREFIX[prefix] + rel[len(prefix):]  # noqa: E731
    tree = small_wheel_tree(tmp_path / "target", {wheel(rel): data for rel, data in before.items()})
    return patch, tree, {wheel(rel): data for rel, data in after.items()}


@pytest.mark.parametrize("prefix", sorted(WHEEL_PREFIX))
@pytest.mark.parametrize("position", sorted(BINARY_POSITIONS))
def test_binary_section_keeps_its_ending_wherever_it_falls(position: str, prefix: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    patch, tree, patched = binary_fixture(tmp_path, position, prefix)
    assert patch.endswith(b"\n\n") == (position != "middle")  # a binary hunk ends with an empty line
    series = write_series(tmp_path / "series", {"0001-binary.patch": patch})
    manifest = tmp_path / "manifest.json"
    rc, out, err = gate(capsys, *apply_args(series, tree, tmp_path / "out", FI_LAYOUT, "--manifest", manifest))
    assert rc == 0, out + err
    for rel, data in patched.items():
        assert (tmp_path / "out" / rel).read_bytes() == data, f"{rel} not patched"
    assert sorted(c["path"] for c in json.loads(manifest.read_text())["changed_files"]) == sorted(patched)
    rc, out, err = gate(capsys, "remap", "--series", series, "--layout", FI_LAYOUT, "--out-dir", tmp_path / "remapped")
    assert rc == 0, out + err
    (remapped,) = (tmp_path / "remapped").glob("*.patch")
    moved = WHEEL_PREFIX[prefix].encode()
    assert remapped.read_bytes() == patch.replace(b" a/" + prefix.encode(), b" a/" + moved).replace(
        b" b/" + prefix.encode(), b" b/" + moved)


@pytest.mark.parametrize("position", ["last", "middle"])
def test_binary_hunk_without_its_ending_empty_line_is_bad_input(position: str, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """An editor that strips trailing blank lines cuts a binary hunk: git would skip the file."""
    patch, tree, _ = binary_fixture(tmp_path, position, "flashinfer/")
    cut = patch[:-1] if position == "last" else patch.replace(b"\n\ndiff --git ", b"\ndiff --git ", 1)
    assert cut != patch
    series = write_series(tmp_path / "series", {"0001-binary.patch": cut})
    rc, _, err = gate(capsys, *apply_args(series, tree, tmp_path / "out"))
    assert rc == 2, err
    (line,) = error_lines(err)
    assert "0001-binary.patch: corrupt patch at line" in line and "the binary hunk of a/flashinfer/" in line, line
    assert "regenerate it with `git diff --binary`" in line, line
    assert not (tmp_path / "out").exists()


def test_binary_hunk_git_cannot_decode_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """git apply skips such a file and exits 0 when another file of the patch applies."""
    patch, tree, _ = binary_fixture(tmp_path, "last", "flashinfer/")
    lines = patch.split(b"\n")
    data_line = next(i for i, line in enumerate(lines) if line.startswith(b"literal ")) + 1
    lines[data_line] = lines[data_line][:-3]  # shorter than its length character says
    series = write_series(tmp_path / "series", {"0001-binary.patch": b"\n".join(lines)})
    rc, _, err = gate(capsys, *apply_args(series, tree, tmp_path / "out"))
    assert rc == 2, err
    (line,) = error_lines(err)
    assert "0001-binary.patch: git apply cannot read the remapped patch (corrupt binary patch at" in line, line
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- refusals


def handwritten_patch(path: str, header_path: str | None = None) -> bytes:
    """A new-file patch naming `path` (git refuses to write such paths, so it is written by hand)."""
    shown = header_path or path
    return (f"diff --git a/{shown} b/{shown}\nnew file mode 100644\nindex 0000000..1111111\n"
            f"--- /dev/null\n+++ b/{path}\n@@ -0,0 +1 @@\n+print('escaped')\n").encode()


@pytest.mark.parametrize("path, message", [
    ("flashinfer/../../evil.py", "contains '..'"),
    ("/etc/evil.py", "absolute"),
    ("flashinfer/./evil.py", "contains '.'"),
])
def test_paths_outside_the_tree_are_refused(path: str, message: str, fi_wheel: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    series = write_series(tmp_path / "series", {"0001-escape.patch": handwritten_patch(path)})
    rc, _, err = gate(capsys, *apply_args(series, fi_wheel, tmp_path / "out"))
    assert rc == 2 and message in err and path in err, err
    assert not (tmp_path / "out").exists()


def test_path_without_git_prefix_is_refused(fi_wheel: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    patch = b"diff --git a/x.py b/x.py\n--- x.py\n+++ x.py\n@@ -1 +1 @@\n-a\n+b\n"
    series = write_series(tmp_path / "series", {"0001-p0.patch": patch})
    rc, _, err = gate(capsys, *apply_args(series, fi_wheel, tmp_path / "out"))
    assert rc == 2 and "lacks the 'a/' prefix" in err, err


def small_wheel_tree(root: Path, files: dict[str, bytes]) -> Path:
    """A tiny unpacked wheel directory with a valid RECORD."""
    dist = root / "demo-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n\n")
    (dist / "WHEEL").write_text("Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    rows = []
    for rel in sorted(files) + ["demo-1.0.dist-info/METADATA", "demo-1.0.dist-info/WHEEL"]:
        data = (root / rel).read_bytes()
        b64 = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append(f"{rel},sha256={b64},{len(data)}\n")
    (dist / "RECORD").write_text("".join(rows) + "demo-1.0.dist-info/RECORD,,\n")
    return root


def test_patch_through_symlink_in_tree_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    tree = small_wheel_tree(tmp_path / "tree", {"flashinfer/__init__.py": b"x = 1\n"})
    (tree / "flashinfer" / "linked").symlink_to(outside, target_is_directory=True)
    series = write_series(tmp_path / "series", {"0001-link.patch": handwritten_patch("flashinfer/linked/evil.py")})
    rc, _, err = gate(capsys, *apply_args(series, tree, tmp_path / "out"))
    assert rc == 2 and "symlink flashinfer/linked" in err, err
    assert list(outside.iterdir()) == [] and not (tmp_path / "out").exists()


def test_symlink_and_submodule_modes_are_refused(fi_wheel: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    patch = handwritten_patch("flashinfer/link.py").replace(b"new file mode 100644", b"new file mode 120000")
    series = write_series(tmp_path / "series", {"0001-mode.patch": patch})
    rc, _, err = gate(capsys, *apply_args(series, fi_wheel, tmp_path / "out"))
    assert rc == 2 and "120000" in err, err


def test_path_matching_no_layout_rule_is_an_error(fi_wheel: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    series = write_series(tmp_path / "series", {"0001-setup.patch": handwritten_patch("setup_extra.py")})
    rc, _, err = gate(capsys, *apply_args(series, fi_wheel, tmp_path / "out"))
    assert rc == 2 and "setup_extra.py matches no rule of wheel_layout.json" in err, err


def test_one_byte_change_in_untouched_upstream_file_is_named(applied: dict[str, Path], fi_tree: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    tree = tmp_path / "tampered"
    shutil.copytree(fi_tree, tree, copy_function=os.link)  # hard links: cheap; edits below replace files
    victim = tree / "flashinfer" / "activation.py"
    data = bytearray(victim.read_bytes())
    data[100] ^= 0x01
    victim.unlink()
    victim.write_bytes(bytes(data))
    rc, _, err = gate(capsys, *apply_args(applied["series"], tree, tmp_path / "out"))
    assert rc == 2 and "flashinfer/activation.py differs from its RECORD sha256" in err, err
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["tampered"]
    # The same for a file the series touches: its bytes before patching are checked too.
    victim.write_bytes((fi_tree / "flashinfer" / "activation.py").read_bytes())
    core = tree / CORE_PY
    core_bytes = core.read_bytes()
    core.unlink()
    core.write_bytes(core_bytes + b"\n")
    rc, _, err = gate(capsys, *apply_args(applied["series"], tree, tmp_path / "out"))
    assert rc == 2 and f"{CORE_PY} differs from its RECORD sha256 before patching" in err, err


def test_pin_entries_need_a_pin_file_and_match_the_lock(applied: dict[str, Path], fi_wheel: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    series = tmp_path / "pin.series"
    series.write_text("pin:flashinfer-pr4460\n")
    rc, _, err = gate(capsys, *apply_args(series, fi_wheel, tmp_path / "out"))
    assert rc == 2 and "--pin-file flashinfer-pr4460=PATH" in err
    wrong = next(applied["series"].parent.glob("*.patch"))
    rc, _, err = gate(capsys, *apply_args(series, fi_wheel, tmp_path / "out", FI_LAYOUT,
                                          "--pin-file", f"flashinfer-pr4460={wrong}", "--lock", LOCK))
    assert rc == 2 and "is not the lock's" in err and "re-fetch" in err


def test_a_malformed_lock_is_refused_by_the_lock_loader(applied: dict[str, Path], tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """--lock goes through tools.pins.lock's validation: a lock its loader refuses is not half used."""
    doc = json.loads(LOCK.read_text())
    doc["pins"]["flashinfer-pr4460"]["sha256"] = "abc"
    bad = tmp_path / "pins.lock.json"
    bad.write_text(json.dumps(doc))
    rc, _, err = gate(capsys, "remap", "--series", applied["series"], "--layout", FI_LAYOUT, "--lock", bad,
                      "--out-dir", tmp_path / "remapped")
    assert rc == 2 and str(bad) in err and "flashinfer-pr4460" in err and "sha256" in err, err
    assert err.count("\n") == 1 and not (tmp_path / "remapped").exists(), err


def test_series_syntax_errors_name_the_line(tmp_path: Path) -> None:
    series = tmp_path / "bad.series"
    series.write_text("# ok\nfile:a.patch\npatch:b.patch\n")
    with pytest.raises(UserError, match=r"bad.series:3: 'patch:b.patch'"):
        read_series(series)
    series.write_text("file:../outside.patch\n")
    entries = read_series(series)
    with pytest.raises(UserError, match=r"contains '..'"):
        resolve_series(series, entries, {}, None)


LAYOUT_RULES = {"schema_version": 1, "map": [{"source": "flashinfer/", "wheel": "flashinfer/", "why": "the package"}],
                "exclude": [{"source": "tests/", "why": "not shipped"}]}


@pytest.mark.parametrize("layout, message", [
    (b"\x80{}", "unreadable ('utf-8' codec can't decode byte 0x80"),
    (b"null", "holds null, not an object"),
    (json.dumps([LAYOUT_RULES]).encode(), "holds a list, not an object"),
    (json.dumps({**LAYOUT_RULES, "schema_version": True}).encode(), "schema_version must be 1"),
    (json.dumps({**LAYOUT_RULES, "exclusions": []}).encode(), "unknown key 'exclusions'"),
    (json.dumps({**LAYOUT_RULES, "map": {"flashinfer/": "flashinfer/"}}).encode(), "`map` is an object; make it a list"),
    (json.dumps({**LAYOUT_RULES, "map": ["flashinfer/"]}).encode(), "map item 1 is a string, not an object"),
    (json.dumps({**LAYOUT_RULES, "map": [{"wheel": "flashinfer/"}]}).encode(), "map item 1 has no `source`"),
    (json.dumps({**LAYOUT_RULES, "map": [{"source": "flashinfer/"}]}).encode(), "map item 1 ('flashinfer/') has no `wheel`"),
    (json.dumps({**LAYOUT_RULES, "map": [{"source": 7, "wheel": "flashinfer/"}]}).encode(), "map item 1: `source` is a number"),
    (json.dumps({**LAYOUT_RULES, "map": [{"source": "flashinfer/", "wheel": None}]}).encode(),
     "map item 1 ('flashinfer/'): `wheel` is null; make it a string"),
    (json.dumps({**LAYOUT_RULES, "map": [{"source": "flashinfer/", "wheel": "flashinfer/", "reason": "x"}]}).encode(),
     "map item 1 ('flashinfer/') has the unknown key 'reason'"),
    (json.dumps({**LAYOUT_RULES, "exclude": [{"why": "not shipped"}]}).encode(), "exclude item 1 has no `source`"),
    (json.dumps({**LAYOUT_RULES, "exclude": [{"source": "tests/"}]}).encode(),
     "exclude item 1 ('tests/') has no `why`; say why it is not in the wheel"),
    (json.dumps({**LAYOUT_RULES, "exclude": [{"source": "tests/", "why": 5}]}).encode(),
     "exclude item 1 ('tests/'): `why` is a number; make it a string"),
    (json.dumps({**LAYOUT_RULES, "exclude": [{"source": "tests/", "why": " "}]}).encode(),
     "exclude item 1 ('tests/'): `why` is empty; say why it is not in the wheel"),
], ids=["not-utf8", "null", "list", "schema-true", "unknown-key", "map-object", "map-item-string", "map-no-source",
        "map-no-wheel", "source-number", "wheel-null", "item-unknown-key", "exclude-no-source", "exclude-no-why",
        "why-number", "why-blank"])
@pytest.mark.parametrize("command", ["remap", "apply"])
def test_malformed_layout_is_one_line_naming_the_file_and_item(command: str, layout: bytes, message: str,
                                                              tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    layout_file = tmp_path / "wheel_layout.json"
    layout_file.write_bytes(layout)
    series = write_series(tmp_path / "series", {"0001-x.patch": handwritten_patch("tests/test_x.py")})
    out = tmp_path / "out"
    if command == "remap":
        args: list[str | Path] = ["remap", "--series", series, "--layout", layout_file, "--out-dir", out]
    else:
        args = apply_args(series, small_wheel_tree(tmp_path / "target", {}), out, layout_file)
    rc, stdout, err = gate(capsys, *args)
    assert rc == 2, stdout + err
    (line,) = error_lines(err)
    assert line.startswith(f"error: --layout {layout_file}: ") and message in line, line
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == sorted(["wheel_layout.json", "series"] + (
        ["target"] if command == "apply" else []))


@pytest.mark.parametrize("command", ["remap", "apply"])
def test_non_utf8_series_is_one_line_naming_the_file_and_line(command: str, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    series = write_series(tmp_path / "series", {"0001-x.patch": handwritten_patch("flashinfer/x.py")})
    series.write_bytes(b"# generated by the test\nfile:0001-x.patch # caf\xe9 (latin-1)\n")
    out = tmp_path / "out"
    if command == "remap":
        args: list[str | Path] = ["remap", "--series", series, "--layout", FI_LAYOUT, "--out-dir", out]
    else:
        args = apply_args(series, small_wheel_tree(tmp_path / "target", {}), out)
    rc, stdout, err = gate(capsys, *args)
    assert rc == 2, stdout + err
    (line,) = error_lines(err)
    assert line == f"error: --series {series}:2: byte 0xe9 is not UTF-8; save the file as UTF-8", line
    assert not out.exists()


def test_unreadable_series_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As root every file reads, so the refusal a non-root user meets is simulated."""
    series = write_series(tmp_path / "series", {})
    path_open = Path.open

    def refuse(path: Path, *args: Any, **kwargs: Any) -> Any:
        if path == series:
            raise PermissionError(13, "Permission denied", str(path))
        return path_open(path, *args, **kwargs)

    monkeypatch.setattr(Path, "open", refuse)
    with pytest.raises(UserError, match=r"^--series .*test.series: unreadable \(Permission denied\); pass a readable"):
        read_series(series)


def test_series_entry_with_control_characters_is_refused(tmp_path: Path) -> None:
    series = tmp_path / "bad.series"
    series.write_bytes(b"file:a\x00b.patch\n")
    with pytest.raises(UserError, match=r"bad.series:1: 'file:a\\x00b.patch' is not"):
        read_series(series)
    series.write_bytes(b"\xef\xbb\xbffile:a.patch\r\n")  # a BOM and CRLF, as Windows editors save it
    assert [e.label for e in read_series(series)] == ["file:a.patch"]


def test_committed_series_files_parse() -> None:
    default = read_series(REPO / "flashinfer_patches" / "default.series")
    assert [e.label for e in default] == ["pin:flashinfer-pr4460"]
    pypi_text = (REPO / "flashinfer_patches" / "pypi.series").read_text()
    assert read_series(REPO / "flashinfer_patches" / "pypi.series") == []
    assert FI_PYPI_VERSION in pypi_text and "SiTU" in pypi_text  # says why #4460 is not needed


# ----------------------------------------------------------------------------- malformed patches


def core_patch(tmp_path: Path, fi_tree: Path, marker: bytes = b"# kimi-k3 fixture") -> bytes:
    core = (fi_tree / CORE_PY).read_bytes()
    return make_git_patch(tmp_path, {CORE_PY: core}, {CORE_PY: insert_before(core, b"def cutlass_fused_moe(", marker)})


@pytest.mark.parametrize("cut", ["line", "mid-line"])
def test_patch_cut_mid_hunk_is_bad_input_naming_the_line(cut: str, fi_tree: Path, fi_wheel: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    lines = core_patch(tmp_path, fi_tree).split(b"\n")  # ends with b"": the final newline
    kept = lines[:-3]  # drop the last two lines of the hunk
    data = b"\n".join(kept) + b"\n" if cut == "line" else b"\n".join(kept + [lines[-3][:3]])
    series = write_series(tmp_path / "series", {"0001-cut.patch": data})
    rc, out, err = gate(capsys, *check_args(series, fi_wheel))
    last = len(kept) + (0 if cut == "line" else 1)
    assert rc == 2, out + err
    assert f"file:0001-cut.patch: corrupt patch at line {last}: hunk #1 of a/{CORE_PY} b/{CORE_PY}" in err, err
    assert "conflicts" not in out and "conflicts" not in err


def test_hunk_longer_than_its_header_is_bad_input(fi_tree: Path, fi_wheel: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    text = core_patch(tmp_path, fi_tree).decode()
    # One more added line than the header counts, in the middle of the hunk.
    edited = text.replace("+# kimi-k3 fixture\n", "+# kimi-k3 fixture\n+# hand-added\n")
    series = write_series(tmp_path / "series", {"0001-edited.patch": edited.encode()})
    rc, _, err = gate(capsys, *check_args(series, fi_wheel))
    assert rc == 2 and "corrupt patch at line" in err and "hunk #1" in err, err


@pytest.mark.parametrize("where", ["after a hunk", "in the preamble", "after an excluded section"])
def test_plain_diff_section_without_git_header_is_refused(where: str, fi_tree: Path, fi_wheel: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """git apply also applies plain `---`/`+++` sections; the gate splits on `diff --git` only,
    so such a section would be applied without being reported (or kept for review)."""
    activation = (fi_tree / "flashinfer" / "activation.py").read_bytes()
    plain = make_git_patch(tmp_path / "plain", {"flashinfer/activation.py": activation},
                           {"flashinfer/activation.py": b"# smuggled\n" + activation}).decode()
    plain = plain[plain.index("--- a/"):]  # the same hunk without its `diff --git` header lines
    core = core_patch(tmp_path / "core", fi_tree).decode()
    excluded = make_git_patch(tmp_path / "excl", {TEST_SRC: b"a = 1\n"}, {TEST_SRC: b"a = 2\n"}).decode()
    text = {"after a hunk": core + plain, "in the preamble": "Subject: x\n\n" + plain + core,
            "after an excluded section": core + excluded + plain}[where]
    line = text[: text.index("--- a/flashinfer/activation.py")].count("\n") + 1
    # What git itself does with the text: it applies the plain section too.
    probe = tmp_path / "probe"
    (probe / "flashinfer").mkdir(parents=True)
    shutil.copy(fi_tree / "flashinfer" / "activation.py", probe / "flashinfer" / "activation.py")
    (probe / "p.patch").write_text(plain)
    subprocess.run(["git", "apply", "p.patch"], cwd=probe, env=git_env(probe), check=True)
    assert (probe / "flashinfer" / "activation.py").read_bytes().startswith(b"# smuggled\n")

    series = write_series(tmp_path / "series", {"0001-smuggle.patch": text.encode()})
    out_dir = tmp_path / "out"
    rc, out, err = gate(capsys, *apply_args(series, fi_wheel, out_dir))
    assert rc == 2, out + err
    assert f"file:0001-smuggle.patch: line {line}: a `---`/`+++` file section" in err, err
    assert not out_dir.exists()


def test_committed_patches_parse_with_hunk_counts() -> None:
    """The strict parser accepts every committed SGLang patch (format-patch trailers included)."""
    for patch in sorted((REPO / "sglang_patches").glob("*.patch")):
        _, sections = split_patch(patch.read_text(), patch.name)
        assert sections and all(s.hunks for s in sections), patch.name


# ----------------------------------------------------------------------------- states, drift, output


def test_entry_with_every_file_excluded_is_reported_excluded(fi_wheel: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from tools.image import sbom

    patch = make_git_patch(tmp_path, {TEST_SRC: b"a = 1\n"}, {TEST_SRC: b"a = 2\n"})
    series = write_series(tmp_path / "series", {"0001-tests-only.patch": patch})
    manifest = tmp_path / "manifest.json"
    rc, out, err = gate(capsys, *check_args(series, fi_wheel, "--manifest", manifest))
    assert rc == 0, out + err
    assert re.search(r"^1\s+file:0001-tests-only.patch\s+excluded\s+excluded: " + re.escape(TEST_SRC), out, re.M), out
    doc = json.loads(manifest.read_text())
    assert [p["state"] for p in doc["patches"]] == [STATE_EXCLUDED] and doc["changed_files"] == []
    doc["target"]["pin"] = stack_pin("default", "flashinfer")
    _, relationships = sbom.patch_packages(doc)
    assert [r["relationshipType"] for r in relationships] == ["OTHER"], relationships
    assert relationships[0]["comment"] == "not applied: excluded"


def test_drift_refusal_writes_nothing(applied: dict[str, Path], fi_wheel: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    expected = json.loads(applied["manifest"].read_text())
    expected["changed_files"][0]["sha256_after"] = "0" * 64
    drifted = tmp_path / "expected.manifest.json"
    drifted.write_bytes(review_json(expected))
    out = tmp_path / "outputs" / "tree"
    out.mkdir(parents=True)  # what Bazel gives the action: an empty directory
    table, manifest, remapped = tmp_path / "table.txt", tmp_path / "manifest.json", tmp_path / "remapped"
    rc, stdout, err = gate(capsys, *apply_args(applied["series"], fi_wheel, out, FI_LAYOUT, "--expected-manifest", drifted,
                                               "--table", table, "--manifest", manifest, "--remapped-dir", remapped))
    assert rc == EXIT_REFUSED, stdout + err
    assert list(out.iterdir()) == [], "a refused tree was written"
    assert sorted(p.name for p in out.parent.iterdir()) == ["tree"], "scratch left behind"
    assert not table.exists() and not manifest.exists() and not remapped.exists()
    assert "result: series applied" not in stdout, stdout
    assert "result: REFUSED; nothing was written (the built manifest differs" in stdout, stdout
    assert "manifest drift" in err, err
    path = expected["changed_files"][0]["path"]
    assert f"changed_files[{path}].sha256_after" in err and f"against {drifted}" in err, err
    # Without drift the same command writes the tree into the empty directory.
    rc, _, err = gate(capsys, *apply_args(applied["series"], fi_wheel, out, FI_LAYOUT,
                                          "--expected-manifest", applied["manifest"]))
    assert rc == 0, err
    assert (out / CORE_PY).is_file()
    # A tree is shipped byte for byte (no marker), so a filled --out-dir, its own earlier tree or
    # a user's folder, is refused before the series runs, and kept.
    (out / "previous.txt").write_text("previous good output\n")
    rc, stdout, err = gate(capsys, *apply_args(applied["series"], fi_wheel, out, FI_LAYOUT,
                                               "--expected-manifest", applied["manifest"]))
    assert rc == 2 and stdout == "" and err.startswith(f"error: --out-dir {out}: exists, is not empty"), err
    assert (out / "previous.txt").read_text() == "previous good output\n" and (out / CORE_PY).is_file()


def test_check_manifest_names_the_file_and_the_fix_command(applied: dict[str, Path], tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The Bazel validation's command: drift names the drifted file and the update_manifest target."""
    built = applied["manifest"]
    expected = json.loads(built.read_text())
    expected["changed_files"][0]["sha256_after"] = "0" * 64
    for package, stack, fix in [("sglang_patches", "default", "`tools/bazel run //sglang_patches:update_manifest`"),
                                ("flashinfer_patches", "pypi",
                                 "`tools/bazel run //flashinfer_patches:update_manifest --config=pypi`")]:
        committed = tmp_path / package / f"{stack}.manifest.json"
        committed.parent.mkdir(exist_ok=True)
        committed.write_bytes(review_json(expected))
        stamp = tmp_path / f"{package}.stamp"
        rc, _, err = gate(capsys, "check-manifest", "--built", built, "--expected-manifest", committed, "--stamp", stamp)
        assert rc == EXIT_REFUSED and not stamp.exists()
        assert f"changed_files[{expected['changed_files'][0]['path']}].sha256_after" in err, err
        assert f"run {fix} and review the diff of {committed}" in err, err
        committed.write_bytes(built.read_bytes())
        rc, _, err = gate(capsys, "check-manifest", "--built", built, "--expected-manifest", committed, "--stamp", stamp)
        assert rc == 0 and stamp.is_file(), err


def test_manifest_commands_refuse_a_non_utf8_manifest_in_one_line(applied: dict[str, Path], tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Bad bytes in --built or --expected-manifest are bad input (exit 2, one line), not a traceback."""
    garbage = tmp_path / "garbage.json"
    garbage.write_bytes(b"\x80{}\n")
    for args in (["check-manifest", "--built", garbage, "--expected-manifest", applied["manifest"]],
                 ["check-manifest", "--built", applied["manifest"], "--expected-manifest", garbage],
                 ["install-manifest", "--built", garbage, "--expected-manifest", tmp_path / "out.manifest.json"]):
        rc, _, err = gate(capsys, *args)
        assert rc == 2 and "unreadable" in err and str(garbage) in err and err.count("\n") == 1, err
    assert not (tmp_path / "out.manifest.json").exists()


def test_install_manifest_writes_the_workspace_file_atomically(applied: dict[str, Path], tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """What `bazel run //sglang_patches:update_manifest` runs: relative paths are the workspace's."""
    workspace = tmp_path / "workspace"
    (workspace / "sglang_patches").mkdir(parents=True)
    committed = workspace / "sglang_patches" / "default.manifest.json"
    committed.write_text('{"schema_version": 1, "patches": []}\n')
    monkeypatch.setenv("BUILD_WORKSPACE_DIRECTORY", str(workspace))
    monkeypatch.chdir(tmp_path)
    rc, _, err = gate(capsys, "install-manifest", "--built", applied["manifest"],
                      "--expected-manifest", "sglang_patches/default.manifest.json")
    assert rc == 0, err
    assert committed.read_bytes() == applied["manifest"].read_bytes()
    assert "fields changed" in err and "changed_files[" in err
    assert sorted(p.name for p in committed.parent.iterdir()) == ["default.manifest.json"]
    not_manifest = tmp_path / "table.json"
    not_manifest.write_text('{"rows": []}\n')
    rc, _, err = gate(capsys, "install-manifest", "--built", not_manifest, "--expected-manifest", "sglang_patches/default.manifest.json")
    assert rc == 2 and err == (f"error: --built {not_manifest}: $: unknown key 'rows' (known: changed_files, layout, "
                               "patches, record_files_with_hash, schema_version, series, target, "
                               "untouched_files_verified); pass the patch gate's manifest.json\n"), err
    assert committed.read_bytes() == applied["manifest"].read_bytes()


def _load_check_module():
    spec = importlib.util.spec_from_file_location("check_tree", REPO / "tests" / "cpu" / "patch_gate" / "check_tree.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_check_target_fails_on_a_tree_its_manifest_does_not_describe(applied: dict[str, Path], tmp_path: Path) -> None:
    """//sglang_patches:check (tests/cpu/patch_gate/check_tree.py) compares the tree consumers get with its manifest."""
    check = _load_check_module()
    manifest = json.loads(applied["manifest"].read_text())
    assert check.tree_problems(applied["out"], manifest) == []
    tree = tmp_path / "tree"
    shutil.copytree(applied["out"], tree, copy_function=os.link)
    (tree / CORE_PY).unlink()
    (tree / CORE_PY).write_bytes(b"# not the patched file\n")
    (problem,) = check.tree_problems(tree, manifest)
    assert problem.startswith(f"{CORE_PY}: the tree has "), problem


# ----------------------------------------------------------------------------- damaged and malicious wheels


def zip_wheel(path: Path, members: list[tuple[zipfile.ZipInfo | str, bytes]]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for info, data in members:
            archive.writestr(info, data)
    return path


def small_wheel(tmp_path: Path, files: dict[str, bytes], record_edit: tuple[str, str] | None = None,
                extra: list[tuple[zipfile.ZipInfo | str, bytes]] = ()) -> Path:
    """A tiny wheel (valid RECORD unless `record_edit` = (old, new) rewrites part of it) plus `extra` members."""
    tree = small_wheel_tree(tmp_path / "src", files)
    if record_edit is not None:
        record = tree / "demo-1.0.dist-info" / "RECORD"
        text = record.read_text()
        assert record_edit[0] in text
        record.write_text(text.replace(record_edit[0], record_edit[1], 1))
    members = [(rel, (tree / rel).read_bytes()) for rel in sorted(wheel_repack.list_tree_files(tree))]
    return zip_wheel(tmp_path / "demo-1.0-py3-none-any.whl", members + list(extra))


def error_lines(err: str) -> list[str]:
    """stderr without the gate's progress lines: what the user is told went wrong."""
    return [line for line in err.splitlines() if not line.startswith("patch_gate: ")]


def empty_series(tmp_path: Path) -> Path:
    series = tmp_path / "empty.series"
    series.write_text("# nothing\n")
    return series


def test_member_with_bad_crc_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wheel = small_wheel(tmp_path, {"demo/__init__.py": b"VALUE = 'original bytes'\n"})
    data = bytearray(wheel.read_bytes())
    at = data.index(b"original bytes")  # stored uncompressed: flip one byte of the member's data
    data[at] ^= 0x20
    wheel.write_bytes(bytes(data))
    rc, _, err = gate(capsys, *check_args(empty_series(tmp_path), wheel))
    assert rc == 2, err
    (line,) = error_lines(err)
    assert line.startswith(f"error: wheel {wheel.name}: member demo/__init__.py is damaged (Bad CRC-32"), err
    with pytest.raises(UserError, match=r"member demo/__init__.py is damaged"):
        wheel_repack.unpack_wheel(wheel, tmp_path / "unpacked")


@pytest.mark.parametrize("field, bad, message", [
    ("size", "12x", "size '12x' is not a number"),
    ("size", "-6", "size '-6' is not a number"),
    ("hash", "sha256=not*base64!", "hash 'sha256=not*base64!' is not urlsafe base64"),
    ("hash", "sha256=AAAA", "hash 'sha256=AAAA' is 3 bytes, not a sha256"),
])
def test_malformed_record_field_is_named(field: str, bad: str, message: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    data = b"x = 1\n"
    b64 = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    good = f"sha256={b64},{len(data)}"
    edited = f"sha256={b64},{bad}" if field == "size" else f"{bad},{len(data)}"
    wheel = small_wheel(tmp_path, {"demo/__init__.py": data}, record_edit=(good, edited))
    rc, _, err = gate(capsys, *check_args(empty_series(tmp_path), wheel))
    assert rc == 2, err
    (line,) = error_lines(err)
    assert f"error: wheel {wheel.name}: demo-1.0.dist-info/RECORD row 1 (demo/__init__.py): {message}" in line, err


def _symlink_member(name: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name)
    info.create_system = 3
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    return info


@pytest.mark.parametrize("member, message", [
    ("../evil.py", "contains '..'"),
    ("demo/../../evil.py", "contains '..'"),
    ("/etc/evil.py", "is absolute"),
    ("C:/evil.py", "is absolute"),
    ("demo/.git/config", "contains '.git'"),
    (_symlink_member("demo/link.py"), "member demo/link.py is a symlink"),
    ("demo/__init__.py", "member demo/__init__.py appears twice"),
])
def test_malicious_wheel_members_are_refused(member: zipfile.ZipInfo | str, message: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.warns(UserWarning, match="Duplicate name") if member == "demo/__init__.py" else contextlib.nullcontext():
        wheel = small_wheel(tmp_path, {"demo/__init__.py": b"x = 1\n"}, extra=[(member, b"/etc/passwd")])
    out_dir = tmp_path / "out"
    rc, _, err = gate(capsys, *apply_args(empty_series(tmp_path), wheel, out_dir))
    assert rc == 2, err
    (line,) = error_lines(err)
    assert message in line and wheel.name in line, err
    assert not out_dir.exists() and not (tmp_path / "evil.py").exists()
    unpacked = tmp_path / "unpacked"
    unpacked.mkdir()
    with pytest.raises(UserError, match=re.escape(message)):
        wheel_repack.unpack_wheel(wheel, unpacked)
    assert list(unpacked.iterdir()) == []


# ----------------------------------------------------------------------------- committed manifests


def test_default_manifest_agrees_with_lock_and_pinned_wheel(fi_tree: Path) -> None:
    """#4460 itself is GitHub-only, but its manifest's inputs and before-hashes are checkable here."""
    raw = (REPO / "flashinfer_patches" / "default.manifest.json").read_bytes()
    manifest = json.loads(raw)
    assert raw == review_json(manifest)
    lock = json.loads(LOCK.read_text())
    assert manifest["target"]["sha256"] == lock["pins"][stack_pin("default", "flashinfer")]["sha256"]
    (patch,) = manifest["patches"]
    assert patch["entry"] == "pin:flashinfer-pr4460" and patch["sha256"] == lock["pins"]["flashinfer-pr4460"]["sha256"]
    assert manifest["layout"]["sha256"] == sha256_hex(FI_LAYOUT.read_bytes()), "layout changed: run update-manifest"
    python_files = [c for c in manifest["changed_files"] if c["path"].endswith(".py")]
    cxx_files = [c for c in manifest["changed_files"] if c["path"].startswith("flashinfer/data/csrc/")]
    assert (len(python_files), len(cxx_files)) == (2, 5)
    assert sorted(e["source"] for e in patch["excluded"]) == ["benchmarks/routines/moe.py",
                                                              "tests/moe/test_trtllm_cutlass_fused_moe.py"]
    for entry in manifest["changed_files"]:
        assert entry["sha256_before"] == sha256_hex((fi_tree / entry["path"]).read_bytes()), entry["path"]


def test_pypi_series_matches_committed_manifest(capsys: pytest.CaptureFixture[str]) -> None:
    wheel = artifact("KIMI_TEST_FLASHINFER_PYPI_WHEEL")
    rc, out, err = gate(capsys, "check", "--series", REPO / "flashinfer_patches" / "pypi.series", "--target", wheel,
                        "--layout", FI_LAYOUT, "--lock", LOCK, "--target-pin", stack_pin("pypi", "flashinfer"),
                        "--expected-manifest", REPO / "flashinfer_patches" / "pypi.manifest.json")
    assert rc == 0, out + err


def test_pypi_wheel_already_has_situ_cutlass_api(fi_wheel: Path) -> None:
    """The pypi stack's flashinfer-python carries #4460's API upstream (parsed with ast, not
    imported); the default stack's needs #4460."""
    def situ_api(wheel: Path) -> tuple[list[str], list[str]]:
        with zipfile.ZipFile(wheel) as archive:
            core = ast.parse(archive.read(CORE_PY))
            enums = ast.parse(archive.read("flashinfer/tllm_enums.py"))
        (function,) = [n for n in core.body if isinstance(n, ast.FunctionDef) and n.name == "cutlass_fused_moe"]
        (enum,) = [n for n in enums.body if isinstance(n, ast.ClassDef) and n.name == "ActivationType"]
        members = [t.id for s in enum.body if isinstance(s, ast.Assign) for t in s.targets if isinstance(t, ast.Name)]
        return [a.arg for a in function.args.kwonlyargs], members

    kwonly, members = situ_api(artifact("KIMI_TEST_FLASHINFER_PYPI_WHEEL"))
    assert {"situ_beta", "situ_linear_beta"} <= set(kwonly) and "Situ" in members
    kwonly_default, _ = situ_api(fi_wheel)
    assert "situ_beta" not in kwonly_default, f"flashinfer-python {FI_VERSION} should need #4460"


# ----------------------------------------------------------------------------- SGLang


def test_sglang_wheel_fixture_patch_against_source_layout(sgl_wheel: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    wheel_path = "sglang/srt/layers/quantization/mxfp4.py"
    with zipfile.ZipFile(sgl_wheel) as archive:
        original = archive.read(wheel_path)
    source = "python/" + wheel_path
    patch = make_git_patch(tmp_path, {source: original, "test/registered/test_fixture.py": b"a = 1\n"},
                           {source: insert_before(original, b"class Mxfp4MoEMethod", b"# kimi-k3 fixture"),
                            "test/registered/test_fixture.py": b"a = 2\n"})
    series = write_series(tmp_path / "series", {"0001-sglang.patch": patch})
    manifest = tmp_path / "manifest.json"
    rc, out, err = gate(capsys, "check", "--series", series, "--target", sgl_wheel, "--layout", SGL_LAYOUT,
                        "--manifest", manifest)
    assert rc == 0, out + err
    assert re.search(r"^1\s+file:0001-sglang.patch\s+applies\s+" + re.escape(wheel_path), out, re.M), out
    assert "excluded: test/registered/test_fixture.py" in out
    doc = json.loads(manifest.read_text())
    assert [c["path"] for c in doc["changed_files"]] == [wheel_path]
    assert doc["untouched_files_verified"] == doc["record_files_with_hash"] - 1


@pytest.mark.parametrize("stack, wheel_var", [
    ("default", "KIMI_TEST_SGLANG_WHEEL"),
    ("pypi", "KIMI_TEST_SGLANG_PYPI_WHEEL"),
])
def test_committed_sglang_series_matches_its_manifest(stack: str, wheel_var: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The project's SGLang patches still apply to the pinned wheel and change exactly what was reviewed."""
    wheel = artifact(wheel_var)
    pin = stack_pin(stack, "sglang")
    series = REPO / "sglang_patches" / f"{stack}.series"
    expected = REPO / "sglang_patches" / f"{stack}.manifest.json"
    if not series.exists() or not expected.exists():
        pytest.fail(f"sglang_patches/{stack}.series or {stack}.manifest.json is missing: run update-manifest")
    rc, out, err = gate(capsys, "check", "--series", series, "--target", wheel, "--layout", SGL_LAYOUT,
                        "--lock", LOCK, "--target-pin", pin, "--expected-manifest", expected)
    assert rc == 0, out + err


# ----------------------------------------------------------------------------- repack


def test_repack_is_deterministic_and_consistent(applied: dict[str, Path], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    first = wheel_repack.repack_wheel(applied["out"], tmp_path / "a")
    second = wheel_repack.repack_wheel(applied["out"], tmp_path / "b")
    assert first.name == second.name and first.read_bytes() == second.read_bytes()
    match = re.fullmatch(rf"flashinfer_python-{re.escape(FI_VERSION)}\+kimik3\.([0-9a-f]{{8}})-py3-none-any\.whl",
                         first.name)
    assert match, first.name
    dist = f"flashinfer_python-{FI_VERSION}+kimik3.{match.group(1)}.dist-info"
    with zipfile.ZipFile(first) as archive:
        infos = archive.infolist()
        names = [i.filename for i in infos]
        body = [n for n in names if not n.startswith(dist + "/")]
        assert body == sorted(body) and names[-1] == f"{dist}/RECORD"
        assert not any(n.startswith(f"flashinfer_python-{FI_VERSION}.dist-info/") for n in names)
        assert {i.date_time for i in infos} == {(2023, 11, 14, 22, 13, 20)}
        assert {(i.external_attr >> 16) for i in infos} <= {0o100644, 0o100755}
        assert f"\nVersion: {FI_VERSION}+kimik3.{match.group(1)}\n".encode() in archive.read(f"{dist}/METADATA")
        rows = list(csv.reader(io.StringIO(archive.read(f"{dist}/RECORD").decode())))
        assert sorted(r[0] for r in rows) == sorted(names)
        for path, digest, size in rows:
            if path.endswith("/RECORD"):
                continue
            data = archive.read(path)
            b64 = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert (digest, int(size)) == (f"sha256={b64}", len(data)), path
        assert b"kimi-k3 fixture" in archive.read(CORE_PY)
    # The digest names the content: one changed byte gives another version.
    changed = tmp_path / "changed"
    shutil.copytree(applied["out"], changed, copy_function=os.link)
    core = (changed / CORE_PY).read_bytes()
    (changed / CORE_PY).unlink()
    (changed / CORE_PY).write_bytes(core + b"#")
    dist = wheel_repack.find_dist_info(changed)
    assert wheel_repack.content_digest(changed, dist)[:8] != match.group(1)


def test_repack_takes_exec_bits_from_the_upstream_wheel(applied: dict[str, Path], fi_wheel: Path,
                                                       tmp_path: Path) -> None:
    """Bazel marks every output file executable: the repack must not carry that into the wheel
    (nor into its version digest), so exec bits come from the upstream wheel."""
    tree = tmp_path / "tree"
    shutil.copytree(applied["out"], tree)
    plain = wheel_repack.repack_wheel(tree, tmp_path / "plain", modes_from=fi_wheel)
    for f in tree.rglob("*"):
        if f.is_file():
            f.chmod(0o555)  # as a Bazel tree artifact
    bazelish = wheel_repack.repack_wheel(tree, tmp_path / "bazel", modes_from=fi_wheel)
    assert plain.name == bazelish.name and plain.read_bytes() == bazelish.read_bytes()
    with zipfile.ZipFile(fi_wheel) as up, zipfile.ZipFile(bazelish) as out:
        upstream = {i.filename: bool((i.external_attr >> 16) & 0o111) for i in up.infolist()}
        for info in out.infolist():
            if info.filename in upstream:
                assert bool((info.external_attr >> 16) & 0o111) == upstream[info.filename], info.filename


def test_repacked_wheel_passes_the_gate_untouched(applied: dict[str, Path], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = gate(capsys, "repack-wheel", "--tree", applied["out"], "--out-dir", tmp_path / "wheel",
                        "--wheel-name-out", tmp_path / "name.txt")
    assert rc == 0, err
    wheel = tmp_path / "wheel" / (tmp_path / "name.txt").read_text().strip()
    empty = tmp_path / "empty.series"
    empty.write_text("# nothing\n")
    manifest = tmp_path / "m.json"
    rc, out, err = gate(capsys, *check_args(empty, wheel, "--manifest", manifest))
    assert rc == 0, out + err
    doc = json.loads(manifest.read_text())
    assert doc["untouched_files_verified"] == doc["record_files_with_hash"] > 5000


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


def test_the_remapped_dir_replaces_only_its_own_output(tmp_path: Path) -> None:
    """--remapped-dir naming a directory of the user's is refused and kept; its own is replaced."""
    from tools.patch_gate.gate import write_remapped

    users = tmp_path / "mine"
    users.mkdir()
    (users / "notes.txt").write_text("keep\n")
    with pytest.raises(UserError) as e:
        write_remapped(users, [], "--remapped-dir")
    assert str(e.value).startswith(f"--remapped-dir {users}: exists, is not empty and holds files that")
    assert [p.name for p in users.iterdir()] == ["notes.txt"]
    write_remapped(tmp_path / "remapped", [], "--remapped-dir")
    write_remapped(tmp_path / "remapped", [], "--remapped-dir")
