"""Load, validate and write the pins lock (third_party/pins.lock.json).

Schema: docs/DESIGN.md ("Lock file"). Every schema error is a one-line UserError that names
the lock file, the pin (or stack) and the field, so a typo in a hand edit is found at once.

Public API (every stage reads the lock through these, never with a json.loads of its own):
  load(path) -> Lock     the validated lock: typed pins (FilePin, GitDiffPin, GitTreePin) and
                         stacks; bad JSON, a schema error or an unknown stack/pin name in a
                         stack is a one-line UserError naming the lock and the field.
  Lock.pin(name), Lock.stack(name), Lock.toolchain(name)
                         a pin, stack or toolchain by name; an unknown name is a UserError with
                         close names.
  read_raw(path)         the decoded JSON (for editors that rewrite the lock), checked only as
                         JSON; write(path, data) validates it and writes it in canonical form.

Stdlib only: tools/fetch imports this module from inside Bazel repository rules, where only
a bare interpreter is available.
"""
from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence, Union

from tools.common.errors import UserError
from tools.common.files import write_text_atomic
from tools.common.jsondata import parse_json

SCHEMA_VERSION = 1
# absolute(), not resolve(): under Bazel, tools/ and third_party/ are runfiles symlinks whose
# targets need not sit side by side.
REPO_ROOT = Path(__file__).absolute().parents[2]
DEFAULT_LOCK = REPO_ROOT / "third_party" / "pins.lock.json"

# Every pattern here validates with fullmatch(): re.match() with `$` also accepts a trailing
# newline, so a sha256 or filename ending in "\n" would pass the schema and never fetch.
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_GIT_ID_RE = re.compile(r"[0-9a-f]{40}")
_PIN_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
# A filename is a single path component: mirrors store it as <mirror>/<filename>.
_FILENAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
_URL_SCHEMES = ("https://", "http://", "file://")
_STACK_TEXT_KEYS = ("description",)
_STACK_LIST_KEYS = ("wheels", "patch_pins", "closure_overrides")
_OVERRIDE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9.+!_-]+")


def is_sha256(value: str) -> bool:
    """True for exactly 64 lowercase hex digits, the only form a cache key or lock sha256 takes."""
    return _SHA256_RE.fullmatch(value) is not None


@dataclass(frozen=True)
class PackageRef:
    """The Python distribution a file pin holds (for version-coherence checks downstream)."""

    name: str
    version: str


@dataclass(frozen=True)
class FilePin:
    """A file fetched by URL and verified by sha256 and size (wheels, tarballs). The size is
    required: it is the cap on every read of a source, so an endless body cannot fill the disk."""

    name: str
    filename: str
    urls: tuple[str, ...]
    sha256: str
    size: int
    package: PackageRef | None = None
    description: str = ""
    kind: str = field(default="file", init=False)


@dataclass(frozen=True)
class GitDiffPin:
    """The canonical diff PARENT..COMMIT of a git repository, verified by tree ids and sha256."""

    name: str
    repository: str
    commit: str
    commit_tree: str
    parent: str
    parent_tree: str
    filename: str
    sha256: str
    description: str = ""
    kind: str = field(default="git_diff", init=False)


@dataclass(frozen=True)
class GitTreePin:
    """A source tree at a commit, verified by its git tree id. With `filename` and `sha256` (both
    or neither) the tree's canonical tar (`git archive`) is pinned too: a mirror then serves it
    as `<mirror>/<filename>`, and a tar rendered differently by this host's git is refused.

    `paths` (directory -> its tree id, sorted by directory): the archive holds only these
    directories of the commit (`git archive COMMIT -- DIR...`), for a build that reads only them
    from a repository whose other files a source may lack. The commit and the whole tree id are
    verified as without paths. Each directory's tree id follows from the whole tree id (git's
    tree ids are hashes of their entries), so it adds no integrity: it is recorded so that the
    subset is named in git's own ids (anyone can check it with `git rev-parse COMMIT:DIR` in any
    clone), and so that a hand-edited path fails at fetch naming the path, not as a sha256
    mismatch of the whole archive."""

    name: str
    repository: str
    commit: str
    tree: str
    description: str = ""
    filename: str = ""
    sha256: str = ""
    paths: Mapping[str, str] = field(default_factory=dict)
    kind: str = field(default="git_tree", init=False)


Pin = Union[FilePin, GitDiffPin, GitTreePin]


@dataclass(frozen=True)
class Stack:
    """The pins one image is built from.

    `roles` maps a role (sglang, flashinfer, mooncake, ...) to a pin name; `series` maps a
    `<x>_series` key to a patch series path; `wheels` is the full hashed wheel closure;
    `patch_pins` are pins (e.g. upstream git diffs) the patch series consume.
    """

    name: str
    description: str
    roles: Mapping[str, str]
    series: Mapping[str, str]
    wheels: tuple[str, ...] = ()
    patch_pins: tuple[str, ...] = ()
    # NAME==VERSION replacing the sglang wheel's own pin of NAME when the closure is resolved
    # (for a pin PyPI cannot serve); tools/pins/pypi.py applies them, the description says why.
    closure_overrides: tuple[str, ...] = ()

    def pin_names(self) -> list[str]:
        """Every pin this stack needs, each once, in a stable order."""
        names = list(self.roles.values()) + list(self.patch_pins) + list(self.wheels)
        return list(dict.fromkeys(names))


@dataclass(frozen=True)
class Toolchain:
    """Pins that together make one build toolchain (e.g. the CUDA compiler the kernel cache
    runs, assembled from NVIDIA's wheels): `release` is the version its users check against
    (nvcc's), `pins` the file pins it is made of, in the order they are unpacked."""

    name: str
    description: str
    release: str
    pins: tuple[str, ...]


@dataclass(frozen=True)
class Lock:
    """A validated lock file."""

    path: Path
    pins: Mapping[str, Pin]
    stacks: Mapping[str, Stack]
    toolchains: Mapping[str, Toolchain] = field(default_factory=dict)

    def pin(self, name: str) -> Pin:
        """The pin called `name`; an unknown name is a UserError listing close names."""
        if name in self.pins:
            return self.pins[name]
        close = difflib.get_close_matches(name, list(self.pins), n=5, cutoff=0.5)
        hint = f"close names: {', '.join(close)}" if close else "run `python3 -m tools.fetch verify` to list pins"
        raise UserError(f"{self.path}: pin '{name}' is not in the lock (unpinned input); {hint}")

    def stack(self, name: str) -> Stack:
        """The stack called `name`; an unknown name is a UserError listing the stacks."""
        if name in self.stacks:
            return self.stacks[name]
        raise UserError(f"{self.path}: stack '{name}' is not in the lock; stacks: {', '.join(sorted(self.stacks))}")

    def toolchain(self, name: str) -> Toolchain:
        """The toolchain called `name`; an unknown name is a UserError listing the toolchains."""
        if name in self.toolchains:
            return self.toolchains[name]
        raise UserError(f"{self.path}: toolchain '{name}' is not in the lock; toolchains: "
                        f"{', '.join(sorted(self.toolchains)) or 'none'}")


# ---------------------------------------------------------------------------------------------
# Field readers: each raises a one-line UserError naming the lock, the owner and the field.


class _Fields:
    """Typed access to one JSON object of the lock, with errors that name where it is."""

    def __init__(self, lock_path: Path, owner: str, obj: Any) -> None:
        self.where = f"{lock_path}: {owner}"
        if not isinstance(obj, dict):
            raise UserError(f"{self.where} must be a JSON object, got {type(obj).__name__}")
        self.obj: dict[str, Any] = obj

    def fail(self, key: str, problem: str) -> UserError:
        return UserError(f"{self.where}: {key} {problem}")

    def check_known(self, allowed: Sequence[str]) -> None:
        for key in self.obj:
            if key not in allowed:
                close = difflib.get_close_matches(key, allowed, n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else f"; allowed: {', '.join(allowed)}"
                raise self.fail(f"field '{key}'", f"is not part of the schema{hint}")

    def text(self, key: str, *, required: bool = True, pattern: re.Pattern[str] | None = None,
             expect: str = "") -> str:
        if key not in self.obj:
            if required:
                raise self.fail(key, "is missing")
            return ""
        value = self.obj[key]
        if not isinstance(value, str) or not value:
            raise self.fail(key, f"must be a non-empty string, got {value!r}")
        if pattern is not None and not pattern.fullmatch(value):
            raise self.fail(key, f"must be {expect}, got {value!r}")
        return value

    def sha256(self, key: str) -> str:
        return self.text(key, pattern=_SHA256_RE, expect="64 lowercase hex chars")

    def git_id(self, key: str) -> str:
        return self.text(key, pattern=_GIT_ID_RE, expect="a full 40-char lowercase hex git object id")

    def url(self, key: str) -> str:
        value = self.text(key)
        if not value.startswith(_URL_SCHEMES):
            raise self.fail(key, f"must be an https://, http:// or file:// URL, got {value!r}")
        return value

    def urls(self, key: str) -> tuple[str, ...]:
        value = self.obj.get(key)
        if value is None:
            raise self.fail(key, "is missing")
        if not isinstance(value, list) or not value:
            raise self.fail(key, f"must be a non-empty list of URLs, got {value!r}")
        for url in value:
            if not isinstance(url, str) or not url.startswith(_URL_SCHEMES):
                raise self.fail(key, f"must hold only https://, http:// or file:// URLs, got {url!r}")
        if len(set(value)) != len(value):
            raise self.fail(key, "lists a URL twice")
        return tuple(value)

    def size(self, key: str) -> int:
        if key not in self.obj:
            raise self.fail(key, "is missing (a file pin's byte count caps every download): add it, or re-pin with "
                                 "`python3 -m tools.pins.pypi add-pypi NAME==VERSION`")
        value: object = self.obj[key]
        # bool is an int subclass; `true` is not a size.
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.fail(key, f"must be a non-negative integer byte count, got {value!r}")
        return value

    def name_list(self, key: str) -> tuple[str, ...]:
        value = self.obj.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise self.fail(key, f"must be a list of pin names, got {value!r}")
        if len(set(value)) != len(value):
            dup = next(v for v in value if value.count(v) > 1)
            raise self.fail(key, f"lists pin '{dup}' twice")
        return tuple(value)


def _parse_package(lock_path: Path, pin_name: str, obj: Any) -> PackageRef:
    fields = _Fields(lock_path, f"pin '{pin_name}': package", obj)
    fields.check_known(["name", "version"])
    return PackageRef(name=fields.text("name"), version=fields.text("version"))


def _parse_file_pin(name: str, f: _Fields, lock_path: Path) -> FilePin:
    f.check_known(["kind", "description", "package", "filename", "urls", "sha256", "size"])
    package = _parse_package(lock_path, name, f.obj["package"]) if "package" in f.obj else None
    return FilePin(
        name=name,
        filename=f.text("filename", pattern=_FILENAME_RE, expect="a plain file name (no '/')"),
        urls=f.urls("urls"),
        sha256=f.sha256("sha256"),
        size=f.size("size"),
        package=package,
        description=f.text("description", required=False),
    )


def _parse_git_diff_pin(name: str, f: _Fields) -> GitDiffPin:
    f.check_known(["kind", "description", "repository", "commit", "commit_tree", "parent",
                   "parent_tree", "filename", "sha256"])
    pin = GitDiffPin(
        name=name,
        repository=f.url("repository"),
        commit=f.git_id("commit"),
        commit_tree=f.git_id("commit_tree"),
        parent=f.git_id("parent"),
        parent_tree=f.git_id("parent_tree"),
        filename=f.text("filename", pattern=_FILENAME_RE, expect="a plain file name (no '/')"),
        sha256=f.sha256("sha256"),
        description=f.text("description", required=False),
    )
    if pin.commit == pin.parent:
        raise f.fail("parent", "must differ from commit (the diff would be empty)")
    return pin


def tree_path_problem(path: str) -> str:
    """Why `path` cannot be a directory of a git_tree pin's `paths` ('' when it can). Only one
    spelling of each directory is accepted (no "a/", "./a", "a//b"), so a path compares, sorts
    and keys the cache the same wherever it is written, and none can leave the tree."""
    if not path:
        return "holds an empty path: name a directory (the whole tree is the pin without paths)"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        return f"{path!r} holds a control character: name the directory as git lists it"
    if path.startswith("/"):
        return f"{path!r} is absolute: name it relative to the repository root ({path.strip('/')!r})"
    parts = path.split("/")
    if ".." in parts:
        return f"{path!r} leaves the tree ('..'): name a directory inside the repository"
    if any(part in ("", ".") for part in parts):
        normal = "/".join(part for part in parts if part not in ("", "."))
        return f"{path!r} is not normalized (an empty or '.' part): write {normal!r}"
    return ""


def tree_paths_problem(paths: Sequence[str]) -> str:
    """Why `paths` cannot be a git_tree pin's directories ('' when they can): each as
    tree_path_problem says, sorted, each once, none inside another (it would add nothing)."""
    for path in paths:
        problem = tree_path_problem(path)
        if problem:
            return problem
    for path in paths:
        if list(paths).count(path) > 1:
            return f"lists {path!r} twice"
    if list(paths) != sorted(paths):
        return "are not sorted: list them as " + ", ".join(repr(p) for p in sorted(paths))
    for path in paths:
        for outer in paths:
            if path.startswith(outer + "/"):
                return f"{path!r} lies inside {outer!r}, which holds it already: drop {path!r}"
    return ""


def _parse_tree_paths(f: _Fields) -> dict[str, str]:
    value = f.obj["paths"]
    if not isinstance(value, dict) or not value:
        raise f.fail("paths", "must be a non-empty object mapping each directory to its tree id (`git rev-parse "
                     f"COMMIT:DIR`), got {value!r}; `python3 -m tools.fetch add-git-tree --path DIR` writes it")
    problem = tree_paths_problem(list(value))
    if problem:
        raise f.fail("paths", problem)
    for path, tree in value.items():
        if not isinstance(tree, str) or not _GIT_ID_RE.fullmatch(tree):
            raise f.fail(f"paths[{path!r}]", f"must be the directory's full 40-char lowercase hex tree id (`git "
                         f"rev-parse COMMIT:{path}`), got {tree!r}")
    return dict(value)


def _parse_git_tree_pin(name: str, f: _Fields) -> GitTreePin:
    f.check_known(["kind", "description", "repository", "commit", "tree", "paths", "filename", "sha256"])
    archived = [key for key in ("filename", "sha256") if key in f.obj]
    if len(archived) == 1:
        other = "sha256" if archived[0] == "filename" else "filename"
        raise f.fail(other, f"is missing: a git_tree pin's archive needs both filename and sha256 (it has "
                     f"{archived[0]}); `python3 -m tools.fetch add-git-tree` writes both")
    return GitTreePin(
        name=name,
        repository=f.url("repository"),
        commit=f.git_id("commit"),
        tree=f.git_id("tree"),
        description=f.text("description", required=False),
        filename=f.text("filename", pattern=_FILENAME_RE, expect="a plain file name (no '/')") if archived else "",
        sha256=f.sha256("sha256") if archived else "",
        paths=_parse_tree_paths(f) if "paths" in f.obj else {},
    )


_KINDS = ("file", "git_diff", "git_tree")


def parse_pin(lock_path: Path, name: str, obj: Any) -> Pin:
    """One validated pin from its JSON object."""
    if not _PIN_NAME_RE.fullmatch(name):
        raise UserError(f"{lock_path}: pin name {name!r} must match {_PIN_NAME_RE.pattern}")
    f = _Fields(lock_path, f"pin '{name}'", obj)
    kind = f.text("kind")
    if kind == "file":
        return _parse_file_pin(name, f, lock_path)
    if kind == "git_diff":
        return _parse_git_diff_pin(name, f)
    if kind == "git_tree":
        return _parse_git_tree_pin(name, f)
    raise f.fail("kind", f"must be one of {', '.join(_KINDS)}, got {kind!r}")


def parse_stack(lock_path: Path, name: str, obj: Any, pins: Mapping[str, Pin]) -> Stack:
    """One validated stack; every pin it names must exist in `pins`."""
    f = _Fields(lock_path, f"stack '{name}'", obj)
    roles: dict[str, str] = {}
    series: dict[str, str] = {}
    for key, value in f.obj.items():
        if key in _STACK_TEXT_KEYS or key in _STACK_LIST_KEYS:
            continue
        if key.endswith("_series"):
            path = f.text(key)
            if path.startswith("/") or ".." in Path(path).parts:
                raise f.fail(key, f"must be a path relative to the repository root, got {path!r}")
            series[key] = path
        else:
            roles[key] = f.text(key)
    stack = Stack(
        name=name,
        description=f.text("description", required=False),
        roles=roles,
        series=series,
        wheels=f.name_list("wheels"),
        patch_pins=f.name_list("patch_pins"),
        closure_overrides=f.name_list("closure_overrides"),
    )
    for override in stack.closure_overrides:
        if not _OVERRIDE_RE.fullmatch(override):
            raise f.fail("closure_overrides", f"must hold NAME==VERSION requirements, got {override!r}")
    for role, pin_name in [*roles.items(), *(("wheels", w) for w in stack.wheels),
                           *(("patch_pins", p) for p in stack.patch_pins)]:
        if pin_name not in pins:
            close = difflib.get_close_matches(pin_name, list(pins), n=3, cutoff=0.5)
            hint = f"; close names: {', '.join(close)}" if close else "; add the pin or fix the name"
            raise f.fail(role, f"names unknown pin '{pin_name}'{hint}")
    return stack


def parse_toolchain(lock_path: Path, name: str, obj: Any, pins: Mapping[str, Pin]) -> Toolchain:
    """One validated toolchain; every pin it names must be a `file` pin of `pins`."""
    f = _Fields(lock_path, f"toolchain '{name}'", obj)
    f.check_known(["description", "release", "pins"])
    toolchain = Toolchain(name=name, description=f.text("description", required=False),
                          release=f.text("release"), pins=f.name_list("pins"))
    if not toolchain.pins:
        raise f.fail("pins", "must name at least one pin")
    for pin_name in toolchain.pins:
        if pin_name not in pins:
            close = difflib.get_close_matches(pin_name, list(pins), n=3, cutoff=0.5)
            hint = f"; close names: {', '.join(close)}" if close else "; add the pin or fix the name"
            raise f.fail("pins", f"names unknown pin '{pin_name}'{hint}")
        if not isinstance(pins[pin_name], FilePin):
            raise f.fail("pins", f"names '{pin_name}', a {pins[pin_name].kind} pin; a toolchain is made of file pins")
    return toolchain


def _check_unique_filenames(lock_path: Path, pins: Mapping[str, Pin]) -> None:
    # Mirrors store `file`, `git_diff` and archived `git_tree` pins flat as <mirror>/<filename>:
    # two pins sharing a filename would overwrite each other there.
    owner: dict[str, str] = {}
    for pin in pins.values():
        filename = getattr(pin, "filename", None)
        if not filename:
            continue
        if filename in owner:
            raise UserError(f"{lock_path}: pin '{pin.name}': filename '{filename}' is also used by pin "
                            f"'{owner[filename]}'; mirrors store files by name, so filenames must be unique")
        owner[filename] = pin.name


def parse_lock(path: Path, data: Any) -> Lock:
    """Validate decoded lock JSON `data` read from `path`."""
    top = _Fields(path, "top level", data)
    top.check_known(["schema_version", "pins", "stacks", "toolchains"])
    version = top.obj.get("schema_version")
    if version != SCHEMA_VERSION:
        raise top.fail("schema_version", f"must be {SCHEMA_VERSION}, got {version!r}; use a matching tools/ checkout")
    raw_pins = _Fields(path, "pins", top.obj.get("pins")).obj
    pins = {name: parse_pin(path, name, obj) for name, obj in raw_pins.items()}
    _check_unique_filenames(path, pins)
    raw_stacks = _Fields(path, "stacks", top.obj.get("stacks", {})).obj
    stacks = {name: parse_stack(path, name, obj, pins) for name, obj in raw_stacks.items()}
    raw_toolchains = _Fields(path, "toolchains", top.obj.get("toolchains", {})).obj
    toolchains = {name: parse_toolchain(path, name, obj, pins) for name, obj in raw_toolchains.items()}
    return Lock(path=path, pins=pins, stacks=stacks, toolchains=toolchains)


def read_raw(path: Path) -> Any:
    """The decoded JSON of a lock file; unreadable or invalid JSON is a UserError."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: lock file not found; pass --lock PATH") from None
    except IsADirectoryError:
        raise UserError(f"{path}: is a directory, not a lock file; pass --lock PATH/pins.lock.json") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: lock file is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                        "pass the JSON lock file, or re-save it as UTF-8") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read lock file ({e.strerror}); check its permissions") from None

    # A key twice (e.g. a duplicated pin) is an error, not silently the last one. The fields are
    # checked by parse_lock, by hand: its messages name the pin or stack and the fix.
    return parse_json(text, str(path))


def load(path: Path | str = DEFAULT_LOCK) -> Lock:
    """Read and validate a lock file."""
    path = Path(path)
    return parse_lock(path, read_raw(path))


# ---------------------------------------------------------------------------------------------
# Deterministic writing: the lock is machine-edited (add-pypi, lock-closure), so its bytes must
# depend only on its content (stable key order, 2-space indent, trailing newline) to keep diffs
# reviewable.

_PIN_KEY_ORDER = ("kind", "description", "package", "filename", "repository", "commit", "commit_tree",
                  "tree", "paths", "parent", "parent_tree", "urls", "sha256", "size")
_STACK_KEY_ORDER = ("description", "sglang", "flashinfer", "torch", "mooncake")


def _ordered(obj: Mapping[str, Any], first: Sequence[str]) -> dict[str, Any]:
    """`obj` with keys in `first` order, then the rest sorted (so new fields have a fixed place)."""
    keys = [k for k in first if k in obj] + sorted(k for k in obj if k not in first)
    return {k: obj[k] for k in keys}


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def _dump(value: Any, indent: int) -> str:
    """JSON text; small all-scalar containers (<= 2 items) stay on one line for readability."""
    pad = "  " * indent
    inner = "  " * (indent + 1)
    if isinstance(value, dict):
        if not value:
            return "{}"
        if len(value) <= 2 and all(_is_scalar(v) for v in value.values()):
            return "{" + ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in value.items()) + "}"
        body = ",\n".join(f"{inner}{json.dumps(k)}: {_dump(v, indent + 1)}" for k, v in value.items())
        return "{\n" + body + "\n" + pad + "}"
    if isinstance(value, list):
        if not value:
            return "[]"
        if len(value) <= 1 and all(_is_scalar(v) for v in value):
            return "[" + ", ".join(json.dumps(v) for v in value) + "]"
        body = ",\n".join(f"{inner}{_dump(v, indent + 1)}" for v in value)
        return "[\n" + body + "\n" + pad + "]"
    return json.dumps(value)


def canonical_text(data: Mapping[str, Any]) -> str:
    """The canonical lock text for decoded lock JSON `data`."""
    pins = {name: _ordered(pin, _PIN_KEY_ORDER) for name, pin in sorted(data.get("pins", {}).items())}
    for pin in pins.values():
        if isinstance(pin.get("package"), dict):
            pin["package"] = _ordered(pin["package"], ("name", "version"))
    stacks = {name: _ordered(stack, _STACK_KEY_ORDER) for name, stack in sorted(data.get("stacks", {}).items())}
    top = {"schema_version": data.get("schema_version", SCHEMA_VERSION), "pins": pins, "stacks": stacks}
    if data.get("toolchains"):
        top["toolchains"] = {name: _ordered(tc, ("description", "release", "pins"))
                             for name, tc in sorted(data["toolchains"].items())}
    return _dump(top, 0) + "\n"


def write(path: Path, data: Mapping[str, Any]) -> Lock:
    """Validate `data` and write it canonically to `path`; returns the validated lock."""
    lock = parse_lock(path, data)
    write_text_atomic(path, canonical_text(data), fsync=True)  # fsync: a pin bump must survive a crash
    return lock
