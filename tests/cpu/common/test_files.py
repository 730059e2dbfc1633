"""tools/common/files.py: atomic writes and the one atomic directory swap every stage uses.

The swap was written three times (the patch gate's tree, tools/fetch's tar extraction, the Debian
sets' trees and repositories) with different guarantees; these tests pin the one left.
"""
from __future__ import annotations

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
from tools.common.files import dir_replaced_atomically, replace_dir, temp_dir_sibling  # noqa: E402


def _replace_worker(args: tuple[str, int, int]) -> list[str]:
    """Replace `target` `rounds` times with fresh directories; return the errors (none expected)."""
    target, worker, rounds = Path(args[0]), args[1], args[2]
    errors = []
    for i in range(rounds):
        new = Path(tempfile.mkdtemp(prefix=f".new-{worker}-", dir=target.parent))
        for n in range(20):
            (new / f"f{n}").write_text(f"{worker}.{i}\n")
        try:
            replace_dir(new, target)
        except Exception as e:  # noqa: BLE001 - any failure is what the test reports
            errors.append(f"{type(e).__name__}: {e}")
            shutil.rmtree(new, ignore_errors=True)
    return errors


def test_concurrent_replacements_of_one_output_dir(tmp_path: Path) -> None:
    target = tmp_path / "out" / "tree"
    target.mkdir(parents=True)
    (target / "f0").write_text("first\n")
    seen_missing = 0
    with multiprocessing.get_context("fork").Pool(4) as pool:
        pending = pool.map_async(_replace_worker, [(str(target), w, 40) for w in range(4)])
        while not pending.ready():
            if not target.is_dir():  # a reader must always find a directory
                seen_missing += 1
        errors = [e for worker in pending.get() for e in worker]
    assert errors == [], errors[:3]
    assert seen_missing == 0, f"the output directory was missing {seen_missing} times during replacements"
    assert target.is_dir() and len(list(target.iterdir())) == 20
    # The lock is the directory itself: no lock file, no previous tree, no temp dir stays behind.
    assert sorted(p.name for p in target.parent.iterdir()) == ["tree"]


def test_a_failed_build_leaves_the_previous_tree_and_no_temp_dir(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old\n")
    with pytest.raises(RuntimeError, match="half way"):
        with dir_replaced_atomically(out) as tmp:
            (tmp / "new.txt").write_text("new\n")
            raise RuntimeError("half way")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert [p.name for p in out.iterdir()] == ["old.txt"]
    with dir_replaced_atomically(out) as tmp:
        (tmp / "new.txt").write_text("new\n")
    assert [p.name for p in out.iterdir()] == ["new.txt"] and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
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
            replace_dir(new, target, "--out")
        assert str(e.value) == f"--out {target}: exists and is not a directory; remove it or pick another path"
        assert new.is_dir() and (target.is_symlink() if kind == "link" else target.read_text() == "keep\n")
        shutil.rmtree(new)



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
