"""Debian package sets pinned like every other input: the lock third_party/debian.lock.json.

`python3 -m tools.fetch.debian COMMAND` (the lock's commands are here, the ones that fetch .debs
in tools/fetch/debian.py, which is the CLI):

    resolve  --set NAME                         re-resolve a set from what the lock records for it
    add-set  NAME --suite S [--suite S2] --packages a,b [--exclude x=REASON,y --exclude-reason R]
    mirror   DIR [--set NAME]...                fill a mirror directory with the sets' .debs
    extract  --set NAME --out DIR               verified .debs unpacked into DIR (dpkg-deb -x)
    repo     --set NAME --out DIR               a flat apt repository of the verified .debs
    key      --set NAME                         sha256 of the set's entries (cache keys)
    check-root --set NAME --root DIR            DIR's dpkg status holds exactly the set's packages
    show     [--set NAME]                       table of a set's packages

A set records its inputs (archive, suites, architecture, roots, excluded names with a reason) and
its result: every package of the closure by name, version, pool filename, size and sha256.
Resolution reads each suite's signed InRelease (gpgv against Debian's archive keyring), then the
`main/binary-<arch>/Packages.xz` it lists, verified by size and sha256, and takes the closure of
Depends + Pre-Depends: the first satisfiable alternative, virtual names through Provides, one
version per name (the highest across the set's suites), excluded names count as satisfied.
The .debs are fetched by tools.fetch (cache by sha256, mirrors first, the lock's size as cap):
each package is the file pin DebPackage.pin gives.

Standard library only (plus dpkg-deb and gpgv): a Bazel repository rule runs `repo` with a
bare interpreter. That is also why the deb822 parser and the version comparison are written here
(python-debian / python-apt are not in a bare interpreter; dpkg --compare-versions costs a
process per comparison, thousands per resolution).
"""
from __future__ import annotations

import argparse
import lzma
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from tools.common.errors import UserError
from tools.common.files import write_bytes_atomic
from tools.common.hashing import sha256_bytes
from tools.common.jsondata import ANY, Enum, MapOf, Object, load_json_file
from tools.common.jsonfmt import canonical_json, review_json
from tools.common.progress import human_bytes
from tools.pins.lock import REPO_ROOT, FilePin, is_sha256

DEFAULT_LOCK = REPO_ROOT / "third_party" / "debian.lock.json"
DEFAULT_ARCHIVE = "http://deb.debian.org/debian"
DEFAULT_KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
SCHEMA_VERSION = 1
SET_MARKER = ".debian-set.json"  # written into an extracted tree: the set's entries, canonical JSON
NAME_RE = re.compile(r"[a-z0-9][a-z0-9+.-]+")  # Debian Policy 5.6.1 package names (two characters or more)
NAME_RULE = "lower-case letters, digits, '+', '-' and '.', at least two characters, the first a letter or digit"
SET_RE = re.compile(r"[a-z0-9][a-z0-9-]*")
ARCH_RE = re.compile(r"[a-z0-9][a-z0-9-]*")  # dpkg architecture names: amd64, arm64, musl-linux-amd64
# A component of a suite or a pool path: the characters Debian archives use. No empty, '.' or '..'
# component, no whitespace or control bytes: a newline would add a field to the Packages index
# written from the lock, a '..' would leave the mirror or repository directory.
PATH_PART_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9.+~_-]*")
TIMEOUT_S = 60.0
USER_AGENT = "kimi-k3-debian/1"


def fill_command(set_name: str) -> str:
    return f"python3 -m tools.fetch.debian mirror DIR --set {set_name}"


def resolve_command(set_name: str) -> str:
    return f"python3 -m tools.fetch.debian resolve --set {set_name}"


# --- versions (Debian Policy 5.6.12) ---------------------------------------------------------

def _order(c: str) -> int:
    if c == "~":
        return -1
    if c.isdigit():
        return 0
    if c.isalpha():
        return ord(c)
    return ord(c) + 256


def _compare_part(a: str, b: str) -> int:
    """dpkg's verrevcmp: alternating non-digit runs (lexical, ~ sorts first) and digit runs."""
    i = j = 0
    while i < len(a) or j < len(b):
        first_diff = 0
        while (i < len(a) and not a[i].isdigit()) or (j < len(b) and not b[j].isdigit()):
            ac = _order(a[i]) if i < len(a) else 0
            bc = _order(b[j]) if j < len(b) else 0
            if ac != bc:
                return ac - bc
            i += 1
            j += 1
        while i < len(a) and a[i] == "0":
            i += 1
        while j < len(b) and b[j] == "0":
            j += 1
        while i < len(a) and a[i].isdigit() and j < len(b) and b[j].isdigit():
            if not first_diff:
                first_diff = ord(a[i]) - ord(b[j])
            i += 1
            j += 1
        if i < len(a) and a[i].isdigit():
            return 1
        if j < len(b) and b[j].isdigit():
            return -1
        if first_diff:
            return first_diff
    return 0


def _version_parts(v: str) -> tuple[str, str, str | None]:
    """(epoch, upstream, revision) as written: epoch "0" without a colon, revision None without a
    hyphen (the last hyphen starts the revision)."""
    epoch, sep, rest = v.partition(":")
    if not sep:
        epoch, rest = "0", v
    upstream, sep, revision = rest.rpartition("-")
    return (epoch, upstream, revision) if sep else (epoch, rest, None)


def _split_version(v: str) -> tuple[int, str, str]:
    epoch, upstream, revision = _version_parts(v)
    return int(epoch or "0"), upstream, revision or ""


_EPOCH_RE = re.compile(r"[0-9]+")
_UPSTREAM_RE = re.compile(r"[0-9][A-Za-z0-9.+~-]*")
_REVISION_RE = re.compile(r"[A-Za-z0-9.+~]+")


def is_version(v: str) -> bool:
    """Debian Policy 5.6.12: [epoch:]upstream_version[-debian_revision]; the upstream part starts
    with a digit and holds a hyphen only when a revision follows."""
    epoch, upstream, revision = _version_parts(v)
    return bool(_EPOCH_RE.fullmatch(epoch) and _UPSTREAM_RE.fullmatch(upstream)
                and (revision is None or _REVISION_RE.fullmatch(revision)))


def is_pool_path(filename: str) -> bool:
    """A relative path of plain components ending in a .deb basename (Packages' Filename)."""
    return filename.endswith(".deb") and all(PATH_PART_RE.fullmatch(part) for part in filename.split("/"))


def compare_versions(a: str, b: str) -> int:
    """<0, 0, >0 as Debian version a sorts before, equal to, after b."""
    ea, ua, ra = _split_version(a)
    eb, ub, rb = _split_version(b)
    if ea != eb:
        return ea - eb
    return _compare_part(ua, ub) or _compare_part(ra, rb)


def satisfies(version: str | None, op: str | None, wanted: str | None) -> bool:
    if op is None:
        return True
    if version is None:  # an unversioned Provides satisfies no versioned relation
        return False
    c = compare_versions(version, wanted or "")
    return {"<<": c < 0, "<=": c <= 0, "=": c == 0, ">=": c >= 0, ">>": c > 0}[op]


# --- deb822 and relations --------------------------------------------------------------------

def parse_stanzas(text: str) -> list[dict[str, str]]:
    """Paragraphs of `Field: value` lines (continuations start with a space), as in Packages files."""
    stanzas: list[dict[str, str]] = []
    current: dict[str, str] = {}
    key = None
    for line in text.splitlines():
        if not line.strip():
            if current:
                stanzas.append(current)
            current, key = {}, None
        elif line[0] in " \t":
            if key is not None:
                current[key] += "\n" + line.strip()
        else:
            key, _, value = line.partition(":")
            current[key] = value.strip()
    if current:
        stanzas.append(current)
    return stanzas


@dataclass(frozen=True)
class Relation:
    name: str
    op: str | None = None
    version: str | None = None

    def __str__(self) -> str:
        return f"{self.name} ({self.op} {self.version})" if self.op else self.name


_RELATION_RE = re.compile(r"^\s*([a-z0-9][a-z0-9+.-]*)(?::[a-z0-9-]+)?\s*(?:\(\s*(<<|<=|=|>=|>>|<|>)\s*([^)\s]+)\s*\))?"
                          r"\s*(?:\[[^\]]*\])?\s*(?:<[^>]*>\s*)*$")


def parse_relations(field: str, what: str) -> list[list[Relation]]:
    """`a (>= 1) | b, c:any` -> [[a>=1, b], [c]] (arch qualifiers dropped: one architecture)."""
    groups: list[list[Relation]] = []
    for group in field.split(","):
        if not group.strip():
            continue
        alternatives = []
        for alt in group.split("|"):
            m = _RELATION_RE.match(alt)
            if not m:
                raise UserError(f"{what}: cannot parse the relation {alt.strip()!r}")
            op = {"<": "<=", ">": ">="}.get(m.group(2), m.group(2))  # obsolete forms (Policy 7.1)
            alternatives.append(Relation(m.group(1), op, m.group(3)))
        groups.append(alternatives)
    return groups


@dataclass(frozen=True)
class Candidate:
    """One binary package of a suite's Packages index."""

    name: str
    version: str
    architecture: str
    filename: str
    size: int
    sha256: str
    suite: str
    depends: tuple[tuple[Relation, ...], ...]
    provides: tuple[Relation, ...]
    essential: bool = False
    priority: str = ""

    def entry(self, archive: str) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "architecture": self.architecture,
                "filename": self.filename, "size": self.size, "sha256": self.sha256,
                "urls": [f"{archive.rstrip('/')}/{self.filename}"]}


def candidates_from_index(text: str, suite: str) -> list[Candidate]:
    result = []
    for st in parse_stanzas(text):
        name = st.get("Package")
        what = f"{suite} Packages, {name or '?'}"
        try:
            depends = parse_relations(", ".join(v for v in (st.get("Pre-Depends"), st.get("Depends")) if v), what)
            provides = [alts[0] for alts in parse_relations(st.get("Provides", ""), what)]
            result.append(Candidate(name=st["Package"], version=st["Version"], architecture=st["Architecture"],
                                    filename=st["Filename"], size=int(st["Size"]), sha256=st["SHA256"],
                                    suite=suite, depends=tuple(tuple(a) for a in depends),
                                    provides=tuple(provides), essential=st.get("Essential") == "yes",
                                    priority=st.get("Priority", "")))
        except KeyError as e:
            raise UserError(f"{what}: stanza without {e.args[0]}; the index is damaged, resolve again") from None
    return result


PRIORITY_RANK = {"required": 0, "important": 1, "standard": 2, "optional": 3, "extra": 4}


class Index:
    """The packages of a set's suites: one version per name (the highest), providers by name."""

    def __init__(self, candidates: Iterable[Candidate]) -> None:
        self.best: dict[str, Candidate] = {}
        for c in candidates:
            old = self.best.get(c.name)
            if old is None or compare_versions(c.version, old.version) > 0:
                self.best[c.name] = c
        self.providers: dict[str, list[tuple[Candidate, Relation]]] = {}
        # Providers in apt's order of preference: higher Priority first (mawk, required, over
        # gawk, optional, for `awk`), then by name.
        for c in sorted(self.best.values(), key=lambda c: (PRIORITY_RANK.get(c.priority, len(PRIORITY_RANK)), c.name)):
            for p in c.provides:
                self.providers.setdefault(p.name, []).append((c, p))

    def satisfiers(self, rel: Relation) -> list[Candidate]:
        """Packages satisfying `rel`: the real package first, then providers (by priority, name)."""
        found = []
        real = self.best.get(rel.name)
        if real is not None and satisfies(real.version, rel.op, rel.version):
            found.append(real)
        for c, p in self.providers.get(rel.name, []):
            if satisfies(p.version, rel.op, rel.version) and c not in found:
                found.append(c)
        return found


# Roots that name a class of packages, as apt's patterns do: what mmdebstrap's variants install
# (essential: Essential: yes; minbase adds Priority: required). Expanded against the indexes, so a
# new Essential package in the suite enters the set on the next resolve.
META_ROOTS = {
    "?essential": lambda c: c.essential,
    "?priority(required)": lambda c: c.priority == "required",
    "?priority(important)": lambda c: c.priority in ("required", "important"),
}


def expand_roots(index: Index, roots: Sequence[str], excluded: set[str], set_name: str) -> list[str]:
    names = []
    for root in roots:
        if root.startswith("?"):
            if root not in META_ROOTS:
                raise UserError(f"set '{set_name}': unknown root pattern {root}; use one of "
                                f"{', '.join(sorted(META_ROOTS))} or a package name")
            names += [c.name for c in index.best.values() if META_ROOTS[root](c) and c.name not in excluded]
        else:
            names.append(root)
    return names


def resolve_closure(index: Index, roots: Sequence[str], exclude: Iterable[str], set_name: str) -> list[Candidate]:
    """The closure of `roots` over Depends + Pre-Depends, sorted by name.

    Per dependency group: an excluded name among the alternatives satisfies it (the consumer does
    not need that package); else an alternative already chosen; else the first satisfiable
    alternative (for a virtual name, its provider of highest Priority, then first by name). Work is taken in sorted order,
    so the result depends only on the indexes, the roots and the exclusions."""
    excluded = set(exclude)
    chosen: dict[str, Candidate] = {}
    pending = sorted(set(expand_roots(index, roots, excluded, set_name)))
    for root in pending:
        if root in excluded:
            raise UserError(f"set '{set_name}': root package {root} is also excluded; remove it from one of the lists")
    for root in pending:
        found = index.satisfiers(Relation(root))
        if not found or found[0].name != root:
            raise UserError(f"set '{set_name}': root package {root} is not in the set's suites; check the name "
                            "(`apt-cache policy NAME`) or add the suite that has it")
    queue = list(pending)
    while queue:
        queue.sort()
        name = queue.pop(0)
        if name in chosen:
            continue
        pkg = index.best[name]
        chosen[name] = pkg
        for group in pkg.depends:
            if any(rel.name in excluded for rel in group):
                continue
            options = [c for rel in group for c in index.satisfiers(rel)]
            if not options:
                raise UserError(f"set '{set_name}': {pkg.name} {pkg.version} depends on "
                                f"{' | '.join(map(str, group))}, which no package of the suites satisfies; add "
                                "a suite that has it, or exclude the name with a reason")
            if any(c.name in chosen or c.name in queue for c in options):
                continue
            queue.append(options[0].name)
    return [chosen[n] for n in sorted(chosen)]


# --- archive indexes ---------------------------------------------------------------------------

def http_get(url: str, timeout: float = TIMEOUT_S) -> bytes:
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read()
    except urllib.error.HTTPError as e:
        raise UserError(f"{url}: HTTP {e.code} {e.reason}; check the archive URL and suite name") from None
    except (urllib.error.URLError, OSError) as e:
        raise UserError(f"{url}: {getattr(e, 'reason', e)}; check the network/proxy") from None


def verified_release(data: bytes, url: str, keyring: Path | None) -> str:
    """The signed text of an InRelease file: gpgv checks it against the keyring (None: unchecked,
    the caller's explicit choice)."""
    if keyring is None:
        text = data.decode("utf-8", errors="replace")
        body = text.split("\n\n", 1)[1] if text.startswith("-----BEGIN PGP SIGNED MESSAGE-----") else text
        return body.split("\n-----BEGIN PGP SIGNATURE-----", 1)[0]
    if not keyring.is_file():
        raise UserError(f"keyring {keyring} not found: install debian-archive-keyring, pass --keyring FILE, or "
                        "--no-verify-signature to rely on the sha256 list alone")
    if shutil.which("gpgv") is None:
        raise UserError("gpgv not found (it checks InRelease signatures): install gpgv, or pass "
                        "--no-verify-signature to rely on the sha256 list alone")
    with tempfile.TemporaryDirectory(prefix="kimi-k3-inrelease.") as tmp:
        signed = Path(tmp) / "InRelease"
        signed.write_bytes(data)
        proc = subprocess.run(["gpgv", "--keyring", str(keyring), "--output", "-", str(signed)],
                              capture_output=True)
    if proc.returncode != 0:
        detail = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["gpgv failed"]
        raise UserError(f"{url}: signature not verified by {keyring} ({detail[0]}); refresh the keyring "
                        "(debian-archive-keyring) or pass --keyring FILE")
    return proc.stdout.decode("utf-8", errors="replace")


def release_sha256(release: str, url: str) -> dict[str, tuple[str, int]]:
    """The SHA256 section of a Release file: path -> (sha256, size)."""
    fields = dict(parse_stanzas(release)[0]) if release.strip() else {}
    if "SHA256" not in fields:
        raise UserError(f"{url}: no SHA256 list; not a Debian Release file")
    entries = {}
    for line in fields["SHA256"].splitlines():
        parts = line.split()
        if len(parts) == 3:
            entries[parts[2]] = (parts[0], int(parts[1]))
    return entries


def fetch_suite_index(archive: str, suite: str, arch: str, keyring: Path | None) -> list[Candidate]:
    base = f"{archive.rstrip('/')}/dists/{suite}"
    release_url = f"{base}/InRelease"
    release = verified_release(http_get(release_url), release_url, keyring)
    path = f"main/binary-{arch}/Packages.xz"
    listed = release_sha256(release, release_url)
    if path not in listed:
        raise UserError(f"{release_url}: lists no {path}; check the suite and architecture")
    sha256, size = listed[path]
    url = f"{base}/{path}"
    started = time.monotonic()
    data = http_get(url)
    if len(data) != size or sha256_bytes(data) != sha256:
        raise UserError(f"{url}: {len(data)} bytes, sha256 {sha256_bytes(data)}; InRelease says {size} bytes, "
                        f"sha256 {sha256} (a mirror mid-update?): resolve again")
    print(f"debian: {suite}: {path} {human_bytes(size)} verified ({time.monotonic() - started:.1f} s)",
          file=sys.stderr, flush=True)
    return candidates_from_index(lzma.decompress(data).decode("utf-8"), suite)


# --- the lock ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class DebPackage:
    name: str
    version: str
    architecture: str
    filename: str
    size: int
    sha256: str
    urls: tuple[str, ...]

    def entry(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "architecture": self.architecture,
                "filename": self.filename, "size": self.size, "sha256": self.sha256, "urls": list(self.urls)}

    def pin(self, set_name: str) -> FilePin:
        """The file pin tools.fetch verifies: mirror layout `<mirror>/<basename of the pool path>`."""
        return FilePin(name=f"{set_name}/{self.name}", filename=Path(self.filename).name, urls=self.urls,
                       sha256=self.sha256, size=self.size)


@dataclass(frozen=True)
class DebSet:
    name: str
    description: str
    archive: str
    suites: tuple[str, ...]
    architecture: str
    roots: tuple[str, ...]
    exclude: Mapping[str, str]
    packages: tuple[DebPackage, ...]

    def entries(self) -> list[dict[str, Any]]:
        return [p.entry() for p in self.packages]

    def content_key(self) -> str:
        """sha256 of the set's package entries (canonical JSON): what consumers key caches on."""
        return sha256_bytes(canonical_json(self.entries()))


def _field(obj: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in obj:
        raise UserError(f"{where}: missing field '{key}'; fix the lock or re-create it with add-set")
    value = obj[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise UserError(f"{where}: field '{key}' must be {kind.__name__}; fix the lock")
    return value


def _parse_package(obj: Any, where: str, set_architecture: str, fix: str) -> DebPackage:
    if not isinstance(obj, dict):
        raise UserError(f"{where}: a package entry must be an object")
    name = _field(obj, "name", str, where)
    if not NAME_RE.fullmatch(name):
        raise UserError(f"{where} {name!r}: not a Debian package name (Debian Policy 5.6.1: {NAME_RULE}); {fix}")
    where = f"{where} {name}"
    version = _field(obj, "version", str, where)
    if not is_version(version):
        raise UserError(f"{where}: version {version!r} is not a Debian version (Debian Policy 5.6.12: "
                        "[epoch:]upstream[-revision], upstream starting with a digit, letters, digits and "
                        f"'.+~-' only); {fix}")
    architecture = _field(obj, "architecture", str, where)
    if architecture not in (set_architecture, "all"):
        raise UserError(f"{where}: architecture {architecture!r} is neither the set's {set_architecture!r} nor "
                        f"'all'; {fix}")
    sha256 = _field(obj, "sha256", str, where)
    if not is_sha256(sha256):
        raise UserError(f"{where}: sha256 {sha256!r} is not 64 hex digits; {fix}")
    filename = _field(obj, "filename", str, where)
    if not is_pool_path(filename):
        raise UserError(f"{where}: filename {filename!r} is not a pool path of a .deb (relative components of "
                        f"letters, digits and '.+~_-', each starting with a letter or digit, ending in .deb); {fix}")
    urls = _field(obj, "urls", list, where)
    if not urls or not all(isinstance(u, str) and u.startswith(("http://", "https://", "file://"))
                           and not re.search(r"[\s\x00-\x1f\x7f]", u) for u in urls):
        raise UserError(f"{where}: urls must be a non-empty list of http(s)/file URLs without whitespace; {fix}")
    size = _field(obj, "size", int, where)
    if size <= 0:
        raise UserError(f"{where}: size must be positive; {fix}")
    return DebPackage(name=name, version=version, architecture=architecture, filename=filename, size=size,
                      sha256=sha256, urls=tuple(urls))


def parse_set(name: str, obj: Any, path: Path) -> DebSet:
    where = f"{path}: set '{name}'"
    if not SET_RE.fullmatch(name):
        raise UserError(f"{path}: set {name!r}: set names are lowercase letters, digits and '-'")
    if not isinstance(obj, dict):
        raise UserError(f"{where}: must be an object")
    fix = f"fix the entry or re-resolve with `{resolve_command(name)}`"
    exclude = _field(obj, "exclude", dict, where)
    for pkg, reason in exclude.items():
        if not NAME_RE.fullmatch(pkg):
            raise UserError(f"{where}: excluded name {pkg!r} is not a Debian package name (Debian Policy 5.6.1: "
                            f"{NAME_RULE}); fix the name")
        if not isinstance(reason, str) or not reason.strip():
            raise UserError(f"{where}: excluded package {pkg} needs a reason (a non-empty string)")
    suites = _field(obj, "suites", list, where)
    roots = _field(obj, "roots", list, where)
    if not suites or not roots or not all(isinstance(s, str) for s in suites + roots):
        raise UserError(f"{where}: suites and roots must be non-empty lists of names")
    for suite in suites:
        if not all(PATH_PART_RE.fullmatch(part) for part in suite.split("/")):
            raise UserError(f"{where}: suite {suite!r} is not a suite name (letters, digits and '.+~_-'); fix it")
    for root in roots:
        if not NAME_RE.fullmatch(root) and root not in META_ROOTS:
            raise UserError(f"{where}: root {root!r} is neither a Debian package name (Debian Policy 5.6.1: "
                            f"{NAME_RULE}) nor one of {', '.join(sorted(META_ROOTS))}; fix it")
    architecture = _field(obj, "architecture", str, where)
    if not ARCH_RE.fullmatch(architecture):
        raise UserError(f"{where}: architecture {architecture!r} is not a Debian architecture name (e.g. amd64); "
                        "fix it")
    packages = tuple(_parse_package(p, f"{where} package", architecture, fix)
                     for p in _field(obj, "packages", list, where))
    names = [p.name for p in packages]
    if names != sorted(set(names)):
        raise UserError(f"{where}: packages must be sorted by name, each once; rewrite it with "
                        f"`{resolve_command(name)}`")
    return DebSet(name=name, description=_field(obj, "description", str, where),
                  archive=_field(obj, "archive", str, where), suites=tuple(suites),
                  architecture=architecture, roots=tuple(roots), exclude=dict(exclude), packages=packages)


def read_raw(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {"schema_version": SCHEMA_VERSION, "sets": {}}
    # Each set's fields are checked by parse_set, which also checks what add-set is about to write.
    return load_json_file(path, "Debian lock", Object({"schema_version": Enum(SCHEMA_VERSION), "sets": MapOf(ANY)}),
                          "restore it from git")


def load_sets(path: Path | str = DEFAULT_LOCK) -> dict[str, DebSet]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"Debian lock {path} not found; run from the repository root or pass --lock FILE")
    return {name: parse_set(name, obj, path) for name, obj in read_raw(path)["sets"].items()}


def load_set(path: Path | str, name: str) -> DebSet:
    sets = load_sets(path)
    if name not in sets:
        raise UserError(f"Debian lock {path}: no set '{name}' (sets: {', '.join(sorted(sets)) or 'none'}); "
                        "create it with `python3 -m tools.fetch.debian add-set NAME --suite S --packages a,b`")
    return sets[name]


def write_set(path: Path, name: str, obj: Mapping[str, Any]) -> DebSet:
    data = read_raw(path)
    data["sets"][name] = dict(obj)
    result = parse_set(name, data["sets"][name], path)  # never write what the loader refuses
    write_bytes_atomic(path, review_json(data))
    return result


def resolve_set(path: Path, name: str, spec: Mapping[str, Any], keyring: Path | None,
                fetch_index=fetch_suite_index) -> DebSet:
    """Resolve `spec` (description, archive, suites, architecture, roots, exclude) and write it."""
    candidates: list[Candidate] = []
    for suite in spec["suites"]:
        candidates += fetch_index(spec["archive"], suite, spec["architecture"], keyring)
    closure = resolve_closure(Index(candidates), spec["roots"], spec["exclude"], name)
    obj = {**spec, "packages": [c.entry(spec["archive"]) for c in closure]}
    result = write_set(path, name, obj)
    total = sum(p.size for p in result.packages)
    print(f"debian: set '{name}': {len(result.packages)} packages, {human_bytes(total)} -> {path}",
          file=sys.stderr)
    return result


def installed_versions(status_text: str) -> dict[str, str]:
    """name -> version of the installed packages in a dpkg status file."""
    return {st["Package"]: st["Version"] for st in parse_stanzas(status_text)
            if st.get("Status", "").endswith(" installed") and "Package" in st and "Version" in st}


def check_installed(deb_set: DebSet, status_text: str, what: str) -> None:
    """A root built from the set must hold exactly the set's packages at the set's versions."""
    installed = installed_versions(status_text)
    locked = {p.name: p.version for p in deb_set.packages}
    if installed == locked:
        return
    extra = sorted(f"{n} {v}" for n, v in installed.items() if locked.get(n) != v)
    unused = sorted(f"{n} {v}" for n, v in locked.items() if installed.get(n) != v)
    raise UserError(f"{what}: installed packages differ from set '{deb_set.name}' (installed, not in the set: "
                    f"{', '.join(extra) or 'none'}; in the set, not installed: {', '.join(unused) or 'none'}); "
                    "apt chose other alternatives than the resolver: exclude the unused names with a reason and "
                    f"`{resolve_command(deb_set.name)}`")


# --- CLI ---------------------------------------------------------------------------------------

def _names(values: Sequence[str]) -> list[str]:
    return [n.strip() for v in values for n in v.split(",") if n.strip()]


def parse_excludes(values: Sequence[str], default_reason: str | None) -> dict[str, str]:
    """`--exclude NAME=REASON` (the reason may hold commas) or `--exclude a,b --exclude-reason R`."""
    result = {}
    items = [(v.partition("=")[0].strip(), v.partition("=")[2]) if "=" in v else (n, None)
             for v in values for n in ([v] if "=" in v else _names([v]))]
    for name, given in items:
        reason = given.strip() if given is not None else (default_reason or "")
        if not reason:
            raise UserError(f"--exclude {name}: give a reason (--exclude {name}=REASON or --exclude-reason TEXT)")
        if not NAME_RE.fullmatch(name):
            raise UserError(f"--exclude {name}: not a Debian package name")
        result[name] = reason
    return result


def cmd_add_set(args: argparse.Namespace) -> int:
    roots = sorted(set(_names(args.packages)))
    for root in roots:
        if not NAME_RE.fullmatch(root) and root not in META_ROOTS:
            raise UserError(f"--packages {root}: not a Debian package name")
    if not roots:
        raise UserError("add-set: --packages names no package")
    spec = {"description": args.description or "", "archive": args.archive, "suites": list(args.suite),
            "architecture": args.architecture, "roots": roots,
            "exclude": parse_excludes(args.exclude, args.exclude_reason)}
    resolve_set(Path(args.lock), args.name, spec, None if args.no_verify_signature else Path(args.keyring))
    return 0


def cmd_resolve(args: argparse.Namespace) -> int:
    lock = Path(args.lock)
    names = args.set or sorted(load_sets(lock))
    for name in names:
        s = load_set(lock, name)
        spec = {"description": s.description, "archive": s.archive, "suites": list(s.suites),
                "architecture": s.architecture, "roots": list(s.roots), "exclude": dict(s.exclude)}
        resolve_set(lock, name, spec, None if args.no_verify_signature else Path(args.keyring))
    return 0


def cmd_check_root(args: argparse.Namespace) -> int:
    status = Path(args.root) / "var" / "lib" / "dpkg" / "status"
    if not status.is_file():
        raise UserError(f"--root {args.root}: no var/lib/dpkg/status; pass the root mmdebstrap built")
    check_installed(load_set(args.lock, args.set), status.read_text(encoding="utf-8", errors="replace"),
                    f"root {args.root}")
    return 0


def cmd_key(args: argparse.Namespace) -> int:
    print(load_set(args.lock, args.set).content_key())
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    sets = load_sets(args.lock)
    for name in args.set or sorted(sets):
        s = load_set(args.lock, name)
        print(f"{name}: {len(s.packages)} packages, {human_bytes(sum(p.size for p in s.packages))}, "
              f"suites {' '.join(s.suites)}, key {s.content_key()[:16]}")
        for p in s.packages:
            print(f"  {p.name:40} {p.version:32} {human_bytes(p.size):>10} {p.sha256[:16]}")
    return 0


def build_parser(add_commands: Callable[[Any, argparse.ArgumentParser], None] | None = None
                 ) -> argparse.ArgumentParser:
    """The Debian CLI: the lock's commands (resolve, add-set, check-root, key, show) and, through
    `add_commands(subparsers, common)`, the fetch stage's (mirror, extract, repo), which
    tools/fetch/debian.py passes: `python3 -m tools.fetch.debian` is the CLI."""
    parser = argparse.ArgumentParser(prog="python3 -m tools.fetch.debian", description=__doc__.split("\n\n")[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--lock", default=str(DEFAULT_LOCK), help="Debian lock (default: %(default)s)")
    resolving = argparse.ArgumentParser(add_help=False)
    resolving.add_argument("--keyring", default=str(DEFAULT_KEYRING), help="keyring gpgv checks InRelease with")
    resolving.add_argument("--no-verify-signature", action="store_true",
                           help="skip gpgv (the indexes are still checked against InRelease's sha256 list)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("resolve", parents=[common, resolving], help="re-resolve sets from their recorded inputs")
    p.add_argument("--set", action="append", default=[], help="set name (repeatable; default: every set)")
    p.set_defaults(func=cmd_resolve)

    p = sub.add_parser("add-set", parents=[common, resolving], help="create (or replace) a set and resolve it")
    p.add_argument("name")
    p.add_argument("--suite", action="append", required=True)
    p.add_argument("--packages", action="append", required=True, help="root packages, comma-separated")
    p.add_argument("--exclude", action="append", default=[], help="NAME[=REASON],... left out of the closure")
    p.add_argument("--exclude-reason", help="the reason for --exclude names given without one")
    p.add_argument("--archive", default=DEFAULT_ARCHIVE)
    p.add_argument("--architecture", default="amd64")
    p.add_argument("--description")
    p.set_defaults(func=cmd_add_set)

    if add_commands is not None:
        add_commands(sub, common)

    p = sub.add_parser("check-root", parents=[common], help="a built root holds exactly the set's packages")
    p.add_argument("--set", required=True)
    p.add_argument("--root", required=True)
    p.set_defaults(func=cmd_check_root)

    p = sub.add_parser("key", parents=[common], help="print a set's content key (sha256 of its entries)")
    p.add_argument("--set", required=True)
    p.set_defaults(func=cmd_key)

    p = sub.add_parser("show", parents=[common], help="print a set's packages")
    p.add_argument("--set", action="append", default=[])
    p.set_defaults(func=cmd_show)
    return parser



if __name__ == "__main__":
    # The CLI lives in the fetch stage (its mirror, extract and repo commands fetch .debs); this
    # module is the lock's library. An old command line gets the new one, not silence.
    print(f"error: the Debian CLI is `python3 -m tools.fetch.debian {' '.join(sys.argv[1:]) or 'COMMAND'}` "
          "(this module is its lock library)", file=sys.stderr)
    sys.exit(2)
