"""tools/common/cache.py's `prune-disk-cache`: a bad size or a disk cache that is not a directory
is one line naming where the value came from (the flag or the variable the user set)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).absolute().parents[3]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tools.common import cache  # noqa: E402
from tools.common.errors import UserError  # noqa: E402

MAX_SIZE_ENV = "KIMI_K3_DISK_CACHE_MAX_SIZE"  # tools/bazel reads the same variable


@pytest.fixture
def disk_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "disk-cache"
    monkeypatch.setenv(cache.DISK_CACHE_ENV, str(directory))
    monkeypatch.delenv(MAX_SIZE_ENV, raising=False)
    return directory


@pytest.mark.parametrize("size", ["²G", "٥٠G", "50GB", "50g", "G", "", "-5"])
def test_a_bad_max_size_names_the_flag_and_the_form(disk_cache: Path, size: str) -> None:
    with pytest.raises(UserError) as e:
        cache.main(["prune-disk-cache", "--max-size", size])
    assert str(e.value) == (f"--max-size {size}: expected a size such as 50G (ASCII digits, then "
                            "nothing for bytes or one of K, M, G, T)")


def test_a_bad_size_from_the_variable_names_the_variable(disk_cache: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MAX_SIZE_ENV, "50GB")
    with pytest.raises(UserError) as e:
        cache.main(["prune-disk-cache"])
    assert str(e.value).startswith(f"{MAX_SIZE_ENV}=50GB: expected a size such as 50G")
    assert "--max-size" not in str(e.value)


def test_a_disk_cache_path_that_is_a_file_is_refused(disk_cache: Path) -> None:
    disk_cache.write_text("not a cache")
    with pytest.raises(UserError) as e:
        cache.main(["prune-disk-cache", "--max-size", "1G"])
    assert str(e.value).startswith(f"{cache.DISK_CACHE_ENV}={disk_cache}: exists and is not a directory")
    assert disk_cache.read_text() == "not a cache"


def test_sizes_and_pruning_oldest_first(disk_cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert [cache.parse_size(s) for s in ("1000", "2K", "3M", "4G", "1T")] == [
        1000, 2 << 10, 3 << 20, 4 << 30, 1 << 40]
    cas = disk_cache / "cas" / "ab"
    cas.mkdir(parents=True)
    for age, name in enumerate(["new", "mid", "old"]):
        f = cas / name
        f.write_bytes(b"x" * 100)
        os.utime(f, (1000 - age, 1000 - age))
    assert cache.main(["prune-disk-cache", "--max-size", "150"]) == 0
    assert sorted(p.name for p in cas.iterdir()) == ["new"]
    assert "removed 2 entries" in capsys.readouterr().out


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
