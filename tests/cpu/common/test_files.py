"""tools/common/files.py: atomic writes and the one atomic directory swap every stage uses.

The swap was written three times (the patch gate's tree, tools/fetch's tar extraction, the Debian
sets' trees and repositories) with different guarantees; these tests pin the one left.
"""
from __future__ import annotations

import json
import multiprocessing
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).absolute().parents[3]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tools.common.errors import UserError  # noqa: E402
from tools.common.files import (  # noqa: E402
    OUTPUT_MARKER, check_replaceable_dir, dir_replaced_atomically, replace_dir, scratch_dir, temp_dir_sibling)

TOOL = "tests.cpu.common.test_files"


def _replace_worker(args: tuple[str, int, int]) -> list[str]:
    """Replace `target` `rounds` times with fresh directories; return the errors (none expected)."""
    target, worker, rounds = Path(args[0]), args[1], args[2]
    errors = []
    for i in range(rounds):
        new = Path(tempfile.mkdtemp(prefix=f".new-{worker}-", dir=target.parent))
        for n in range(20):
            (new / f"f{n}").write_text(f"{worker}.{i}\n")
        try:
            replace_dir(new, target, "--out", tool=TOOL)
        except Exception as e:  # noqa: BLE001 - any failure is what the test reports
            errors.append(f"{type(e).__name__}: {e}")
            shutil.rmtree(new, ignore_errors=True)
    return errors


def test_concurrent_replacements_of_one_output_dir(tmp_path: Path) -> None:
    target = tmp_path / "out" / "tree"
    with dir_replaced_atomically(target, "--out", tool=TOOL) as first:  # a previous output
        (first / "f0").write_text("first\n")
    seen_missing = 0
    with multiprocessing.get_context("fork").Pool(4) as pool:
        pending = pool.map_async(_replace_worker, [(str(target), w, 40) for w in range(4)])
        while not pending.ready():
            if not target.is_dir():  # a reader must always find a directory
                seen_missing += 1
        errors = [e for worker in pending.get() for e in worker]
    assert errors == [], errors[:3]
    assert seen_missing == 0, f"the output directory was missing {seen_missing} times during replacements"
    assert target.is_dir() and len(list(target.iterdir())) == 20 + 1  # and the marker
    # The lock is the directory itself: no lock file, no previous tree, no temp dir stays behind.
    assert sorted(p.name for p in target.parent.iterdir()) == ["tree"]


def test_a_failed_build_leaves_the_previous_tree_and_no_temp_dir(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with dir_replaced_atomically(out, "--out", tool=TOOL) as tmp:
        (tmp / "old.txt").write_text("old\n")
    with pytest.raises(RuntimeError, match="half way"):
        with dir_replaced_atomically(out, "--out", tool=TOOL) as tmp:
            (tmp / "new.txt").write_text("new\n")
            raise RuntimeError("half way")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in out.iterdir()) == [OUTPUT_MARKER, "old.txt"]
    with dir_replaced_atomically(out, "--out", tool=TOOL) as tmp:
        (tmp / "new.txt").write_text("new\n")
    assert sorted(p.name for p in out.iterdir()) == [OUTPUT_MARKER, "new.txt"] and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert out.stat().st_mode & 0o777 == 0o755  # not mkdtemp's 0700


def test_a_file_or_link_in_the_way_is_one_line_and_stays(tmp_path: Path) -> None:
    for kind in ("file", "link"):
        target = tmp_path / kind
        if kind == "file":
            target.write_text("keep\n")
        else:
            target.symlink_to(tmp_path)
        new = temp_dir_sibling(target)
        with pytest.raises(UserError) as e:
            replace_dir(new, target, "--out", tool=TOOL)
        assert str(e.value) == f"--out {target}: exists and is not a directory; remove it or pick another path"
        assert new.is_dir() and (target.is_symlink() if kind == "link" else target.read_text() == "keep\n")
        shutil.rmtree(new)



def _users_tree(path: Path) -> dict[str, bytes]:
    """A directory of the user's: files and a .git, none written by any tool."""
    (path / ".git").mkdir(parents=True)
    (path / ".git" / "HEAD").write_bytes(b"ref: refs/heads/main\n")
    (path / "notes.txt").write_bytes(b"uncommitted work\n")
    return _snapshot(path)


def _snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("tool", [TOOL, None])
def test_a_users_directory_is_refused_before_any_work_and_kept(tmp_path: Path, tool: str | None) -> None:
    """The data-loss case: `--out DIR` naming a directory of the user's (under `bazel run`, `--out
    .` is the checkout) replaced it whole. Refused now, before the block runs, and kept."""
    out = tmp_path / "checkout"
    before = _users_tree(out)
    ran = []
    with pytest.raises(UserError) as e:
        with dir_replaced_atomically(out, "--out", tool=tool) as tmp:
            ran.append(tmp)
    assert ran == [] and _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkout"]  # no temp sibling
    who = tool or "this tool"
    assert str(e.value) == (f"--out {out}: exists, is not empty and holds files that {who} did "
                            f"not write (no {OUTPUT_MARKER} marker); pass another path (a new or "
                            "empty directory), or remove it yourself")
    new = temp_dir_sibling(out)  # the direct form too, even for a finished tree
    with pytest.raises(UserError, match="not empty"):
        replace_dir(new, out, "--out", tool=tool)
    assert _snapshot(out) == before and new.is_dir()


def test_only_an_empty_directory_or_the_same_tools_output_is_replaced(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with dir_replaced_atomically(empty, "--out", tool=None) as tmp:
        (tmp / "layer.tar").write_bytes(b"x")
    assert _snapshot(empty) == {"layer.tar": b"x"}  # a shipped tree: no marker in it
    with pytest.raises(UserError, match="not empty"):  # and so never replaced again
        check_replaceable_dir(empty, "--out", None)
    out = tmp_path / "out"
    with dir_replaced_atomically(out, "--out", tool=TOOL) as tmp:
        (tmp / "a").write_bytes(b"1")
    assert json.loads((out / OUTPUT_MARKER).read_bytes()) == {"tool": TOOL}
    with dir_replaced_atomically(out, "--out", tool=TOOL) as tmp:  # its own: replaced
        (tmp / "b").write_bytes(b"2")
    assert sorted(_snapshot(out)) == [OUTPUT_MARKER, "b"]
    with pytest.raises(UserError) as e:  # another tool's output is not this one's to replace
        check_replaceable_dir(out, "--out-dir", "tools.other")
    assert str(e.value).startswith(f"--out-dir {out}: exists, is not empty and holds the output of {TOOL};")
    (out / OUTPUT_MARKER).write_bytes(b"not json")  # a file of that name proves nothing
    with pytest.raises(UserError, match="did not write"):
        check_replaceable_dir(out, "--out", TOOL)


def test_an_out_under_a_regular_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("keep\n")
    for out in (tmp_path / "file" / "out", tmp_path / "file" / "a" / "b"):
        with pytest.raises(UserError) as e:
            with dir_replaced_atomically(out, "--out", tool=TOOL):
                pass
        assert str(e.value) == f"--out {out}: {tmp_path / 'file'} is not a directory; pass a path under a directory"
    assert (tmp_path / "file").read_text() == "keep\n" and sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_tree_made_read_only_and_writable_again(tmp_path: Path) -> None:
    from tools.common.files import set_tree_writable

    root = tmp_path / "cache"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "m.so").write_bytes(b"x")
    target = tmp_path / "elsewhere"
    target.write_text("not ours")
    target.chmod(0o600)
    (root / "link").symlink_to(target)
    set_tree_writable(root, False)
    modes = {p.relative_to(root).as_posix(): p.lstat().st_mode & 0o777 for p in root.rglob("*") if not p.is_symlink()}
    assert modes == {"a": 0o555, "a/b": 0o555, "a/b/m.so": 0o444} and root.stat().st_mode & 0o777 == 0o555
    assert target.stat().st_mode & 0o777 == 0o600  # a link's target is not touched
    set_tree_writable(root, True)
    assert (root / "a" / "b" / "m.so").stat().st_mode & 0o777 == 0o644 and root.stat().st_mode & 0o777 == 0o755
    shutil.rmtree(root)


def test_a_read_only_copy_is_read_only_in_the_block_and_removable_after(tmp_path: Path) -> None:
    from tools.common.files import read_only_copy

    src = tmp_path / "cache"
    (src / "k").mkdir(parents=True)
    (src / "k" / "m.cubin").write_bytes(b"x")
    with pytest.raises(RuntimeError):
        with read_only_copy(src, tmp_path / "copy") as copy:
            assert (copy / "k" / "m.cubin").read_bytes() == b"x"
            assert (copy / "k").stat().st_mode & 0o777 == 0o555
            assert (copy / "k" / "m.cubin").stat().st_mode & 0o777 == 0o444
            raise RuntimeError("the block fails")
    assert (tmp_path / "copy" / "k").stat().st_mode & 0o777 == 0o755  # writable again, even after a failure
    shutil.rmtree(tmp_path / "copy")
    assert (src / "k").stat().st_mode & 0o777 == 0o755  # the source is never touched


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


def _hold_scratch_then_wait(parent: str, ready, name) -> None:  # a child: opens a scratch dir and stays
    with scratch_dir("kimi-k3-test.", Path(parent)) as path:
        (path / "big").write_bytes(b"x" * 1000)
        name.value = str(path).encode()
        ready.set()
        import time
        time.sleep(60)


def test_a_killed_owners_scratch_is_swept_and_a_live_ones_kept(tmp_path: Path) -> None:
    import os
    import signal
    ctx = multiprocessing.get_context("fork")
    procs, paths = [], []
    for _ in range(2):
        ready, name = ctx.Event(), ctx.Array("c", 4096)
        p = ctx.Process(target=_hold_scratch_then_wait, args=(str(tmp_path), ready, name))
        p.start()
        assert ready.wait(30)
        procs.append(p)
        paths.append(Path(name.value.decode()))
    foreign = tmp_path / "kimi-k3-test.users-own"  # same prefix, no owner lock: not ours
    foreign.mkdir()
    (foreign / "keep").write_text("x")
    os.kill(procs[0].pid, signal.SIGKILL)  # never reaches its cleanup
    procs[0].join()
    assert paths[0].is_dir()
    try:
        with scratch_dir("kimi-k3-test.", tmp_path) as mine:
            assert (mine / ".owner.lock").is_file()
            assert not paths[0].exists()  # the killed owner's, removed
            assert (paths[1] / "big").is_file()  # the live owner's, kept
            assert (foreign / "keep").is_file()
        assert not mine.exists()
    finally:
        procs[1].kill()
        procs[1].join()
