"""git pins: commits fetched into the cache's bare repositories (from a local checkout, a
mirror's bare repository, or the origin), verified by tree id; `git_diff` pins rendered as the
canonical diff (byte-identical on every host), `git_tree` pins as a deterministic tar."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import IO, Callable, Sequence

from tools.common.errors import UserError
from tools.common.hashing import sha256_file
from tools.fetch.cache import Cache
from tools.fetch.sources import FILL_MIRROR_HINT, SourceFailed, evict_command, from_mirror_file, note_failure
from tools.pins.lock import GitDiffPin, GitTreePin

REF_PREFIX = "refs/kimi-k3/"
# Every `git diff` knob that user or repository config could change, pinned to git's defaults,
# so the canonical diff (docs/DESIGN.md) is byte-identical on every host.
CANONICAL_DIFF_CONFIG = (
    "core.quotepath=off", "core.attributesFile=/dev/null", "diff.noprefix=false",
    "diff.mnemonicPrefix=false", "diff.relative=false", "diff.algorithm=myers",
    "diff.indentHeuristic=true", "diff.suppressBlankEmpty=false", "diff.context=3",
    "diff.interHunkContext=0", "diff.orderFile=/dev/null", "diff.external=",
)
CANONICAL_DIFF_ARGS = ("diff", "--binary", "--full-index", "--no-color", "--no-ext-diff", "--no-textconv",
                       "--no-renames")


def git(args: Sequence[str], *, git_dir: Path | None = None, config: Sequence[str] = (),
        stdout: IO[bytes] | None = None) -> subprocess.CompletedProcess[bytes]:
    """Run git without prompts; raises SourceFailed with git's last stderr line on failure."""
    cmd = ["git"]
    for item in config:
        cmd += ["-c", item]
    if git_dir is not None:
        cmd += ["--git-dir", str(git_dir)]
    cmd += list(args)
    env = dict(os.environ, GIT_TERMINAL_PROMPT="0", LC_ALL="C", GIT_ATTR_NOSYSTEM="1")
    env.pop("GIT_DIR", None)
    result = subprocess.run(cmd, env=env, stdout=stdout if stdout is not None else subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        lines = [ln for ln in result.stderr.decode(errors="replace").splitlines() if ln.strip()]
        raise SourceFailed(lines[-1] if lines else f"git {' '.join(args[:2])} exited {result.returncode}")
    return result


def git_text(args: Sequence[str], git_dir: Path) -> str:
    return git(args, git_dir=git_dir).stdout.decode().strip()


def has_commit(git_dir: Path, commit: str) -> bool:
    try:
        return git_text(["rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"], git_dir) == commit
    except SourceFailed:
        return False


def tree_of(git_dir: Path, commit: str) -> str:
    return git_text(["rev-parse", "--verify", f"{commit}^{{tree}}"], git_dir)


def init_bare(path: Path) -> None:
    if not (path / "HEAD").exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        git(["init", "--quiet", "--bare", str(path)])


def mirror_repo_path(mirror: Path, repository: str) -> Path:
    """`<mirror>/git/<host>/<owner>/<repo>.git` for a repository URL (DESIGN.md)."""
    parsed = urllib.parse.urlparse(repository)
    host = parsed.hostname or "localhost"
    parts = [p for p in parsed.path.split("/") if p]
    if not parts:
        raise UserError(f"repository URL {repository!r} has no path; use https://HOST/OWNER/REPO")
    repo = parts[-1][:-4] if parts[-1].endswith(".git") else parts[-1]
    owner = parts[-2] if len(parts) >= 2 else "_"
    return mirror / "git" / host / owner / f"{repo}.git"


def git_source_location(source: str) -> str:
    """What to hand `git fetch`: local directories as absolute paths, URLs unchanged."""
    if "://" in source:
        return source
    return str(Path(source).absolute())


def fetch_commits(cache_repo: Path, source: str, commits: Sequence[str], depth: int = 1) -> None:
    """Make `commits` present in `cache_repo`, fetched from `source` (URL or local repo)."""
    missing = [c for c in commits if not has_commit(cache_repo, c)]
    if not missing:
        return
    refspecs = [f"{c}:{REF_PREFIX}{c}" for c in missing]
    start = time.monotonic()
    print(f"git: fetching {len(missing)} commit(s) from {source}", file=sys.stderr, flush=True)
    # Shallow: the diff and the archive need only the commits' trees, not their history.
    git(["fetch", "--quiet", "--no-tags", "--no-write-fetch-head", f"--depth={depth}",
         git_source_location(source), *refspecs], git_dir=cache_repo,
        config=["http.lowSpeedLimit=1000", "http.lowSpeedTime=60"])
    for commit in missing:
        if not has_commit(cache_repo, commit):
            raise SourceFailed(f"{source}: commit {commit} not found")
    print(f"git: fetched from {source} in {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)


def verify_tree(pin_name: str, cache_repo: Path, commit: str, expected_tree: str, field_name: str,
                source: str) -> None:
    actual = tree_of(cache_repo, commit)
    if actual != expected_tree:
        raise UserError(f"pin '{pin_name}': commit {commit} from {source} has tree {actual}, but the lock's "
                        f"{field_name} is {expected_tree}; the lock is wrong (re-pin with add-git-diff) or the "
                        "source rewrote history")


def git_sources(repository: str, mirrors: Sequence[Path], from_git: str | None) -> list[str]:
    """Where a git pin's commits may come from, in order: a local checkout, mirrors, origin."""
    sources = [from_git] if from_git else []
    sources += [str(mirror_repo_path(m, repository)) for m in mirrors if mirror_repo_path(m, repository).is_dir()]
    return sources + [repository]


def ensure_commits(cache: Cache, pin_name: str, repository: str, commits: Sequence[tuple[str, str, str]],
                   mirrors: Sequence[Path], from_git: str | None, failures: list[str]) -> Path | None:
    """Fetch (commit, expected tree, lock field) triples into the cache repo from the first
    source that has them all, verifying trees; None (with `failures` filled) when none has."""
    cache_repo = cache.git_repo(repository)
    with cache.locked(f"git-{cache_repo.stem}"):
        init_bare(cache_repo)
        for source in git_sources(repository, mirrors, from_git):
            try:
                fetch_commits(cache_repo, source, [c for c, _, _ in commits])
            except SourceFailed as e:
                failures.append(f"{source}: {e}")
                continue
            for commit, tree, field_name in commits:
                verify_tree(pin_name, cache_repo, commit, tree, field_name, source)
            return cache_repo
    return None


def write_canonical_diff(cache_repo: Path, parent: str, commit: str, out: IO[bytes]) -> None:
    git([*CANONICAL_DIFF_ARGS, parent, commit], git_dir=cache_repo, config=CANONICAL_DIFF_CONFIG, stdout=out)
    out.flush()
    os.fsync(out.fileno())


def git_pin_missing(pin: GitDiffPin | GitTreePin, failures: Sequence[str]) -> UserError:
    tried = "; ".join(failures)
    what = f" ({pin.filename})" if pin.filename else ""
    # Only stacks' patch pins have a GitHub-free alternative stack; other git pins (FlashKDA's
    # sources) feed optional targets that the default build never asks for.
    tail = ("; the `pypi` stack builds without it (`--config=pypi`)" if isinstance(pin, GitDiffPin)
            else "; only targets built from it need it")
    return UserError(
        f"pin '{pin.name}'{what} is missing: not in the cache, no mirror has it, and its origin failed "
        f"({tried}); on a connected host run `{FILL_MIRROR_HINT.format(pin=pin.name)}` (or add "
        f"`--from-git {pin.name}=CHECKOUT` to fill it from a local clone of {pin.repository}) and pass "
        f"--mirror DIR or KIMI_K3_MIRROR=DIR{tail}")


def fetch_git_diff_pin(pin: GitDiffPin, cache: Cache, mirrors: Sequence[Path], timeout: float,
                       from_git: str | None = None) -> Path:
    wanted = [(pin.commit, pin.commit_tree, "commit_tree"), (pin.parent, pin.parent_tree, "parent_tree")]
    return fetch_rendered_pin(
        pin, cache, mirrors, from_git, wanted,
        lambda repo, out: write_canonical_diff(repo, pin.parent, pin.commit, out),
        f"canonical diff {pin.parent[:12]}..{pin.commit[:12]} generated", "trees matched", "diffs")


def fetch_rendered_pin(pin: GitDiffPin | GitTreePin, cache: Cache, mirrors: Sequence[Path], from_git: str | None,
                       wanted: list[tuple[str, str, str]], render: Callable[[Path, IO[bytes]], None],
                       rendered: str, matched: str, kind: str) -> Path:
    """A pin whose sha256 is of bytes git renders from commits (a diff, an archive): the cache,
    else `<mirror>/<filename>`, else the commits (checked against their tree ids) rendered here
    and refused when this git renders other bytes. `rendered`, `matched`, `kind` word that error."""
    what = f"pin '{pin.name}'"
    hit = cache.verified_entry(pin.sha256, what, evict_command(pin))
    if hit:
        return hit
    failures: list[str] = []
    with cache.locked(pin.sha256):
        hit = cache.verified_entry(pin.sha256, what, evict_command(pin))
        if hit:
            return hit
        cache.clean_stale_temps(pin.sha256)
        if not from_git:
            for mirror in mirrors:
                try:
                    return from_mirror_file(cache, pin.sha256, pin.name, pin.sha256, None, mirror / pin.filename)
                except SourceFailed as e:
                    note_failure(pin.name, e, failures)
        cache_repo = ensure_commits(cache, pin.name, pin.repository, wanted, mirrors, from_git, failures)
        if cache_repo is None:
            raise git_pin_missing(pin, failures)
        with cache.temp_file(pin.sha256) as (tmp, out):
            render(cache_repo, out)
            actual = sha256_file(tmp)
            if actual != pin.sha256:
                raise UserError(f"pin '{pin.name}': {rendered} by {git_version()} has sha256 {actual}, expected "
                                f"{pin.sha256}; the {matched}, so this git renders {kind} differently: fill a "
                                f"mirror file with `{FILL_MIRROR_HINT.format(pin=pin.name)}` on a host whose git matches")
            return cache.commit(tmp, pin.sha256)


def git_version() -> str:
    try:
        return git(["--version"]).stdout.decode().strip()
    except (SourceFailed, OSError):
        return "git (unknown version)"


def write_canonical_archive(cache_repo: Path, commit: str, out: IO[bytes]) -> None:
    # Archiving the commit (not the tree) makes every mtime the commit time: deterministic.
    git(["archive", "--format=tar", commit], git_dir=cache_repo, config=["tar.umask=0022"], stdout=out)
    out.flush()
    os.fsync(out.fileno())


def fetch_git_tree_pin(pin: GitTreePin, cache: Cache, mirrors: Sequence[Path], timeout: float,
                       from_git: str | None = None) -> Path:
    """A deterministic `git archive` tar of the pin's commit, in the CAS. A pin with `sha256`
    (an archived pin) is served from `<mirror>/<filename>` too, and its tar must match."""
    if pin.sha256:
        return fetch_archived_tree_pin(pin, cache, mirrors, from_git)
    what = f"pin '{pin.name}'"
    with cache.locked(f"tree-{pin.tree}"):
        recorded = cache.tree_entry(pin.tree)
        if recorded:
            hit = cache.verified_entry(recorded, what, evict_command(pin))
            if hit:
                return hit
        cache.clean_stale_temps(f"tree-{pin.tree}")
        failures: list[str] = []
        cache_repo = ensure_commits(cache, pin.name, pin.repository, [(pin.commit, pin.tree, "tree")], mirrors,
                                    from_git, failures)
        if cache_repo is None:
            raise git_pin_missing(pin, failures)
        with cache.temp_file(f"tree-{pin.tree}") as (tmp, out):
            write_canonical_archive(cache_repo, pin.commit, out)
            sha256 = sha256_file(tmp)
            # Always rename: a same-named entry is either identical or corrupt, and this one is fresh.
            entry = cache.commit(tmp, sha256)
        cache.record_tree(pin.tree, sha256)
        return entry


def fetch_archived_tree_pin(pin: GitTreePin, cache: Cache, mirrors: Sequence[Path], from_git: str | None) -> Path:
    entry = fetch_rendered_pin(pin, cache, mirrors, from_git, [(pin.commit, pin.tree, "tree")],
                               lambda repo, out: write_canonical_archive(repo, pin.commit, out),
                               f"`git archive` of {pin.commit[:12]}", "tree matched", "archives")
    cache.record_tree(pin.tree, pin.sha256)
    return entry


def mirror_git_repo(cache: Cache, repository: str, commits: Sequence[str], mirror: Path) -> Path:
    """Write (or extend) `<mirror>/git/.../<repo>.git` with `commits` from the cache repo."""
    dest = mirror_repo_path(mirror, repository)
    cache_repo = cache.git_repo(repository)
    if dest.is_dir():
        fetch_commits(dest, str(cache_repo), commits)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        init_bare(tmp)
        fetch_commits(tmp, str(cache_repo), commits)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest
