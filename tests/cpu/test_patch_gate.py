"""CPU tests of tools/patch_gate.py and tools/wheel_repack.py on the real pinned wheels.

Inputs (Bazel fills them from pinned repositories; unset fails, never skips):
  KIMI_TEST_FLASHINFER_WHEEL       flashinfer-python 0.6.18 wheel
  KIMI_TEST_SGLANG_WHEEL           sglang 0.5.21 wheel
  KIMI_TEST_FLASHINFER_PYPI_WHEEL  flashinfer-python 0.7.2 wheel
  KIMI_TEST_SGLANG_PYPI_WHEEL      sglang 0.5.23 wheel
Fixture patches are generated here from the wheels' own files (no upstream patch bytes, no
GitHub); everything is written under pytest's tmp_path.
"""
from __future__ import annotations

import ast
import base64
import csv
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a plain script (py_test main) from anywhere
    sys.path.insert(0, str(REPO))

from tools import patch_gate, wheel_repack  # noqa: E402
from tools.errors import run_cli  # noqa: E402
FI_LAYOUT = REPO / "flashinfer_patches" / "wheel_layout.json"
SGL_LAYOUT = REPO / "sglang_patches" / "wheel_layout.json"
LOCK = REPO / "third_party" / "pins.lock.json"
CORE_PY = "flashinfer/fused_moe/core.py"
BINDING_SRC = "csrc/fused_moe/cutlass_backend/flashinfer_cutlass_fused_moe_binding.cu"
BINDING_WHEEL = "flashinfer/data/" + BINDING_SRC
TEST_SRC = "tests/moe/test_fixture_situ.py"


def env_path(var: str) -> Path:
    """A real artifact named by an environment variable; unset or missing fails the test loudly."""
    value = os.environ.get(var)
    if not value:
        pytest.fail(f"{var} is unset: Bazel sets it from the pinned wheel; for a local run export it to the wheel path")
    path = Path(value)
    if not path.is_file():
        pytest.fail(f"{var}={value} is not a file")
    return path


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def fi_wheel() -> Path:
    return env_path("KIMI_TEST_FLASHINFER_WHEEL")


@pytest.fixture(scope="module")
def sgl_wheel() -> Path:
    return env_path("KIMI_TEST_SGLANG_WHEEL")


@pytest.fixture(scope="module")
def fi_tree(fi_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 0.6.18 wheel unpacked once per module (read-only use: tests copy what they change)."""
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
    rc = run_cli(patch_gate.main, [str(a) for a in args])
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
    rc = run_cli(patch_gate.main, [str(a) for a in apply_args(series, fi_wheel, out, FI_LAYOUT, "--manifest", manifest,
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
    remapped = next(applied["remapped"].iterdir()).read_text()
    assert f"+++ b/{BINDING_WHEEL}" in remapped and f"+++ b/{CORE_PY}" in remapped and "tests/" not in remapped


def test_manifest_lists_changed_files_and_verified_count(applied: dict[str, Path], fi_tree: Path) -> None:
    raw = applied["manifest"].read_bytes()
    manifest = json.loads(raw)
    assert raw == patch_gate.canonical_json(manifest), "manifest is not canonical JSON"
    changed = {c["path"]: c for c in manifest["changed_files"]}
    assert sorted(changed) == sorted([BINDING_WHEEL, CORE_PY])
    for path, entry in changed.items():
        assert entry["sha256_before"] == sha256_hex((fi_tree / path).read_bytes())
        assert entry["sha256_after"] == sha256_hex((applied["out"] / path).read_bytes())
        assert entry["changed_by"] == ["file:0001-fixture.patch"]
    (patch,) = manifest["patches"]
    assert patch["state"] == patch_gate.STATE_APPLIES
    assert patch["excluded"][0]["source"] == TEST_SRC and "tests/" in patch["excluded"][0]["why"]
    record_hashed = sum(1 for line in (fi_tree / "flashinfer_python-0.6.18.dist-info" / "RECORD").read_text().splitlines()
                        if line.split(",")[1])
    assert manifest["untouched_files_verified"] == record_hashed - 2
    assert manifest["target"]["version"] == "0.6.18"


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
    drifted.write_bytes(patch_gate.canonical_json(expected))
    rc, _, err = gate(capsys, "check", *common, "--expected-manifest", drifted)
    assert rc == patch_gate.EXIT_REFUSED
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
    assert doc["changed_files"] == [] and doc["patches"][0]["state"] == patch_gate.STATE_UPSTREAM
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
    assert rc == patch_gate.EXIT_REFUSED
    assert re.search(r"^1\s+file:0002-two.patch\s+conflicts", out, re.M), out


def test_conflict_leaves_previous_output_untouched(fi_tree: Path, fi_wheel: Path, tmp_path: Path,
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
    out.mkdir(parents=True)
    (out / "previous.txt").write_text("previous output\n")
    table = tmp_path / "table.txt"
    rc, stdout, _ = gate(capsys, *apply_args(series, fi_wheel, out, FI_LAYOUT, "--table", table))
    assert rc == patch_gate.EXIT_REFUSED
    assert re.search(r"^1\s+file:0001-good.patch\s+applies", stdout, re.M)
    assert re.search(r"^2\s+file:0002-bad.patch\s+conflicts", stdout, re.M)
    assert re.search(re.escape(CORE_PY) + r": hunk #1 @@ .*: conflicts", stdout), stdout
    assert "REFUSED" in stdout
    assert sorted(p.name for p in parent.iterdir()) == ["tree"], "scratch left behind"
    assert sorted(p.name for p in out.iterdir()) == ["previous.txt"] and not table.exists()
    shutil.rmtree(out)
    rc, _, _ = gate(capsys, *apply_args(series, fi_wheel, out))
    assert rc == patch_gate.EXIT_REFUSED and not out.exists()


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


def test_series_syntax_errors_name_the_line(tmp_path: Path) -> None:
    series = tmp_path / "bad.series"
    series.write_text("# ok\nfile:a.patch\npatch:b.patch\n")
    with pytest.raises(patch_gate.UserError, match=r"bad.series:3: 'patch:b.patch'"):
        patch_gate.read_series(series)
    series.write_text("file:../outside.patch\n")
    entries = patch_gate.read_series(series)
    with pytest.raises(patch_gate.UserError, match=r"contains '..'"):
        patch_gate.resolve_series(series, entries, {}, None)


def test_committed_series_files_parse() -> None:
    default = patch_gate.read_series(REPO / "flashinfer_patches" / "default.series")
    assert [e.label for e in default] == ["pin:flashinfer-pr4460"]
    pypi_text = (REPO / "flashinfer_patches" / "pypi.series").read_text()
    assert patch_gate.read_series(REPO / "flashinfer_patches" / "pypi.series") == []
    assert "0.7.2" in pypi_text and "SiTU" in pypi_text  # says why #4460 is not needed


# ----------------------------------------------------------------------------- committed manifests


def test_default_manifest_agrees_with_lock_and_pinned_wheel(fi_tree: Path) -> None:
    """#4460 itself is GitHub-only, but its manifest's inputs and before-hashes are checkable here."""
    raw = (REPO / "flashinfer_patches" / "default.manifest.json").read_bytes()
    manifest = json.loads(raw)
    assert raw == patch_gate.canonical_json(manifest)
    lock = json.loads(LOCK.read_text())
    assert manifest["target"]["sha256"] == lock["pins"]["flashinfer-python-0.6.18"]["sha256"]
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
    wheel = env_path("KIMI_TEST_FLASHINFER_PYPI_WHEEL")
    rc, out, err = gate(capsys, "check", "--series", REPO / "flashinfer_patches" / "pypi.series", "--target", wheel,
                        "--layout", FI_LAYOUT, "--lock", LOCK, "--target-pin", "flashinfer-python-0.7.2",
                        "--expected-manifest", REPO / "flashinfer_patches" / "pypi.manifest.json")
    assert rc == 0, out + err


def test_pypi_wheel_already_has_situ_cutlass_api(fi_wheel: Path) -> None:
    """flashinfer-python 0.7.2 carries #4460's API upstream (parsed with ast, not imported)."""
    def situ_api(wheel: Path) -> tuple[list[str], list[str]]:
        with zipfile.ZipFile(wheel) as archive:
            core = ast.parse(archive.read(CORE_PY))
            enums = ast.parse(archive.read("flashinfer/tllm_enums.py"))
        (function,) = [n for n in core.body if isinstance(n, ast.FunctionDef) and n.name == "cutlass_fused_moe"]
        (enum,) = [n for n in enums.body if isinstance(n, ast.ClassDef) and n.name == "ActivationType"]
        members = [t.id for s in enum.body if isinstance(s, ast.Assign) for t in s.targets if isinstance(t, ast.Name)]
        return [a.arg for a in function.args.kwonlyargs], members

    kwonly, members = situ_api(env_path("KIMI_TEST_FLASHINFER_PYPI_WHEEL"))
    assert {"situ_beta", "situ_linear_beta"} <= set(kwonly) and "Situ" in members
    kwonly_0618, _ = situ_api(fi_wheel)
    assert "situ_beta" not in kwonly_0618, "0.6.18 should need #4460"


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


@pytest.mark.parametrize("stack, pin, wheel_var", [
    ("default", "sglang-0.5.21", "KIMI_TEST_SGLANG_WHEEL"),
    ("pypi", "sglang-0.5.23", "KIMI_TEST_SGLANG_PYPI_WHEEL"),
])
def test_committed_sglang_series_matches_its_manifest(stack: str, pin: str, wheel_var: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The project's SGLang patches still apply to the pinned wheel and change exactly what was reviewed."""
    wheel = env_path(wheel_var)
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
    match = re.fullmatch(r"flashinfer_python-0\.6\.18\+kimik3\.([0-9a-f]{8})-py3-none-any\.whl", first.name)
    assert match, first.name
    dist = f"flashinfer_python-0.6.18+kimik3.{match.group(1)}.dist-info"
    with zipfile.ZipFile(first) as archive:
        infos = archive.infolist()
        names = [i.filename for i in infos]
        body = [n for n in names if not n.startswith(dist + "/")]
        assert body == sorted(body) and names[-1] == f"{dist}/RECORD"
        assert not any(n.startswith("flashinfer_python-0.6.18.dist-info/") for n in names)
        assert {i.date_time for i in infos} == {(2023, 11, 14, 22, 13, 20)}
        assert {(i.external_attr >> 16) for i in infos} <= {0o100644, 0o100755}
        assert b"\nVersion: 0.6.18+kimik3." + match.group(1).encode() + b"\n" in archive.read(f"{dist}/METADATA")
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
