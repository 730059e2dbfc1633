"""git pins: commits fetched into the cache's bare repositories (from a local checkout, a
mirror's bare repository, or the origin), verified by tree id; `git_diff` pins rendered as the
canonical diff (byte-identical on every host), `git_tree` pins as a deterministic tar.

A `git_tree` pin with `paths` takes only what the archive of those directories reads (its
paths closure: the commit, every tree, the blobs under the paths and every .gitattributes),
copied object by object (`git pack-objects` of exactly those ids) from a source that has them,
which may lack other blobs, into repositories kept apart from those of whole commits."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import IO, Callable, Mapping, Sequence

from tools.common.errors import UserError
from tools.common.hashing import sha256_file
from tools.fetch.cache import Cache, tree_index_key
from tools.fetch.sources import FILL_MIRROR_HINT, SourceFailed, evict_command, from_mirror_file, note_failure
from tools.pins.lock import GitDiffPin, GitTreePin

REF_PREFIX = "refs/kimi-k3/"
# The folder (in the cache: Cache.git_paths_repo; in a mirror: mirror_repo_path) of the
# repositories that hold paths closures, commits whose other blobs may be absent.
PATHS_REPOS = "git-paths"
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
        stdout: IO[bytes] | None = None, stdin: IO[bytes] | None = None,
        input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    """Run git without prompts; raises SourceFailed with git's last stderr line on failure.
    `stdin` (a file) or `input` (bytes) feed it; neither: no input."""
    cmd = ["git"]
    for item in config:
        cmd += ["-c", item]
    if git_dir is not None:
        cmd += ["--git-dir", str(git_dir)]
    cmd += list(args)
    env = dict(os.environ, GIT_TERMINAL_PROMPT="0", LC_ALL="C", GIT_ATTR_NOSYSTEM="1")
    env.pop("GIT_DIR", None)
    if input is None and stdin is None:
        stdin = subprocess.DEVNULL  # type: ignore[assignment]  (never a prompt's terminal)
    result = subprocess.run(cmd, env=env, stdout=stdout if stdout is not None else subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=stdin, input=input)
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


def mirror_repo_path(mirror: Path, repository: str, top: str = "git") -> Path:
    """`<mirror>/git/<host>/<owner>/<repo>.git` for a repository URL (DESIGN.md); top=PATHS_REPOS:
    `<mirror>/git-paths/...`, the repository of its paths closures."""
    parsed = urllib.parse.urlparse(repository)
    host = parsed.hostname or "localhost"
    parts = [p for p in parsed.path.split("/") if p]
    if not parts:
        raise UserError(f"repository URL {repository!r} has no path; use https://HOST/OWNER/REPO")
    repo = parts[-1][:-4] if parts[-1].endswith(".git") else parts[-1]
    owner = parts[-2] if len(parts) >= 2 else "_"
    return mirror / top / host / owner / f"{repo}.git"


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
        pin, cache, mirrors, from_git,
        lambda failures: ensure_commits(cache, pin.name, pin.repository, wanted, mirrors, from_git, failures),
        lambda repo, out: write_canonical_diff(repo, pin.parent, pin.commit, out),
        f"canonical diff {pin.parent[:12]}..{pin.commit[:12]} generated", "trees matched", "diffs")


def fetch_rendered_pin(pin: GitDiffPin | GitTreePin, cache: Cache, mirrors: Sequence[Path], from_git: str | None,
                       ensure: Callable[[list[str]], Path | None], render: Callable[[Path, IO[bytes]], None],
                       rendered: str, matched: str, kind: str) -> Path:
    """A pin whose sha256 is of bytes git renders from commits (a diff, an archive): the cache,
    else `<mirror>/<filename>`, else the commits (`ensure`: the repository holding them, checked
    against their tree ids, or None with the failures filled) rendered here and refused when this
    git renders other bytes. `rendered`, `matched`, `kind` word that error."""
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
        cache_repo = ensure(failures)
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


def write_canonical_archive(cache_repo: Path, commit: str, out: IO[bytes], paths: Sequence[str] = ()) -> None:
    # Archiving the commit (not the tree) makes every mtime the commit time: deterministic.
    # `paths` as literal pathspecs: a directory named like a glob is that directory, nothing else.
    pathspecs = ["--", *(f":(literal){p}" for p in paths)] if paths else []
    git(["archive", "--format=tar", commit, *pathspecs], git_dir=cache_repo, config=["tar.umask=0022"], stdout=out)
    out.flush()
    os.fsync(out.fileno())


def fetch_git_tree_pin(pin: GitTreePin, cache: Cache, mirrors: Sequence[Path], timeout: float,
                       from_git: str | None = None) -> Path:
    """A deterministic `git archive` tar of the pin's commit (of its `paths` only, when it has
    them), in the CAS. A pin with `sha256` (an archived pin) is served from `<mirror>/<filename>`
    too, and its tar must match."""
    if pin.sha256:
        return fetch_archived_tree_pin(pin, cache, mirrors, from_git)
    what = f"pin '{pin.name}'"
    key = tree_index_key(pin.tree, list(pin.paths))
    with cache.locked(f"tree-{key}"):
        recorded = cache.tree_entry(key)
        if recorded:
            hit = cache.verified_entry(recorded, what, evict_command(pin))
            if hit:
                return hit
        cache.clean_stale_temps(f"tree-{key}")
        failures: list[str] = []
        cache_repo = ensure_tree_pin_objects(cache, pin, mirrors, from_git, failures)
        if cache_repo is None:
            raise git_pin_missing(pin, failures)
        with cache.temp_file(f"tree-{key}") as (tmp, out):
            write_canonical_archive(cache_repo, pin.commit, out, list(pin.paths))
            sha256 = sha256_file(tmp)
            # Always rename: a same-named entry is either identical or corrupt, and this one is fresh.
            entry = cache.commit(tmp, sha256)
        cache.record_tree(key, sha256)
        return entry


def fetch_archived_tree_pin(pin: GitTreePin, cache: Cache, mirrors: Sequence[Path], from_git: str | None) -> Path:
    rendered = f"`git archive` of {pin.commit[:12]}" + (f" -- {' '.join(pin.paths)}" if pin.paths else "")
    entry = fetch_rendered_pin(pin, cache, mirrors, from_git,
                               lambda failures: ensure_tree_pin_objects(cache, pin, mirrors, from_git, failures),
                               lambda repo, out: write_canonical_archive(repo, pin.commit, out, list(pin.paths)),
                               rendered, "tree matched", "archives")
    cache.record_tree(tree_index_key(pin.tree, list(pin.paths)), pin.sha256)
    return entry


def ensure_tree_pin_objects(cache: Cache, pin: GitTreePin, mirrors: Sequence[Path], from_git: str | None,
                            failures: list[str]) -> Path | None:
    """The cache repository holding what the pin's archive reads, verified against the lock: the
    whole commit, or with `paths` their closure; None (with `failures` filled) when no source has it."""
    if not pin.paths:
        return ensure_commits(cache, pin.name, pin.repository, [(pin.commit, pin.tree, "tree")], mirrors,
                              from_git, failures)
    got = ensure_paths_objects(cache, f"pin '{pin.name}'", pin.repository, pin.commit, list(pin.paths), mirrors,
                               from_git, failures, pin)
    return got[0] if got else None


# ---------------------------------------------------------------------------------------------
# Paths closures: what `git archive COMMIT -- PATHS` reads, copied without the other blobs


def paths_closure(git_dir: Path, commit: str, paths: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """The ids of what `git archive COMMIT -- PATHS` reads, and the tree id of each of `paths`
    that is a directory of the commit. The archive reads every tree (it loads the whole tree
    into an index for .gitattributes lookups), every .gitattributes on the way, and the blobs
    under the paths; blobs elsewhere it never opens (git 2.39 names the first absent one on
    stderr and goes on), so a source may lack them. Raises SourceFailed when `git_dir` lacks the
    commit or one of its trees."""
    if not has_commit(git_dir, commit):
        raise SourceFailed(f"commit {commit} not found")
    listing = git(["ls-tree", "-r", "-t", "-z", "--full-tree", commit], git_dir=git_dir).stdout
    objects = [commit, tree_of(git_dir, commit)]
    wanted = set(paths)
    under = tuple(f"{p}/" for p in paths)
    found: dict[str, str] = {}
    for record in listing.split(b"\0"):
        if not record:
            continue
        meta, _, raw_name = record.partition(b"\t")
        _mode, kind, oid = meta.decode("ascii").split(" ")
        name = raw_name.decode("utf-8", "surrogateescape")
        if kind == "tree":
            objects.append(oid)
            if name in wanted:
                found[name] = oid
        elif kind == "blob" and (name.startswith(under) or name.rpartition("/")[2] == ".gitattributes"):
            objects.append(oid)
        # kind "commit": a submodule's gitlink, which `git archive` leaves out.
    return list(dict.fromkeys(objects)), found


def missing_objects(git_dir: Path, objects: Sequence[str]) -> list[str]:
    """Those of `objects` that `git_dir` does not have."""
    out = git(["cat-file", "--batch-check"], git_dir=git_dir, input="".join(f"{o}\n" for o in objects).encode())
    return [line.split(" ")[0] for line in out.stdout.decode().splitlines() if line.endswith(" missing")]


def copy_objects(src_dir: Path, dest_dir: Path, objects: Sequence[str]) -> None:
    """Copy exactly `objects` from `src_dir` into `dest_dir` (a pack of them; index-pack checks
    every object's id against its bytes). A fetch would refuse: git sends a commit's every
    object, and a source lacking one fails it."""
    with tempfile.TemporaryFile(dir=dest_dir) as pack:
        git(["pack-objects", "--stdout", "-q"], git_dir=src_dir, input="".join(f"{o}\n" for o in objects).encode(),
            stdout=pack)
        pack.seek(0)
        git(["index-pack", "--stdin"], git_dir=dest_dir, stdin=pack)


def local_git_dir(source: str) -> Path:
    """The git directory of a local source: a checkout's .git, else the (bare) directory itself."""
    path = Path(source).absolute()
    return path / ".git" if (path / ".git").exists() else path


def paths_sources(repository: str, mirrors: Sequence[Path], from_git: str | None) -> list[str]:
    """Where a paths closure may come from, in order: a local checkout, each mirror's paths
    repository then its whole one, the origin."""
    sources = [from_git] if from_git else []
    for mirror in mirrors:
        sources += [str(r) for r in (mirror_repo_path(mirror, repository, PATHS_REPOS),
                                     mirror_repo_path(mirror, repository)) if r.is_dir()]
    return sources + [repository]


def paths_source_dir(cache: Cache, repository: str, source: str, commit: str) -> Path:
    """A git directory to copy a closure from: a local source's own; a URL's commit is fetched
    whole into the cache's repository of whole commits first (git serves only whole commits)."""
    if "://" not in source:
        return local_git_dir(source)
    repo = cache.git_repo(repository)
    with cache.locked(f"git-{repo.stem}"):
        init_bare(repo)
        fetch_commits(repo, source, [commit])
    return repo


def check_paths_closure(who: str, repo: Path, commit: str, paths: Sequence[str], found: Mapping[str, str],
                        source: str, pin: GitTreePin | None) -> None:
    """Every path a directory of the commit; with `pin`, the commit's tree and each path's tree
    the lock's (without: add-git-tree, which records them)."""
    absent = [p for p in paths if p not in found]
    if absent:
        fix = ("the lock's paths name a directory the commit lacks: fix them (re-pin with `python3 -m tools.fetch "
               "add-git-tree ... --path DIR`)" if pin else
               f"pass directories of that commit (`git ls-tree -d -r --name-only {commit}`)")
        raise UserError(f"{who}: {absent[0]!r} is not a directory at commit {commit} ({source}); {fix}")
    if pin is None:
        return
    verify_tree(pin.name, repo, commit, pin.tree, "tree", source)
    for path, tree in pin.paths.items():
        if found[path] != tree:
            raise UserError(f"pin '{pin.name}': directory {path!r} at commit {commit} from {source} is tree "
                            f"{found[path]}, but the lock's paths[{path!r}] is {tree}; the lock is wrong: re-pin "
                            f"with `python3 -m tools.fetch add-git-tree ... --path {path}`")


def ensure_paths_objects(cache: Cache, who: str, repository: str, commit: str, paths: Sequence[str],
                         mirrors: Sequence[Path], from_git: str | None, failures: list[str],
                         pin: GitTreePin | None = None) -> tuple[Path, dict[str, str]] | None:
    """The cache's paths repository holding the closure of `paths` at `commit` (copied from the
    first source that has it, when it does not yet), and each path's tree id; checked with
    check_paths_closure. None (with `failures` filled) when no source has it. `who` starts
    errors ("pin 'NAME'", "add-git-tree NAME")."""
    repo = cache.git_paths_repo(repository)
    # Its own lock key: paths_source_dir takes the whole-commit repository's ("git-<stem>") inside it.
    with cache.locked(f"git-paths-{repo.stem}"):
        init_bare(repo)
        try:
            objects, found = paths_closure(repo, commit, paths)
            if len(found) == len(paths) and not missing_objects(repo, objects):
                check_paths_closure(who, repo, commit, paths, found, "the cache", pin)
                return repo, found
        except SourceFailed:
            pass  # not (all) here yet
        for source in paths_sources(repository, mirrors, from_git):
            try:
                src_dir = paths_source_dir(cache, repository, source, commit)
                objects, found = paths_closure(src_dir, commit, paths)
                check_paths_closure(who, src_dir, commit, paths, found, source, pin)
                start = time.monotonic()
                print(f"git: copying {len(objects)} objects of {commit[:12]} ({', '.join(paths)}) from {source}",
                      file=sys.stderr, flush=True)
                copy_objects(src_dir, repo, objects)
                # A ref keeps `git gc` from pruning them (a gc then stops at the absent blobs instead).
                git(["update-ref", f"{REF_PREFIX}{commit}", commit], git_dir=repo)
                print(f"git: copied in {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
            except SourceFailed as e:
                failures.append(f"{source}: {e}")
                continue
            # Checked again in the copy: what the archive reads is what index-pack verified.
            try:
                objects, found = paths_closure(repo, commit, paths)
                absent = missing_objects(repo, objects)
            except SourceFailed as e:
                absent = [str(e)]
            if absent:
                raise UserError(f"{who}: the objects copied from {source} into {repo} are incomplete ({absent[0]}); "
                                "a damaged source or cache: remove that repository and retry, or pass another "
                                "--from-git")
            check_paths_closure(who, repo, commit, paths, found, source, pin)
            return repo, found
    return None


def mirror_git_repo(cache: Cache, repository: str, commits: Sequence[str], mirror: Path) -> Path:
    """Write (or extend) `<mirror>/git/.../<repo>.git` with `commits` from the cache repo."""
    dest = mirror_repo_path(mirror, repository)
    cache_repo = cache.git_repo(repository)
    if dest.is_dir():
        fetch_commits(dest, str(cache_repo), commits)
        return dest
    return new_repo(dest, lambda tmp: fetch_commits(tmp, str(cache_repo), commits))


def mirror_paths_repo(cache: Cache, pin: GitTreePin, mirror: Path) -> Path:
    """Write (or extend) `<mirror>/git-paths/.../<repo>.git` with the paths closure of `pin` from
    the cache's paths repository (ensure_paths_objects filled it)."""
    dest = mirror_repo_path(mirror, pin.repository, PATHS_REPOS)
    cache_repo = cache.git_paths_repo(pin.repository)
    objects, _ = paths_closure(cache_repo, pin.commit, list(pin.paths))

    def fill(repo: Path) -> None:
        copy_objects(cache_repo, repo, objects)
        git(["update-ref", f"{REF_PREFIX}{pin.commit}", pin.commit], git_dir=repo)

    if dest.is_dir():
        if missing_objects(dest, objects):
            fill(dest)
        return dest
    return new_repo(dest, fill)


def new_repo(dest: Path, fill: Callable[[Path], None]) -> Path:
    """A new bare repository at `dest`, filled by `fill` in a temporary one that replaces `dest`
    only when complete (a killed fill leaves no half repository behind)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        init_bare(tmp)
        fill(tmp)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest
