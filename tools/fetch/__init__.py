"""Verified fetcher: every upstream input comes from the lock, by hash, through one cache.

    fetch        --pin NAME [--out PATH]     print the path of the verified artifact
    mirror       --mirror DIR [--stack S]... [--pin P]... [--from-git PIN=CHECKOUT]...
    add-pypi     NAME==VERSION [--platform P] [--python X.Y] [--pin-name N] [--index-url URL]
    add-git-diff --name N --repository URL --commit C [--parent P] [--from-git CHECKOUT]
    verify       schema check + table of pins
    evict        --pin NAME | --sha256 HEX
    format       rewrite the lock in canonical form

Sources are tried in order: the cache (re-verified on every hit), each mirror directory, then
each origin URL; a source with the wrong size or bytes is reported and skipped, and no source is
read past the lock's size (+1 byte, to tell "too long"). Downloads stream into a temp file inside the cache while hashing, and are
fsynced and renamed into `cas/sha256/<hex>` only after the hash matched, so nothing unverified
ever enters the cache; a per-entry flock makes concurrent fetches of one input produce one entry.

Stdlib only: this runs inside Bazel repository rules with a bare interpreter. Layout and
environment (KIMI_K3_CACHE, KIMI_K3_MIRROR) are in docs/DESIGN.md.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator, Sequence

if __package__ in (None, ""):
    # Run as `python3 -m tools.fetch`: import siblings as `tools.*` from the repository root,
    # and drop tools/ itself from the path so its module names cannot shadow the stdlib.
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from tools.pins import lock as lockfile  # noqa: E402
from tools.common.errors import UserError, run_cli  # noqa: E402
from tools.common.hashing import sha256_file
from tools.pins.lock import FilePin, GitDiffPin, GitTreePin, Lock, Pin  # noqa: E402

CHUNK = 1 << 20
_LOCK_KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
DOWNLOAD_ATTEMPTS = 2
RETRY_DELAY_S = 1.0
DEFAULT_TIMEOUT_S = 60.0
PROGRESS_INTERVAL_S = 0.5
USER_AGENT = "kimi-k3-fetch/1"
PYPI_SIMPLE = "https://pypi.org/simple"
CACHE_COMMANDS = ("fetch", "mirror", "evict", "add-git-diff")  # the ones that touch the cache
FILL_MIRROR_HINT = "python3 -m tools.fetch mirror --pin {pin} --mirror DIR"
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


# ---------------------------------------------------------------------------------------------
# Small helpers


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} GB"


class Progress:
    """Throttled byte progress on stderr: bytes, rate, ETA, then one final line."""

    def __init__(self, label: str, total: int | None, stream: IO[str] | None = None) -> None:
        self.label = label
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.start = time.monotonic()
        self.last = self.start

    def advance(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= PROGRESS_INTERVAL_S:
            self.last = now
            print(f"{self.label}: {self._status(now)}", file=self.stream, flush=True)

    def _status(self, now: float) -> str:
        elapsed = max(now - self.start, 1e-6)
        rate = self.done / elapsed
        text = human_bytes(self.done)
        if self.total:
            text += f" / {human_bytes(self.total)} ({100 * self.done / self.total:.0f}%)"
            if rate > 0:
                text += f", ETA {max(self.total - self.done, 0) / rate:.0f} s"
        return f"{text}, {human_bytes(rate)}/s"

    def finish(self, what: str) -> None:
        elapsed = time.monotonic() - self.start
        print(f"{self.label}: {what} {human_bytes(self.done)} in {elapsed:.1f} s "
              f"({human_bytes(self.done / max(elapsed, 1e-6))}/s)", file=self.stream, flush=True)




def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def default_cache_dir() -> Path:
    if os.environ.get("KIMI_K3_CACHE"):
        return Path(os.environ["KIMI_K3_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kimi-k3-build"


def mirror_dirs(flags: Sequence[str]) -> list[Path]:
    """--mirror flags first, then $KIMI_K3_MIRROR (colon-separated), each once."""
    env = [p for p in os.environ.get("KIMI_K3_MIRROR", "").split(":") if p]
    return [Path(p) for p in dict.fromkeys([*flags, *env])]


def check_writable_path(path: Path, what: str, *, directory: bool) -> None:
    """A one-line UserError (naming `what`) when `path` cannot become a file (directory=False)
    or a directory: it exists as the other kind, or an ancestor is not a directory."""
    if path.exists():
        if directory and not path.is_dir():
            raise UserError(f"{what} {path} is a file, not a directory; pass a directory path")
        if not directory and path.is_dir():
            raise UserError(f"{what} {path} is a directory; pass the path of the file to write "
                            f"(e.g. {path / 'NAME'})")
        return
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"{what} {path}: {parent} is a file, not a directory; pass a path under a directory")
            return


def place_file(src: Path, out: Path, *, link: bool = True) -> Path:
    """Put a verified file at `out` atomically: hardlink when possible, else copy."""
    out = out.absolute()
    check_writable_path(out, "output", directory=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        try:
            if not link:
                raise OSError("copy requested")
            os.link(src, tmp)
        except OSError:
            # Different filesystem or links not allowed: copy, and fsync before the rename.
            shutil.copyfile(src, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, out)
        # rename(2) between two links to one inode (a rerun linking the same CAS entry) succeeds
        # without doing anything, leaving tmp behind: remove it (absent after a real rename).
        tmp.unlink(missing_ok=True)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


# ---------------------------------------------------------------------------------------------
# The content-addressed cache


class Cache:
    """`<root>/cas/sha256/<hex>` files, `tmp/` for partial writes, `locks/` for flocks,
    `git/<sha256(url)>.git` bare repositories, `index/git_tree/<tree>` -> sha256 of its tar."""

    def __init__(self, root: Path) -> None:
        self.root = root.absolute()

    def cas_path(self, sha256: str) -> Path:
        # The name is a path component: anything but 64 hex digits could point outside the cache.
        if not lockfile.is_sha256(sha256):
            raise ValueError(f"not a sha256 hex digest: {sha256!r}")
        return self.root / "cas" / "sha256" / sha256

    def tmp_dir(self) -> Path:
        path = self.root / "tmp"
        path.mkdir(parents=True, exist_ok=True)
        return path

    @contextlib.contextmanager
    def locked(self, key: str) -> Iterator[None]:
        """Exclusive flock for one entry; lock files stay (deleting them would race waiters)."""
        if not _LOCK_KEY_RE.fullmatch(key):
            raise ValueError(f"not a cache lock key: {key!r}")  # keys name files under locks/
        locks = self.root / "locks"
        locks.mkdir(parents=True, exist_ok=True)
        with open(locks / f"{key}.lock", "a") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def clean_stale_temps(self, key: str) -> None:
        """Remove temp files a killed fetch of `key` left behind (call with the key's lock held)."""
        for stale in self.tmp_dir().glob(f"{key}.*.part"):
            stale.unlink(missing_ok=True)

    @contextlib.contextmanager
    def temp_file(self, key: str) -> Iterator[tuple[Path, IO[bytes]]]:
        """A temp file in the cache (same filesystem as cas/, so the final rename is atomic);
        removed on any failure."""
        fd, name = tempfile.mkstemp(prefix=f"{key}.", suffix=".part", dir=self.tmp_dir())
        path = Path(name)
        try:
            with os.fdopen(fd, "wb") as f:
                yield path, f
        finally:
            path.unlink(missing_ok=True)

    def commit(self, tmp: Path, sha256: str) -> Path:
        """Rename a verified, fsynced temp file into the CAS (read-only: it may be hardlinked)."""
        dest = self.cas_path(sha256)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(tmp, 0o444)
        os.replace(tmp, dest)
        fsync_dir(dest.parent)
        return dest

    def verified_entry(self, sha256: str, what: str, evict_hint: str) -> Path | None:
        """The CAS entry for `sha256` after re-hashing it; a corrupt entry is a UserError."""
        path = self.cas_path(sha256)
        if not path.exists():
            return None
        actual = sha256_file(path)
        if actual != sha256:
            raise UserError(f"{what}: cached file {path} is corrupt: expected sha256 {sha256}, actual {actual}; "
                            f"remove it with `{evict_hint}` (or delete the file) and fetch again")
        return path

    def git_repo(self, repository: str) -> Path:
        key = hashlib.sha256(repository.encode()).hexdigest()
        return self.root / "git" / f"{key}.git"

    def tree_index(self, tree: str) -> Path:
        return self.root / "index" / "git_tree" / tree

    def tree_entry(self, tree: str) -> str | None:
        """The sha256 the tree index records for `tree`; None when absent or not a sha256 (a
        damaged index is a miss, rebuilt by the next fetch, never a path to follow)."""
        index = self.tree_index(tree)
        if not index.is_file():
            return None
        value = index.read_text(encoding="ascii", errors="replace").strip()
        return value if lockfile.is_sha256(value) else None


class SourceFailed(Exception):
    """A source could not deliver (absent, unreachable, truncated, wrong bytes): try the next one.
    `transient` failures (dropped connection, timeout) are worth one more attempt; `corrupt`
    ones (the source has the file, but wrong bytes or a wrong size) are reported as they happen."""

    def __init__(self, message: str, *, transient: bool = False, corrupt: bool = False) -> None:
        super().__init__(message)
        self.transient = transient
        self.corrupt = corrupt


def evict_command(pin: Pin) -> str:
    return f"python3 -m tools.fetch evict --pin {pin.name}"


def hash_mismatch(expected: str, actual: str, source: str) -> SourceFailed:
    # Not fatal by itself: a later mirror or the origin may hold the right bytes.
    return SourceFailed(f"{source}: sha256 mismatch: expected {expected}, actual {actual}", corrupt=True)


def note_failure(pin_name: str, error: SourceFailed, failures: list[str]) -> bool:
    """Record a failed source for the final error; a corrupt one is also reported now, since the
    fetch may still succeed from the next source. Returns whether it was corrupt."""
    failures.append(str(error))
    if error.corrupt:
        print(f"fetch {pin_name}: warning: {error}; skipping this source", file=sys.stderr, flush=True)
    return error.corrupt


# ---------------------------------------------------------------------------------------------
# file pins (and git_diff pins served as files by a mirror)


def copy_stream_verified(src: IO[bytes], dst: IO[bytes], progress: Progress,
                         limit: int | None = None) -> tuple[str, int]:
    """Copy `src` to `dst` hashing on the way; returns (sha256 hex, byte count). With `limit`
    (the lock's size) it stops after limit + 1 bytes: an endless or oversized body then costs
    one byte more than the pin, not the disk, and the count says it was too long."""
    digest = hashlib.sha256()
    size = 0
    while True:
        want = CHUNK if limit is None else min(CHUNK, limit + 1 - size)
        if want <= 0:
            break
        chunk = src.read(want)
        if not chunk:
            break
        digest.update(chunk)
        dst.write(chunk)
        size += len(chunk)
        progress.advance(len(chunk))
    dst.flush()
    os.fsync(dst.fileno())
    return digest.hexdigest(), size


def check_size(expected: int | None, actual: int, source: str) -> None:
    if expected is None or actual == expected:
        return
    if actual > expected:  # copy_stream_verified stopped at expected + 1
        raise SourceFailed(f"{source}: more than {expected} bytes, the lock's size (stopped reading; wrong file)",
                           corrupt=True)
    raise SourceFailed(f"{source}: got {actual} bytes, the lock says {expected} (truncated or wrong file)",
                       corrupt=True)


def from_mirror_file(cache: Cache, key: str, name: str, sha256: str, size: int | None, path: Path) -> Path:
    if not path.is_file():
        raise SourceFailed(f"mirror {path.parent}: no {path.name}")
    source = f"mirror file {path}"
    on_disk = path.stat().st_size
    if size is not None and on_disk != size:
        raise SourceFailed(f"{source}: {on_disk} bytes, the lock says {size} (truncated or wrong file)", corrupt=True)
    with cache.temp_file(key) as (tmp, out), open(path, "rb") as src:
        progress = Progress(f"fetch {name}", on_disk)
        actual, got = copy_stream_verified(src, out, progress, size)
        check_size(size, got, source)
        if actual != sha256:
            raise hash_mismatch(sha256, actual, source)
        progress.finish(f"copied from {path}:")
        return cache.commit(tmp, sha256)


def from_url(cache: Cache, key: str, name: str, sha256: str, size: int | None, url: str, timeout: float) -> Path:
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
    with cache.temp_file(key) as (tmp, out):
        try:
            # urlopen honours the https_proxy/no_proxy environment like every urllib client.
            with urllib.request.urlopen(request, timeout=timeout) as response:
                announced = response.headers.get("Content-Length")
                if size is not None and announced and announced.isdigit() and int(announced) > size:
                    # Refused before the body: it cannot be the pinned file.
                    raise SourceFailed(f"{url}: Content-Length {announced} is more than {size} bytes, the lock's "
                                       "size (wrong file; not downloaded)", corrupt=True)
                total = int(announced) if announced and announced.isdigit() else size
                progress = Progress(f"fetch {name}", total)
                actual, got = copy_stream_verified(response, out, progress, size)
        except urllib.error.HTTPError as e:
            raise SourceFailed(f"{url}: HTTP {e.code} {e.reason}") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            refused = isinstance(reason, (ConnectionRefusedError, socket.gaierror))
            raise SourceFailed(f"{url}: {reason}", transient=not refused) from None
        # http.client returns a short body as a clean EOF, so compare with Content-Length here:
        # a dropped connection must read as "truncated", not as a (misleading) hash mismatch.
        if announced and announced.isdigit() and got != int(announced):
            raise SourceFailed(f"{url}: connection closed after {got} of {announced} bytes", transient=True)
        check_size(size, got, url)
        if actual != sha256:
            raise hash_mismatch(sha256, actual, url)
        progress.finish(f"downloaded from {url}:")
        return cache.commit(tmp, sha256)


def unavailable(pin: Pin, failures: Sequence[str], corrupt: bool = False) -> UserError:
    tried = "; ".join(failures) if failures else "no mirror and no origin URL"
    bad = ("; a source served wrong bytes: fix or remove it, or if every source agrees the lock is wrong "
           "(re-pin with `python3 -m tools.fetch add-pypi`/`add-git-diff`)") if corrupt else ""
    return UserError(f"pin '{pin.name}': no source delivered it ({tried}){bad}; check the network/proxy, or fill a "
                     f"mirror on a connected host with `{FILL_MIRROR_HINT.format(pin=pin.name)}` and pass "
                     "--mirror DIR or KIMI_K3_MIRROR=DIR")


def fetch_file_pin(pin: FilePin, cache: Cache, mirrors: Sequence[Path], timeout: float) -> Path:
    what = f"pin '{pin.name}'"
    hit = cache.verified_entry(pin.sha256, what, evict_command(pin))
    if hit:
        return hit
    with cache.locked(pin.sha256):
        # Another process may have filled the entry while we waited for the lock.
        hit = cache.verified_entry(pin.sha256, what, evict_command(pin))
        if hit:
            return hit
        cache.clean_stale_temps(pin.sha256)
        failures: list[str] = []
        corrupt = False
        for mirror in mirrors:
            try:
                return from_mirror_file(cache, pin.sha256, pin.name, pin.sha256, pin.size, mirror / pin.filename)
            except SourceFailed as e:
                corrupt |= note_failure(pin.name, e, failures)
        for url in pin.urls:
            for attempt in range(1, DOWNLOAD_ATTEMPTS + 1):
                try:
                    return from_url(cache, pin.sha256, pin.name, pin.sha256, pin.size, url, timeout)
                except SourceFailed as e:
                    if not e.transient or attempt == DOWNLOAD_ATTEMPTS:
                        corrupt |= note_failure(pin.name, e, failures)
                        break
                    print(f"fetch {pin.name}: {e}; retrying (attempt {attempt + 1}/{DOWNLOAD_ATTEMPTS})",
                          file=sys.stderr, flush=True)
                    time.sleep(RETRY_DELAY_S)
        raise unavailable(pin, failures, corrupt)


# ---------------------------------------------------------------------------------------------
# git pins


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


def git_diff_missing(pin: GitDiffPin, failures: Sequence[str]) -> UserError:
    tried = "; ".join(failures)
    return UserError(
        f"pin '{pin.name}' ({pin.filename}) is missing: not in the cache, no mirror has it, and its origin failed "
        f"({tried}); on a connected host run `{FILL_MIRROR_HINT.format(pin=pin.name)}` (or add "
        f"`--from-git {pin.name}=CHECKOUT` to fill it from a local clone of {pin.repository}) and pass "
        "--mirror DIR or KIMI_K3_MIRROR=DIR; the `pypi` stack builds without it (`--config=pypi`)")


def fetch_git_diff_pin(pin: GitDiffPin, cache: Cache, mirrors: Sequence[Path], timeout: float,
                       from_git: str | None = None) -> Path:
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
        wanted = [(pin.commit, pin.commit_tree, "commit_tree"), (pin.parent, pin.parent_tree, "parent_tree")]
        cache_repo = ensure_commits(cache, pin.name, pin.repository, wanted, mirrors, from_git, failures)
        if cache_repo is None:
            raise git_diff_missing(pin, failures)
        with cache.temp_file(pin.sha256) as (tmp, out):
            write_canonical_diff(cache_repo, pin.parent, pin.commit, out)
            actual = sha256_file(tmp)
            if actual != pin.sha256:
                raise UserError(f"pin '{pin.name}': canonical diff {pin.parent[:12]}..{pin.commit[:12]} generated "
                                f"by {git_version()} has sha256 {actual}, expected {pin.sha256}; the trees matched, so "
                                "this git renders diffs differently: fill a mirror file with "
                                f"`{FILL_MIRROR_HINT.format(pin=pin.name)}` on a host whose git matches")
            return cache.commit(tmp, pin.sha256)


def git_version() -> str:
    try:
        return git(["--version"]).stdout.decode().strip()
    except (SourceFailed, OSError):
        return "git (unknown version)"


def fetch_git_tree_pin(pin: GitTreePin, cache: Cache, mirrors: Sequence[Path], timeout: float,
                       from_git: str | None = None) -> Path:
    """A deterministic `git archive` tar of the pin's commit, in the CAS."""
    index = cache.tree_index(pin.tree)
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
            raise unavailable(pin, failures)
        with cache.temp_file(f"tree-{pin.tree}") as (tmp, out):
            # Archiving the commit (not the tree) makes every mtime the commit time: deterministic.
            git(["archive", "--format=tar", pin.commit], git_dir=cache_repo, config=["tar.umask=0022"], stdout=out)
            out.flush()
            os.fsync(out.fileno())
            sha256 = sha256_file(tmp)
            # Always rename: a same-named entry is either identical or corrupt, and this one is fresh.
            entry = cache.commit(tmp, sha256)
        lockfile.atomic_write_text(index, sha256 + "\n")
        return entry


def extract_tar(tar_path: Path, out: Path) -> Path:
    """Unpack a verified tar into directory `out`, built in a temp sibling then renamed."""
    out = out.absolute()
    # The "data" filter refuses absolute paths, `..`, links out of the tree and device files;
    # without it a tar could write anywhere, so an interpreter lacking it is refused, not trusted.
    if not hasattr(tarfile, "data_filter"):
        raise UserError(f"extracting into {out} needs tarfile extraction filters (Python 3.8.17+, 3.9.17+, "
                        f"3.10.12+ or 3.11.4+), this is Python {sys.version.split()[0]}: run tools/fetch with a "
                        "newer python3")
    check_writable_path(out, "output", directory=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        with tarfile.open(tar_path) as tar:
            tar.extractall(tmp, filter="data")
        if out.exists():
            old = out.with_name(f".{out.name}.old.{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# ---------------------------------------------------------------------------------------------
# Commands


@dataclass
class Context:
    lock: Lock
    cache: Cache
    mirrors: list[Path]
    timeout: float


def fetch_pin(ctx: Context, pin: Pin, from_git: str | None = None) -> Path:
    if isinstance(pin, FilePin):
        return fetch_file_pin(pin, ctx.cache, ctx.mirrors, ctx.timeout)
    if isinstance(pin, GitDiffPin):
        return fetch_git_diff_pin(pin, ctx.cache, ctx.mirrors, ctx.timeout, from_git)
    return fetch_git_tree_pin(pin, ctx.cache, ctx.mirrors, ctx.timeout, from_git)


def cmd_fetch(ctx: Context, args: argparse.Namespace) -> int:
    pin = ctx.lock.pin(args.pin)
    if args.out:
        # Checked before fetching, so a wrong --out costs no download.
        check_writable_path(Path(args.out).absolute(), "--out", directory=isinstance(pin, GitTreePin))
    path = fetch_pin(ctx, pin)
    if args.out:
        if isinstance(pin, GitTreePin):
            path = extract_tar(path, Path(args.out))
        else:
            path = place_file(path, Path(args.out), link=not args.copy)
    print(path)
    return 0


def parse_from_git(values: Sequence[str], lock: Lock) -> dict[str, str]:
    result: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise UserError(f"--from-git {value!r}: expected PIN=CHECKOUT, e.g. --from-git flashinfer-pr4460=~/flashinfer")
        if not isinstance(lock.pin(name), (GitDiffPin, GitTreePin)):
            raise UserError(f"--from-git {value!r}: pin '{name}' is not a git pin; --from-git only fills git pins")
        if not Path(path).exists():
            raise UserError(f"--from-git {value!r}: {path} does not exist; pass a local clone of the repository")
        result[name] = path
    return result


def selected_pins(lock: Lock, stacks: Sequence[str], pins: Sequence[str]) -> list[Pin]:
    names: list[str] = []
    for stack in stacks:
        names += lock.stack(stack).pin_names()
    names += [lock.pin(p).name for p in pins]
    if not stacks and not pins:
        names = list(lock.pins)
    return [lock.pins[n] for n in dict.fromkeys(names)]


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


def mirror_file(src: Path, dest: Path, sha256: str, size: int | None) -> str:
    """Copy a verified file into the mirror unless an identical one is there (re-verified, so a
    corrupt or truncated copy is replaced); returns what was done."""
    note = "written"
    if dest.is_file():
        if (size is None or dest.stat().st_size == size) and sha256_file(dest) == sha256:
            return "present"
        note = "replaced a corrupt copy"
    place_file(src, dest, link=False)
    return note


def cmd_mirror(ctx: Context, args: argparse.Namespace) -> int:
    target = Path(args.mirror_dir)
    check_writable_path(target.absolute(), "mirror", directory=True)
    from_git = parse_from_git(args.from_git, ctx.lock)
    pins = selected_pins(ctx.lock, args.stack, [*args.pin, *from_git])
    # The target is a source too (already-present files are verified, not re-downloaded).
    ctx.mirrors = [target, *[m for m in ctx.mirrors if m != target]]
    print(f"mirror: {len(pins)} pins into {target}", file=sys.stderr)
    for index, pin in enumerate(pins, 1):
        path = fetch_pin(ctx, pin, from_git.get(pin.name))
        notes: list[str] = []
        if isinstance(pin, (FilePin, GitDiffPin)):
            notes.append(mirror_file(path, target / pin.filename, pin.sha256, getattr(pin, "size", None)))
        if isinstance(pin, (GitDiffPin, GitTreePin)):
            notes.append(mirror_git_pin(ctx, pin, target, from_git.get(pin.name)))
        print(f"mirror: [{index}/{len(pins)}] {pin.name}: {', '.join(notes) or 'cached'}", file=sys.stderr)
    print(target)
    return 0


def mirror_git_pin(ctx: Context, pin: GitDiffPin | GitTreePin, target: Path, from_git: str | None) -> str:
    """Also put the pin's commits into the mirror's bare repository, so hosts that regenerate
    the diff (or need the tree) are served; a diff served from a mirror file alone cannot."""
    if isinstance(pin, GitDiffPin):
        wanted = [(pin.commit, pin.commit_tree, "commit_tree"), (pin.parent, pin.parent_tree, "parent_tree")]
    else:
        wanted = [(pin.commit, pin.tree, "tree")]
    failures: list[str] = []
    if ensure_commits(ctx.cache, pin.name, pin.repository, wanted, ctx.mirrors, from_git, failures) is None:
        print(f"mirror: warning: {pin.name}: no git source for the bare repository ({'; '.join(failures)})",
              file=sys.stderr)
        return "no git repository"
    repo = mirror_git_repo(ctx.cache, pin.repository, [c for c, _, _ in wanted], target)
    return f"repository {repo.relative_to(target)}"


def cmd_verify(ctx: Context, args: argparse.Namespace) -> int:
    lock = ctx.lock
    rows = [("PIN", "KIND", "SIZE", "SHA256/COMMIT", "SOURCE")]
    for pin in lock.pins.values():
        if isinstance(pin, FilePin):
            size = human_bytes(pin.size) if pin.size is not None else "?"
            rows.append((pin.name, pin.kind, size, pin.sha256[:16], urllib.parse.urlparse(pin.urls[0]).netloc))
        elif isinstance(pin, GitDiffPin):
            rows.append((pin.name, pin.kind, "", f"{pin.parent[:8]}..{pin.commit[:8]}", pin.repository))
        else:
            rows.append((pin.name, pin.kind, "", pin.commit[:16], pin.repository))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    for stack in lock.stacks.values():
        files = [lock.pins[n] for n in stack.pin_names()]
        total = sum(p.size or 0 for p in files if isinstance(p, FilePin))
        print(f"stack {stack.name}: {len(files)} pins ({len(stack.wheels)} wheels), {human_bytes(total)} of files")
    raw = lockfile.read_raw(lock.path)
    if lock.path.read_text(encoding="utf-8") != lockfile.canonical_text(raw):
        print(f"note: {lock.path} is not in canonical form; run `python3 -m tools.fetch format`", file=sys.stderr)
    print(f"{lock.path}: OK, {len(lock.pins)} pins, {len(lock.stacks)} stacks")
    return 0


def cmd_format(ctx: Context, args: argparse.Namespace) -> int:
    lockfile.write(ctx.lock.path, lockfile.read_raw(ctx.lock.path))
    print(ctx.lock.path)
    return 0


def cmd_evict(ctx: Context, args: argparse.Namespace) -> int:
    if args.sha256 is not None:
        # The value becomes a path under the cache: only a sha256 may (no `..`, no `/`).
        if not lockfile.is_sha256(args.sha256):
            raise UserError(f"evict --sha256 {args.sha256!r}: pass exactly 64 lowercase hex digits (a cache entry's "
                            "name under cas/sha256/)")
        targets = [(args.sha256, args.sha256)]
    else:
        pin = ctx.lock.pin(args.pin)
        if isinstance(pin, GitTreePin):
            recorded = ctx.cache.tree_entry(pin.tree)
            targets = [(recorded, f"tree-{pin.tree}")] if recorded else []
            ctx.cache.tree_index(pin.tree).unlink(missing_ok=True)
        else:
            targets = [(pin.sha256, pin.sha256)]
    removed = 0
    for sha256, key in targets:
        with ctx.cache.locked(key):
            path = ctx.cache.cas_path(sha256)
            if path.exists():
                path.unlink()
                removed += 1
                print(path)
    if not removed:
        print("nothing to evict", file=sys.stderr)
    return 0


def cmd_add_pypi(ctx: Context, args: argparse.Namespace) -> int:
    from tools.pins import pypi as pypi_lock  # only the lock-editing commands need it

    pin = pypi_lock.add_pypi_pin(ctx.lock.path, args.requirement, platform=args.platform, python=args.python,
                                 pin_name=args.pin_name, index_url=args.index_url, timeout=ctx.timeout)
    print(pin)
    return 0


def cmd_add_git_diff(ctx: Context, args: argparse.Namespace) -> int:
    for value, label in ((args.commit, "--commit"), (args.parent, "--parent")):
        if value is not None and not re.fullmatch(r"[0-9a-f]{40}", value):
            raise UserError(f"{label} {value!r}: pass a full 40-char lowercase commit id (git rev-parse it first)")
    cache_repo = ctx.cache.git_repo(args.repository)
    sources = git_sources(args.repository, ctx.mirrors, args.from_git)
    failures: list[str] = []
    with ctx.cache.locked(f"git-{cache_repo.stem}"):
        init_bare(cache_repo)
        for source in sources:
            try:
                # depth 2 brings the first parent along when --parent is not given.
                fetch_commits(cache_repo, source, [args.commit, *([args.parent] if args.parent else [])], depth=2)
                break
            except SourceFailed as e:
                failures.append(f"{source}: {e}")
        else:
            raise UserError(f"add-git-diff {args.name}: no source has commit {args.commit} ({'; '.join(failures)}); "
                            "pass --from-git CHECKOUT with a clone that contains it")
        parent = args.parent or git_text(["rev-parse", "--verify", f"{args.commit}^1"], cache_repo)
        fetch_commits(cache_repo, str(cache_repo), [parent])
        with ctx.cache.temp_file(f"diff-{args.commit}") as (tmp, out):
            write_canonical_diff(cache_repo, parent, args.commit, out)
            sha256 = sha256_file(tmp)
            ctx.cache.commit(tmp, sha256)
        entry = {
            "kind": "git_diff", "repository": args.repository,
            "commit": args.commit, "commit_tree": tree_of(cache_repo, args.commit),
            "parent": parent, "parent_tree": tree_of(cache_repo, parent),
            "filename": args.filename or f"{args.name}-{args.commit[:8]}.diff", "sha256": sha256,
        }
    if args.description:
        entry["description"] = args.description
    raw = lockfile.read_raw(ctx.lock.path)
    raw.setdefault("pins", {})[args.name] = entry
    lockfile.write(ctx.lock.path, raw)
    print(f"{args.name}: {entry['filename']} sha256 {sha256}", file=sys.stderr)
    print(args.name)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fetch.py", description=__doc__.split("\n\n")[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--lock", default=str(lockfile.DEFAULT_LOCK), help="lock file (default: %(default)s)")
    common.add_argument("--cache", help="cache dir (default: $KIMI_K3_CACHE or ~/.cache/kimi-k3-build)")
    common.add_argument("--mirror", action="append", default=[], help="mirror dir, tried before origins (repeatable; "
                        "$KIMI_K3_MIRROR adds colon-separated dirs after these)")
    common.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="network timeout in seconds")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("fetch", parents=[common], help="fetch one pin, print the verified path")
    p.add_argument("--pin", required=True)
    p.add_argument("--out", help="also place the artifact here (a directory for git_tree pins)")
    p.add_argument("--copy", action="store_true", help="copy to --out instead of hardlinking")
    p.set_defaults(func=cmd_fetch)

    p = sub.add_parser("mirror", parents=[common], help="fill a mirror directory from the lock")
    p.add_argument("mirror_dir", nargs="?", help="the mirror to fill (or the first --mirror)")
    p.add_argument("--stack", action="append", default=[])
    p.add_argument("--pin", action="append", default=[])
    p.add_argument("--from-git", action="append", default=[], metavar="PIN=CHECKOUT")
    p.set_defaults(func=cmd_mirror)

    p = sub.add_parser("add-pypi", parents=[common], help="add or bump a wheel pin from a PyPI simple index")
    p.add_argument("requirement", metavar="NAME==VERSION")
    p.add_argument("--platform", default="manylinux_2_34_x86_64")
    p.add_argument("--python", default="3.11")
    p.add_argument("--pin-name")
    p.add_argument("--index-url", default=os.environ.get("KIMI_K3_INDEX_URL", PYPI_SIMPLE))
    p.set_defaults(func=cmd_add_pypi)

    p = sub.add_parser("add-git-diff", parents=[common], help="add or bump a git_diff pin")
    p.add_argument("--name", required=True)
    p.add_argument("--repository", required=True)
    p.add_argument("--commit", required=True)
    p.add_argument("--parent", help="default: the commit's first parent")
    p.add_argument("--from-git", metavar="CHECKOUT", help="local clone to read the commits from")
    p.add_argument("--filename")
    p.add_argument("--description")
    p.set_defaults(func=cmd_add_git_diff)

    p = sub.add_parser("verify", parents=[common], help="validate the lock and print its pins")
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("format", parents=[common], help="rewrite the lock in canonical form")
    p.set_defaults(func=cmd_format)

    p = sub.add_parser("evict", parents=[common], help="remove a cache entry")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--pin")
    group.add_argument("--sha256")
    p.set_defaults(func=cmd_evict)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "mirror":
        if not args.mirror_dir:
            if not args.mirror:
                raise UserError("mirror: name the directory to fill: `python3 -m tools.fetch mirror --mirror DIR` or `python3 -m tools.fetch mirror DIR`")
            args.mirror_dir = args.mirror[0]
    lock = lockfile.load(args.lock)
    cache = Cache(Path(args.cache) if args.cache else default_cache_dir())
    if args.command in CACHE_COMMANDS:
        what = "--cache" if args.cache else ("KIMI_K3_CACHE" if os.environ.get("KIMI_K3_CACHE") else "cache directory")
        check_writable_path(cache.root, what, directory=True)
    ctx = Context(lock=lock, cache=cache, mirrors=mirror_dirs(args.mirror), timeout=args.timeout)
    return int(args.func(ctx, args))


if __name__ == "__main__":
    sys.exit(run_cli(main))
