"""tools/fetch: git_tree pins with `paths` (the archive of some directories of a commit).

The case they exist for: a source that lacks a blob outside those directories (a partial clone),
from which neither `git fetch` nor `git archive` of the whole commit works. Fixtures are git
repositories this file makes under tmp_path; no network.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).absolute().parents[3]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tools.common.errors import UserError  # noqa: E402
from tools.common.files import OUTPUT_MARKER  # noqa: E402
from tools.fetch import cli as fetch  # noqa: E402
from tools.fetch import git as fetch_git  # noqa: E402
from tools.fetch.cache import tree_index_key  # noqa: E402
from tools.pins import lock as lockfile  # noqa: E402
from tests.cpu.fetch.fetch_testing import (  # noqa: E402
    GIT_ENV, cas_entries, git, one_line, run_main, write_lock)

REPOSITORY = "https://github.invalid/acme/cutlass"  # never reached: every source here is local
PATHS = ["examples/common", "include", "tools/util/include"]


@pytest.fixture(autouse=True)
def hermetic_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KIMI_K3_MIRROR", raising=False)
    monkeypatch.setenv("KIMI_K3_CACHE", str(tmp_path / "env-cache"))


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tar_files(path: Path) -> list[str]:
    with tarfile.open(path) as tar:
        return sorted(m.name for m in tar.getmembers() if m.isfile())


@dataclass
class Upstream:
    work: Path
    whole: Path  # a bare clone with every object
    partial: Path  # a bare repository without media/big.png's blob (like the snapshot CUTLASS came from)
    commit: str
    tree: str
    path_trees: dict[str, str]


@pytest.fixture()
def upstream(tmp_path: Path) -> Upstream:
    """A CUTLASS-shaped repository: the three directories the FlashKDA build reads, a
    .gitattributes (read by `git archive`), docs and a binary under media/."""
    work = tmp_path / "work"
    files = {
        "include/cute/tensor.hpp": "#pragma once\n", "include/cutlass/cutlass.h": "#pragma once\n",
        "tools/util/include/cutlass/util/helper.h": "#pragma once\n", "tools/profiler/main.cpp": "int main();\n",
        "examples/common/helper.h": "#pragma once\n", "examples/00_basic/main.cu": "int main();\n",
        "README.md": "cutlass\n", ".gitattributes": "*.png binary\n",
    }
    for name, text in files.items():
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text(text)
    (work / "media").mkdir()
    (work / "media" / "big.png").write_bytes(bytes(range(256)) * 8)
    git("init", "-q", cwd=work)
    git("add", "-A", cwd=work)
    git("commit", "-qm", "v4.3.2", cwd=work)
    commit = git("rev-parse", "HEAD", cwd=work)
    whole = tmp_path / "whole.git"
    git("clone", "-q", "--bare", str(work), str(whole))
    # The partial source: every object of the commit but the png's blob, packed by hand.
    lost = git("rev-parse", f"{commit}:media/big.png", cwd=work)
    objects = [line.split(" ")[0] for line in git("rev-list", "--objects", commit, cwd=work).splitlines()]
    partial = tmp_path / "partial.git"
    git("init", "-q", "--bare", str(partial))
    pack = subprocess.run(["git", "pack-objects", "--stdout", "-q"], cwd=work, env=GIT_ENV, check=True,
                          capture_output=True, input="".join(f"{o}\n" for o in objects if o != lost).encode()).stdout
    git("index-pack", "--stdin", cwd=partial, input=pack)
    git("update-ref", "refs/heads/main", commit, cwd=partial)
    return Upstream(work=work, whole=whole, partial=partial, commit=commit,
                    tree=git("rev-parse", f"{commit}^{{tree}}", cwd=work),
                    path_trees={p: git("rev-parse", f"{commit}:{p}", cwd=work) for p in PATHS})


def whole_pin(up: Upstream, **override: Any) -> dict[str, Any]:
    return {"kind": "git_tree", "repository": f"file://{up.whole}", "commit": up.commit, "tree": up.tree, **override}


def paths_pin(up: Upstream, **override: Any) -> dict[str, Any]:
    return whole_pin(up, **{"paths": dict(up.path_trees), **override})


PATHS_FILES = ["examples/common/helper.h", "include/cute/tensor.hpp", "include/cutlass/cutlass.h",
               "tools/util/include/cutlass/util/helper.h"]


# ---------------------------------------------------------------------------------------------
# The partial source: what the paths pin is for


def test_the_partial_source_serves_no_whole_commit(tmp_path: Path, upstream: Upstream) -> None:
    # The premise: without --path, add-git-tree cannot take the commit from such a source.
    lock = write_lock(tmp_path / "l", {})
    with pytest.raises(UserError) as e:
        fetch.main(["add-git-tree", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--name", "cutlass",
                    "--repository", REPOSITORY, "--commit", upstream.commit, "--from-git", str(upstream.partial)])
    assert "add-git-tree cutlass: no source has commit" in one_line(e.value)


def test_add_git_tree_with_paths_from_a_partial_source_pins_a_tar_of_only_those_paths(
        tmp_path: Path, upstream: Upstream) -> None:
    lock = write_lock(tmp_path / "l", {})
    argv = ["add-git-tree", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--name", "cutlass",
            "--repository", REPOSITORY, "--commit", upstream.commit, "--from-git", str(upstream.partial)]
    # --path in any order: the lock gets them sorted.
    run_main(*argv, "--path", "tools/util/include", "--path", "include", "--path", "examples/common")
    entry = json.loads(lock.read_text())["pins"]["cutlass"]
    assert list(entry["paths"].items()) == list(upstream.path_trees.items())
    assert entry["tree"] == upstream.tree and entry["filename"] == f"cutlass-{upstream.commit[:8]}.tar"
    pin = lockfile.load(lock).pin("cutlass")
    assert isinstance(pin, lockfile.GitTreePin) and dict(pin.paths) == upstream.path_trees
    # The same bytes as `git archive` of those paths in a complete clone.
    expected = subprocess.run(["git", "-c", "tar.umask=0022", "archive", "--format=tar", upstream.commit, "--",
                               *PATHS], cwd=upstream.whole, env=GIT_ENV, check=True, capture_output=True).stdout
    assert entry["sha256"] == sha(expected)

    # The tar went into the CAS: fetching the new pin needs no source at all.
    out = tmp_path / "cutlass.tar"
    run_main("fetch", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--pin", "cutlass", "--out", str(out),
             "--archive")
    assert sha(out.read_bytes()) == entry["sha256"]
    assert tar_files(out) == PATHS_FILES


def test_mirror_from_a_partial_source_serves_the_paths_pin_offline(tmp_path: Path, upstream: Upstream) -> None:
    lock = write_lock(tmp_path / "l", {})
    run_main("add-git-tree", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--name", "cutlass",
             "--repository", REPOSITORY, "--commit", upstream.commit, "--from-git", str(upstream.partial),
             *(f"--path={p}" for p in PATHS))
    pin = lockfile.load(lock).pin("cutlass")
    mirror = tmp_path / "mirror"
    run_main("mirror", "--lock", str(lock), "--cache", str(tmp_path / "c2"), "--mirror", str(mirror),
             "--from-git", f"cutlass={upstream.partial}")
    assert sha((mirror / pin.filename).read_bytes()) == pin.sha256
    paths_repo = fetch_git.mirror_repo_path(mirror, REPOSITORY, fetch_git.PATHS_REPOS)
    assert paths_repo.is_dir() and not fetch_git.mirror_repo_path(mirror, REPOSITORY).exists()

    # From the mirror file (fetch --archive, as the Bazel rule runs it).
    tar = tmp_path / "a.tar"
    run_main("fetch", "--lock", str(lock), "--cache", str(tmp_path / "fresh"), "--mirror", str(mirror), "--pin",
             "cutlass", "--out", str(tar), "--archive")
    assert sha(tar.read_bytes()) == pin.sha256 and tar_files(tar) == PATHS_FILES
    # From the mirror's paths repository alone (the tar rendered again, to the same bytes).
    (mirror / pin.filename).unlink()
    again = Path(run_main("fetch", "--lock", str(lock), "--cache", str(tmp_path / "fresh2"), "--mirror", str(mirror),
                          "--pin", "cutlass"))
    assert sha(again.read_bytes()) == pin.sha256
    # Unpacked (fetch --out DIR): only the paths' files.
    out = tmp_path / "tree"
    run_main("fetch", "--lock", str(lock), "--cache", str(tmp_path / "fresh2"), "--pin", "cutlass", "--out", str(out))
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()
                  and p.name != OUTPUT_MARKER) == PATHS_FILES


# ---------------------------------------------------------------------------------------------
# One commit pinned whole and by paths: two tars, two index entries


def test_whole_and_paths_pins_of_one_commit_do_not_share_an_index_entry(tmp_path: Path, upstream: Upstream) -> None:
    cache = tmp_path / "c"
    lock = write_lock(tmp_path / "l", {"whole": whole_pin(upstream), "some": paths_pin(upstream)})
    some = Path(run_main("fetch", "--lock", str(lock), "--cache", str(cache), "--pin", "some"))
    whole = Path(run_main("fetch", "--lock", str(lock), "--cache", str(cache), "--pin", "whole"))
    assert some != whole
    assert tar_files(some) == PATHS_FILES and "media/big.png" in tar_files(whole)
    index = cache / "index" / "git_tree"
    keys = {upstream.tree: whole.name, tree_index_key(upstream.tree, PATHS): some.name}
    assert {p.name: p.read_text().strip() for p in index.iterdir()} == keys
    # Each hits its own entry again (with the origin gone), in either order.
    import shutil

    shutil.rmtree(upstream.whole)
    for name, expected in (("whole", whole), ("some", some), ("whole", whole)):
        assert Path(run_main("fetch", "--lock", str(lock), "--cache", str(cache), "--pin", name)) == expected


def test_an_archived_paths_pin_leaves_the_whole_trees_index_entry_alone(tmp_path: Path, upstream: Upstream) -> None:
    # An archived pin records its tar under its key too: without paths in the key, the whole
    # tree's entry would then name the paths' tar.
    expected = subprocess.run(["git", "-c", "tar.umask=0022", "archive", "--format=tar", upstream.commit, "--",
                               *PATHS], cwd=upstream.whole, env=GIT_ENV, check=True, capture_output=True).stdout
    cache = tmp_path / "c"
    lock = write_lock(tmp_path / "l", {"whole": whole_pin(upstream),
                                       "some": paths_pin(upstream, filename="some.tar", sha256=sha(expected))})
    whole = Path(run_main("fetch", "--lock", str(lock), "--cache", str(cache), "--pin", "whole"))
    some = Path(run_main("fetch", "--lock", str(lock), "--cache", str(cache), "--pin", "some"))
    assert some.name == sha(expected) != whole.name
    assert Path(run_main("fetch", "--lock", str(lock), "--cache", str(cache), "--pin", "whole")) == whole
    assert (cache / "index" / "git_tree" / upstream.tree).read_text().strip() == whole.name


def test_evict_of_a_paths_pin_removes_its_entry_only(tmp_path: Path, upstream: Upstream) -> None:
    cache = tmp_path / "c"
    lock = write_lock(tmp_path / "l", {"whole": whole_pin(upstream), "some": paths_pin(upstream)})
    whole = Path(run_main("fetch", "--lock", str(lock), "--cache", str(cache), "--pin", "whole"))
    some = Path(run_main("fetch", "--lock", str(lock), "--cache", str(cache), "--pin", "some"))
    assert run_main("evict", "--lock", str(lock), "--cache", str(cache), "--pin", "some") == str(some)
    assert cas_entries(cache) == [whole]
    assert [p.name for p in (cache / "index" / "git_tree").iterdir()] == [upstream.tree]


# ---------------------------------------------------------------------------------------------
# Bad paths: refused in one line naming the pin (the load-time rules: tests/cpu/pins/test_lock.py)


def test_a_path_the_commit_lacks_is_refused_at_fetch_naming_the_pin(tmp_path: Path, upstream: Upstream) -> None:
    trees = {**upstream.path_trees, "include/nope": "1" * 40}
    del trees["include"]
    lock = write_lock(tmp_path / "l", {"cutlass": paths_pin(upstream, paths=dict(sorted(trees.items())))})
    with pytest.raises(UserError) as e:
        fetch.main(["fetch", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--pin", "cutlass"])
    message = one_line(e.value)
    assert message.startswith(f"pin 'cutlass': 'include/nope' is not a directory at commit {upstream.commit}")
    assert "add-git-tree ... --path DIR" in message
    assert cas_entries(tmp_path / "c") == []


@pytest.mark.parametrize(("paths", "expected"), [
    (["include/nope"], "add-git-tree cutlass: 'include/nope' is not a directory at commit"),
    (["README.md"], "add-git-tree cutlass: 'README.md' is not a directory at commit"),
    (["../include"], "add-git-tree cutlass: --path '../include' leaves the tree ('..')"),
    (["include/"], "add-git-tree cutlass: --path 'include/' is not normalized (an empty or '.' part): write 'include'"),
    (["/include"], "add-git-tree cutlass: --path '/include' is absolute"),
    (["include", "include"], "add-git-tree cutlass: --path lists 'include' twice"),
    (["include", "include/cute"], "--path 'include/cute' lies inside 'include', which holds it already"),
])
def test_add_git_tree_refuses_a_bad_path_and_leaves_the_lock(tmp_path: Path, upstream: Upstream, paths: list[str],
                                                             expected: str) -> None:
    lock = write_lock(tmp_path / "l", {})
    before = lock.read_bytes()
    with pytest.raises(UserError) as e:
        fetch.main(["add-git-tree", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--name", "cutlass",
                    "--repository", REPOSITORY, "--commit", upstream.commit, "--from-git", str(upstream.partial),
                    *(f"--path={p}" for p in paths)])
    assert expected in one_line(e.value)
    assert lock.read_bytes() == before


def test_a_path_tree_id_other_than_the_commits_fails_naming_the_path(tmp_path: Path, upstream: Upstream) -> None:
    trees = {**upstream.path_trees, "include": upstream.path_trees["tools/util/include"]}
    lock = write_lock(tmp_path / "l", {"cutlass": paths_pin(upstream, paths=trees)})
    with pytest.raises(UserError) as e:
        fetch.main(["fetch", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--pin", "cutlass"])
    message = one_line(e.value)
    assert message.startswith(f"pin 'cutlass': directory 'include' at commit {upstream.commit}")
    assert f"is tree {upstream.path_trees['include']}, but the lock's paths['include'] is " \
           f"{upstream.path_trees['tools/util/include']}" in message
    assert "--path include" in message
    assert cas_entries(tmp_path / "c") == []


def test_a_whole_tree_id_other_than_the_commits_still_fails(tmp_path: Path, upstream: Upstream) -> None:
    lock = write_lock(tmp_path / "l", {"cutlass": paths_pin(upstream, tree=upstream.path_trees["include"])})
    with pytest.raises(UserError) as e:
        fetch.main(["fetch", "--lock", str(lock), "--cache", str(tmp_path / "c"), "--pin", "cutlass"])
    assert f"has tree {upstream.tree}, but the lock's tree is {upstream.path_trees['include']}" in one_line(e.value)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
