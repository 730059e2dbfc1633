"""The patch gate: check every patch of a series against a wheel tree, remap, apply atomically.

Pipeline per target (a pinned wheel, or an unpacked wheel directory):
  1. read the series (`pin:<lock pin>` / `file:<patch next to the series>` entries, in order);
  2. remap each patch from the upstream source layout to the wheel layout with the declared
     rules of a wheel_layout.json (files absent from the wheel are excluded and reported; a
     path no rule covers is an error);
  3. in a scratch copy, for patch N with 1..N-1 already applied: `git apply --check` forward and
     in reverse -> `applies` / `already upstream` / `conflicts` (file and hunk named), then apply;
  4. only if no patch conflicts: verify every untouched file against the wheel's RECORD, write
     the manifest of changed files, and rename the scratch tree onto the output in one step.

Subcommands: apply, check, update-manifest, check-manifest, install-manifest, remap, repack-wheel
(see `--help` and flashinfer_patches/README.md). Exit codes: 0 ok, 1 conflict or manifest drift,
2 bad input (a malformed patch included).
"""
from __future__ import annotations

import argparse
import ctypes
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Sequence

from tools.patch_gate import wheel as wheel_repack
from tools.common.errors import UserError, run_cli

STATE_APPLIES = "applies"
STATE_UPSTREAM = "already upstream"
STATE_CONFLICTS = "conflicts"
# Every file of the patch is outside the wheel (tests/, benchmarks/...): nothing was applied, and
# saying `applies` would claim (in the table, the manifest and the SBOM) that it was.
STATE_EXCLUDED = "excluded"
MANIFEST_SCHEMA_VERSION = 1
LAYOUT_SCHEMA_VERSION = 1
EXIT_REFUSED = 1
# File modes a wheel can hold; symlinks (120000) and submodule pointers (160000) cannot be
# shipped in a wheel, and a symlink could later redirect writes outside the tree.
_ALLOWED_MODES = {"100644", "100755"}


def log(message: str) -> None:
    """Progress to stderr (stdout carries the table)."""
    print(f"patch_gate: {message}", file=sys.stderr, flush=True)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, 2-space indent, trailing newline: byte-stable for review and comparison."""
    return (json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=True) + "\n").encode("ascii")


def write_atomic(path: Path, data: bytes) -> None:
    """Write a file via a temp sibling and a rename, so readers never see half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp creates 0600; outputs (and committed manifests) are plain readable files.
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def replace_dir(new: Path, target: Path) -> None:
    """Put a finished directory in place of `target` (absent or a previous output).

    Concurrent applies to one output are serialised by an flock on a sibling lock file (without
    it their renames race: ENOTEMPTY, a vanished target). A previous output is swapped out with
    one rename(RENAME_EXCHANGE) where the file system has it, so readers always find a directory
    at `target`; elsewhere two renames leave a moment without one. `new` is gone afterwards.
    """
    if target.is_symlink() or target.is_file():
        raise UserError(f"--out-dir {target}: exists and is not a directory; remove it or pick another path")
    parent = target.resolve().parent
    garbage: Path | None = None  # what holds the previous output afterwards
    with open(parent / f".{target.name}.lock", "a") as lock:  # "a": create, never truncate
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_symlink() or (target.exists() and not target.is_dir()):
            raise UserError(f"--out-dir {target}: exists and is not a directory; remove it or pick another path")
        if not target.exists():
            os.rename(new, target)
        elif _exchange(new, target):
            garbage = new
        else:
            garbage = Path(tempfile.mkdtemp(prefix=f".{target.name}.previous-", dir=parent))
            os.rename(target, garbage / "tree")
            os.rename(new, target)
    if garbage is not None:  # outside the lock: deleting a large tree must not hold up other writers
        shutil.rmtree(garbage)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:  # C libraries before glibc 2.28
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # the file system cannot exchange
        return False
    raise OSError(err, os.strerror(err), str(b))


# --------------------------------------------------------------------------- series


@dataclass(frozen=True)
class SeriesEntry:
    """One line of a series file: `pin:<lock pin name>` or `file:<patch relative to the series>`."""

    kind: str
    ref: str
    line: int

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.ref}"


@dataclass(frozen=True)
class PatchSource:
    """A series entry with the bytes it resolved to."""

    entry: SeriesEntry
    path: Path
    data: bytes

    @property
    def sha256(self) -> str:
        return sha256_bytes(self.data)


def read_series(path: Path) -> list[SeriesEntry]:
    """Parse a series file; `#` starts a comment, blank lines are ignored."""
    if not path.is_file():
        raise UserError(f"--series {path}: not a file; pass a series file such as flashinfer_patches/default.series")
    entries: list[SeriesEntry] = []
    for number, raw in enumerate(path.read_text(encoding="utf-8").split("\n"), start=1):
        text = raw.split("#", 1)[0].strip()
        if not text:
            continue
        kind, sep, ref = text.partition(":")
        if not sep or kind not in ("pin", "file") or not ref.strip() or " " in ref.strip():
            raise UserError(f"{path}:{number}: {text!r} is not `pin:<lock pin name>` or `file:<patch path>`; fix the line")
        entries.append(SeriesEntry(kind=kind, ref=ref.strip(), line=number))
    labels = [e.label for e in entries]
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        raise UserError(f"{path}: {duplicates[0]} is listed twice; a patch can be applied only once")
    return entries


def parse_pin_files(values: Sequence[str]) -> dict[str, Path]:
    """`--pin-file NAME=PATH` arguments as a dict."""
    pins: dict[str, Path] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise UserError(f"--pin-file {value!r}: expected NAME=PATH, e.g. flashinfer-pr4460=/path/to/the.diff")
        if name in pins:
            raise UserError(f"--pin-file {name}: given twice; pass each pin once")
        pins[name] = Path(path)
    return pins


def load_lock(path: Path) -> dict[str, Any]:
    try:
        lock = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"--lock {path}: unreadable ({e}); pass third_party/pins.lock.json") from e
    if not isinstance(lock.get("pins"), dict):
        raise UserError(f"--lock {path}: no `pins` object; pass third_party/pins.lock.json")
    return lock


def verify_pin_sha256(lock: dict[str, Any], name: str, data_sha256: str, origin: str) -> None:
    """Refuse a file whose sha256 is not the lock's for that pin (the fetch stage should have caught it)."""
    pin = lock["pins"].get(name)
    if pin is None:
        raise UserError(f"{origin}: pin {name!r} is not in the lock; add it to third_party/pins.lock.json or fix the name")
    if pin.get("sha256") != data_sha256:
        raise UserError(f"{origin}: sha256 {data_sha256} is not the lock's {pin.get('sha256')} for pin {name}; re-fetch it")


def resolve_series(series: Path, entries: list[SeriesEntry], pin_files: dict[str, Path], lock: dict[str, Any] | None) -> list[PatchSource]:
    """Read the patch bytes of every entry (pins from --pin-file, files next to the series)."""
    sources: list[PatchSource] = []
    for entry in entries:
        if entry.kind == "pin":
            if entry.ref not in pin_files:
                raise UserError(f"{series}:{entry.line}: {entry.label} has no --pin-file {entry.ref}=PATH; pass the fetched file")
            path = pin_files[entry.ref]
        else:
            rel = wheel_repack.check_member_path(entry.ref, f"{series}:{entry.line}")
            path = series.parent.joinpath(*rel.parts)
        if not path.is_file():
            raise UserError(f"{series}:{entry.line}: {entry.label} -> {path} is not a file; fetch or add it")
        source = PatchSource(entry=entry, path=path, data=path.read_bytes())
        if entry.kind == "pin" and lock is not None:
            verify_pin_sha256(lock, entry.ref, source.sha256, f"--pin-file {entry.ref}")
        sources.append(source)
    unused = sorted(set(pin_files) - {e.ref for e in entries if e.kind == "pin"})
    if unused:
        raise UserError(f"--pin-file {unused[0]}: the series has no pin:{unused[0]} entry; drop the argument or fix the series")
    return sources


# --------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class LayoutRule:
    """A source-path prefix (ending in '/') or exact file and where it lives in the wheel (None: excluded)."""

    source: str
    wheel: str | None
    reason: str

    def matches(self, path: str) -> bool:
        return path.startswith(self.source) if self.source.endswith("/") else path == self.source

    def apply(self, path: str) -> str:
        assert self.wheel is not None
        return self.wheel + path[len(self.source):]


@dataclass(frozen=True)
class WheelLayout:
    """Declared source->wheel path rules; the longest matching rule wins."""

    name: str
    sha256: str
    rules: tuple[LayoutRule, ...]

    @classmethod
    def load(cls, path: Path) -> WheelLayout:
        try:
            data = path.read_bytes()
            doc = json.loads(data)
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"--layout {path}: unreadable ({e}); pass a wheel_layout.json") from e
        if doc.get("schema_version") != LAYOUT_SCHEMA_VERSION:
            raise UserError(f"--layout {path}: schema_version must be {LAYOUT_SCHEMA_VERSION}")
        rules: list[LayoutRule] = []
        for item in doc.get("map", []):
            rules.append(LayoutRule(source=item["source"], wheel=item["wheel"], reason=item.get("why", "")))
        for item in doc.get("exclude", []):
            if not item.get("why"):
                raise UserError(f"--layout {path}: exclude rule {item.get('source')!r} has no `why`; say why it is not in the wheel")
            rules.append(LayoutRule(source=item["source"], wheel=None, reason=item["why"]))
        sources = [r.source for r in rules]
        for rule in rules:
            if sources.count(rule.source) > 1:
                raise UserError(f"--layout {path}: source {rule.source!r} has two rules; keep one")
            if rule.wheel is not None and rule.source.endswith("/") != rule.wheel.endswith("/"):
                raise UserError(f"--layout {path}: rule {rule.source!r} -> {rule.wheel!r} mixes a directory and a file; end both with '/' or neither")
        return cls(name=path.name, sha256=sha256_bytes(data), rules=tuple(rules))

    def rule_for(self, source_path: str, origin: str) -> LayoutRule:
        matching = [r for r in self.rules if r.matches(source_path)]
        if not matching:
            raise UserError(f"{origin}: {source_path} matches no rule of {self.name}; add a map or exclude rule for it")
        return max(matching, key=lambda r: len(r.source))


# --------------------------------------------------------------------------- patch parsing


@dataclass(frozen=True)
class Hunk:
    number: int
    old_start: int
    new_start: int
    header: str


@dataclass
class FileSection:
    """One `diff --git` section: its raw lines, the paths it names (None = /dev/null) and hunks."""

    lines: list[str]
    old_path: str | None
    new_path: str | None
    hunks: list[Hunk]

    @property
    def path(self) -> str:
        return self.new_path or self.old_path or ""


_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def split_patch(text: str, origin: str) -> tuple[list[str], list[FileSection]]:
    """Split git-format patch text into its preamble and file sections.

    Only git-format patches are accepted: a body line always starts with ' ', '+', '-' or '\\',
    so a line starting with 'diff --git ' is unambiguously a section header. Hunks are checked
    against their headers' line counts (a cut patch is bad input, not a conflict), and a plain
    `---`/`+++` pair outside a section header is refused: git would apply it as one more file.
    """
    lines = text.split("\n")
    starts = [i for i, line in enumerate(lines) if line.startswith("diff --git ")]
    if not starts:
        raise UserError(f"{origin}: no `diff --git` header; regenerate the patch with `git diff` or `git format-patch`")
    _refuse_plain_sections(lines, 0, starts[0], origin)
    ends = starts[1:] + [len(lines) - 1 if text.endswith("\n") else len(lines)]
    sections = [parse_section(lines[a:b], origin, first_line=a + 1) for a, b in zip(starts, ends)]
    return lines[: starts[0]], sections


def _refuse_plain_sections(lines: list[str], begin: int, end: int, origin: str) -> None:
    """Refuse a `--- `/`+++ ` pair in lines[begin:end] (text git would read as a traditional diff)."""
    for i in range(begin, min(end, len(lines) - 1)):
        if lines[i].startswith("--- ") and lines[i + 1].startswith("+++ "):
            raise UserError(f"{origin}: line {i + 1}: a `---`/`+++` file section without a `diff --git` header "
                            "(git would apply it, the gate would not report it); regenerate the patch with `git diff`")


def _strip_prefix(name: str, prefix: str, origin: str) -> str:
    if name.startswith('"'):
        raise UserError(f"{origin}: quoted path {name}; rename the file to plain ASCII without spaces")
    if not name.startswith(prefix):
        raise UserError(f"{origin}: path {name!r} lacks the {prefix!r} prefix (absolute or -p0 patch); regenerate it with `git diff`")
    return name[len(prefix):]


def parse_section(lines: list[str], origin: str, first_line: int = 1) -> FileSection:
    """Read the paths, modes and hunks of one file section (lines[0] is patch line `first_line`)."""
    old_path: str | None = None
    new_path: str | None = None
    saw_minus = saw_plus = False
    renamed: dict[str, str] = {}
    hunks: list[Hunk] = []
    in_header = True
    binary = False
    # Lines still owed by the open hunk (old side, new side), from its header's counts.
    owed_old = owed_new = 0
    for offset, line in enumerate(lines[1:], start=1):
        number = first_line + offset
        if owed_old or owed_new:
            # An empty line is a context line whose trailing space was stripped; git accepts it.
            kind = line[:1] or " "
            if kind not in " +-\\":
                _corrupt(origin, number, hunks[-1], lines[0], "a line that is not ' ', '+', '-' or '\\'")
            owed_old -= kind in " -"
            owed_new -= kind in " +"
            if owed_old < 0 or owed_new < 0:
                _corrupt(origin, number, hunks[-1], lines[0], "more lines than its header counts")
            continue
        if in_header and (line.startswith("@@ ") or line.startswith("GIT binary patch")):
            in_header = False
            binary = line.startswith("GIT binary patch")
        if not in_header:
            if line.startswith("@@") and not binary:
                match = _HUNK_RE.match(line)
                if not match:
                    raise UserError(f"{origin}: corrupt patch at line {number}: {line[:60]!r} is not a hunk header; regenerate the patch")
                hunks.append(Hunk(len(hunks) + 1, int(match.group(1)), int(match.group(3)), line))
                owed_old = 1 if match.group(2) is None else int(match.group(2))
                owed_new = 1 if match.group(4) is None else int(match.group(4))
            elif line.startswith("--- ") and offset + 1 < len(lines) and lines[offset + 1].startswith("+++ "):
                raise UserError(f"{origin}: line {number}: a `---`/`+++` file section after the hunks of "
                                f"{lines[0][11:]} without its own `diff --git` header (git would apply it, the gate "
                                "would not report it); regenerate the patch with `git diff`")
            continue
        for key in ("new file mode ", "deleted file mode ", "old mode ", "new mode "):
            if line.startswith(key) and line[len(key):].strip() not in _ALLOWED_MODES:
                raise UserError(f"{origin}: {lines[0][11:]} sets mode {line[len(key):].strip()} (symlink or submodule); wheels hold regular files only")
        if line.startswith("index ") and len(line.split()) == 3 and line.split()[2] not in _ALLOWED_MODES:
            raise UserError(f"{origin}: {lines[0][11:]} has mode {line.split()[2]} (symlink or submodule); wheels hold regular files only")
        if line.startswith("--- "):
            saw_minus = True
            name = line[4:].rstrip("\t")
            old_path = None if name == "/dev/null" else _strip_prefix(name, "a/", origin)
        elif line.startswith("+++ "):
            saw_plus = True
            name = line[4:].rstrip("\t")
            new_path = None if name == "/dev/null" else _strip_prefix(name, "b/", origin)
        else:
            for key in ("rename from ", "rename to ", "copy from ", "copy to "):
                if line.startswith(key):
                    renamed[key.split()[1]] = line[len(key):]
    if owed_old or owed_new:
        _corrupt(origin, first_line + len(lines) - 1, hunks[-1], lines[0],
                 f"the patch ends {owed_old or owed_new} lines short of its header's count")
    if not (saw_minus and saw_plus):
        old_path, new_path = _paths_from_git_header(lines[0], renamed, origin)
        if any(l.startswith("new file mode ") for l in lines):
            old_path = None
        if any(l.startswith("deleted file mode ") for l in lines):
            new_path = None
    for path in (old_path, new_path):
        if path is not None:
            if re.search(r"\s", path):
                raise UserError(f"{origin}: path {path!r} contains whitespace; rename the file")
            wheel_repack.check_member_path(path, origin)
    return FileSection(lines=lines, old_path=old_path, new_path=new_path, hunks=hunks)


def _corrupt(origin: str, number: int, hunk: Hunk, header: str, what: str) -> None:
    """A hunk whose body does not match its header's line counts: a cut or hand-edited patch."""
    raise UserError(f"{origin}: corrupt patch at line {number}: hunk #{hunk.number} of {header[11:]} has {what} "
                    "(the patch was cut or hand-edited); regenerate it with `git diff`")


def _paths_from_git_header(header: str, renamed: dict[str, str], origin: str) -> tuple[str, str]:
    """Paths of a section without ---/+++ lines (binary, mode-only, pure rename)."""
    if "from" in renamed and "to" in renamed:
        return renamed["from"], renamed["to"]
    rest = header[len("diff --git "):]
    half = (len(rest) - 1) // 2
    old, new = rest[:half], rest[half + 1:]
    if rest[half] != " " or old[2:] != new[2:]:
        raise UserError(f"{origin}: cannot read the paths of {header!r}; regenerate the patch with `git diff`")
    return _strip_prefix(old, "a/", origin), _strip_prefix(new, "b/", origin)


# --------------------------------------------------------------------------- remap


@dataclass(frozen=True)
class MappedFile:
    """A file section after the layout remap."""

    source: str
    wheel: str
    old_wheel: str | None
    new_wheel: str | None
    hunks: tuple[Hunk, ...]


@dataclass(frozen=True)
class ExcludedFile:
    source: str
    reason: str


@dataclass(frozen=True)
class RemappedPatch:
    """A patch rewritten to wheel paths: `text` is what git apply sees and what reviewers read."""

    source: PatchSource
    text: str
    files: tuple[MappedFile, ...]
    excluded: tuple[ExcludedFile, ...]


def _rewrite_header(lines: list[str], old_wheel: str | None, new_wheel: str | None) -> list[str]:
    """Section lines with every path-bearing header line pointing at the wheel paths."""
    a_name = old_wheel or new_wheel
    b_name = new_wheel or old_wheel
    out = [f"diff --git a/{a_name} b/{b_name}"]
    in_header = True
    for line in lines[1:]:
        if in_header and (line.startswith("@@ ") or line.startswith("GIT binary patch")):
            in_header = False
        if in_header:
            if line.startswith("--- ") and old_wheel is not None:
                line = f"--- a/{old_wheel}"
            elif line.startswith("+++ ") and new_wheel is not None:
                line = f"+++ b/{new_wheel}"
            elif line.startswith(("rename from ", "copy from ")):
                line = f"{line.split(' from ')[0]} from {old_wheel}"
            elif line.startswith(("rename to ", "copy to ")):
                line = f"{line.split(' to ')[0]} to {new_wheel}"
        out.append(line)
    return out


def remap_patch(source: PatchSource, layout: WheelLayout) -> RemappedPatch:
    """Rewrite a source-layout patch to the wheel layout.

    Why rewrite the text instead of `git apply --directory/--include`: --directory prepends one
    root to every path, while one upstream patch spans several rules (flashinfer/ stays,
    csrc/ moves under flashinfer/data/); that would need one partial apply per rule, splitting a
    patch's single state and hiding exclusions. The rewritten patch is saved for review.
    """
    origin = source.entry.label
    text = source.data.decode("utf-8", errors="surrogateescape")
    preamble, sections = split_patch(text, origin)
    kept: list[str] = list(preamble)
    files: list[MappedFile] = []
    excluded: list[ExcludedFile] = []
    for section in sections:
        rules = {p: layout.rule_for(p, origin) for p in (section.old_path, section.new_path) if p is not None}
        if all(r.wheel is None for r in rules.values()):
            reason = "; ".join(sorted({f"{r.source}: {r.reason}" for r in rules.values()}))
            excluded.append(ExcludedFile(source=section.path, reason=reason))
            continue
        if any(r.wheel is None for r in rules.values()):
            raise UserError(f"{origin}: {section.path} moves between an excluded and a shipped path; split the patch")
        old_wheel = rules[section.old_path].apply(section.old_path) if section.old_path else None
        new_wheel = rules[section.new_path].apply(section.new_path) if section.new_path else None
        for wheel_path in (old_wheel, new_wheel):
            if wheel_path is not None:
                wheel_repack.check_member_path(wheel_path, f"{origin} (remapped by {layout.name})")
                if wheel_path.split("/", 1)[0].endswith(".dist-info"):
                    raise UserError(f"{origin}: {section.path} maps into {wheel_path}; patches may not edit wheel metadata, fix {layout.name}")
        kept += _rewrite_header(section.lines, old_wheel, new_wheel)
        files.append(MappedFile(source=section.path, wheel=new_wheel or old_wheel or "", old_wheel=old_wheel,
                                new_wheel=new_wheel, hunks=tuple(section.hunks)))
    remapped = "\n".join(kept)
    if not remapped.endswith("\n"):
        remapped += "\n"
    return RemappedPatch(source=source, text=remapped, files=tuple(files), excluded=tuple(excluded))


# --------------------------------------------------------------------------- git apply


@dataclass
class FileApplyReport:
    """What `git apply -v` said about one file: hunk offsets, rejected hunks, errors."""

    offsets: dict[int, int] = field(default_factory=dict)
    clean: set[int] = field(default_factory=set)
    rejected: set[int] = field(default_factory=set)
    failed_at_lines: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


_CURRENT_FILE_RES = (
    re.compile(r"^Checking patch (.+)\.\.\.$"),
    re.compile(r"^Applying patch (.+) with \d+ rejects?\.\.\.$"),
    re.compile(r"^Applied patch (.+) cleanly\.$"),
)
_OFFSET_RE = re.compile(r"^Hunk #(\d+) succeeded at (\d+)(?: \(offset (-?\d+) lines?\))?\.$")
_CLEAN_RE = re.compile(r"^Hunk #(\d+) applied cleanly\.$")
_REJECTED_RE = re.compile(r"^Rejected hunk #(\d+)\.$")
_FAILED_RE = re.compile(r"^error: patch failed: (.+):(\d+)$")
_ERROR_RE = re.compile(r"^error: (.+?): (.+)$")


def parse_git_apply_output(output: str) -> dict[str, FileApplyReport]:
    """Per-file results from `git apply -v` (LC_ALL=C) messages."""
    reports: dict[str, FileApplyReport] = {}
    current: str | None = None
    for line in output.split("\n"):
        for pattern in _CURRENT_FILE_RES:
            match = pattern.match(line)
            if match:
                current = match.group(1)
                reports.setdefault(current, FileApplyReport())
        if current is None:
            continue
        report = reports[current]
        if m := _OFFSET_RE.match(line):
            report.offsets[int(m.group(1))] = int(m.group(3) or 0)
        elif m := _CLEAN_RE.match(line):
            report.clean.add(int(m.group(1)))
        elif m := _REJECTED_RE.match(line):
            report.rejected.add(int(m.group(1)))
        elif m := _FAILED_RE.match(line):
            reports.setdefault(m.group(1), FileApplyReport()).failed_at_lines.append(int(m.group(2)))
        elif (m := _ERROR_RE.match(line)) and m.group(2) not in ("patch does not apply",) and not line.startswith("error: while searching"):
            reports.setdefault(m.group(1), FileApplyReport()).errors.append(m.group(2))
    return reports


class GitApply:
    """`git apply` run in a plain directory, isolated from any enclosing repository and user config."""

    def __init__(self, git: str) -> None:
        resolved = shutil.which(git)
        if resolved is None:
            raise UserError(f"--git {git}: not found; install git or pass its path (the gate runs git apply)")
        self.git = resolved

    def run(self, tree: Path, patch_file: Path, *args: str) -> tuple[bool, str]:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LC_ALL": "C",
            # Without a ceiling, git apply run inside some enclosing work tree would apply
            # relative to that repository and silently skip paths outside the cwd.
            "GIT_CEILING_DIRECTORIES": str(tree.resolve().parent),
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": os.devnull,
            "HOME": str(tree.resolve().parent),
        }
        proc = subprocess.run([self.git, "apply", "-p1", "--whitespace=nowarn", *args, str(patch_file.resolve())],
                              cwd=tree, env=env, capture_output=True, text=True, errors="surrogateescape")
        return proc.returncode == 0, proc.stdout + proc.stderr


# --------------------------------------------------------------------------- the gate


@dataclass
class PatchResult:
    """The one state a patch ends in, with the evidence shown in the table."""

    index: int
    patch: RemappedPatch
    state: str
    offsets: dict[str, dict[int, int]] = field(default_factory=dict)
    conflicts: list[str] = field(default_factory=list)
    note: str = ""


@dataclass
class GateInputs:
    series: Path
    target: Path
    layout: WheelLayout
    sources: list[PatchSource]
    target_pin: str | None
    git: GitApply


@dataclass
class GateResult:
    inputs: GateInputs
    target_sha256: str
    dist: wheel_repack.DistInfo | None
    results: list[PatchResult]
    changed: dict[str, tuple[str | None, str | None, list[str]]]
    untouched_verified: int
    record_files: int
    # Set when an expected manifest was given: where it is and each difference from the built one.
    expected_manifest: Path | None = None
    drift: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No patch conflicts (the series itself went through)."""
        return all(r.state != STATE_CONFLICTS for r in self.results)

    @property
    def accepted(self) -> bool:
        """No conflict and no drift: the only case in which anything is written."""
        return self.ok and not self.drift


def refuse_symlinked_paths(tree: Path, patch: RemappedPatch) -> None:
    """Refuse a patch whose path goes through (or is) a symlink in the tree: writes could escape it."""
    for mapped in patch.files:
        for wheel_path in {p for p in (mapped.old_wheel, mapped.new_wheel) if p}:
            parts = PurePosixPath(wheel_path).parts
            for depth in range(1, len(parts) + 1):
                candidate = tree.joinpath(*parts[:depth])
                if candidate.is_symlink():
                    raise UserError(f"{patch.source.entry.label}: {wheel_path} goes through the symlink {'/'.join(parts[:depth])} in the target tree; patch the real path")


def classify_patch(tree: Path, patch_file: Path, patch: RemappedPatch, git: GitApply) -> tuple[str, dict[str, dict[int, int]], list[str]]:
    """Decide `applies` / `already upstream` / `conflicts` with git apply --check both ways."""
    forward_ok, forward_out = git.run(tree, patch_file, "--check", "-v")
    reverse_ok, reverse_out = git.run(tree, patch_file, "--check", "-v", "-R")
    if forward_ok and not reverse_ok:
        return STATE_APPLIES, _offsets(forward_out), []
    if reverse_ok and not forward_ok:
        return STATE_UPSTREAM, _offsets(reverse_out), []
    if not (forward_ok or reverse_ok):
        # The parser above refuses cut patches first; this catches whatever else git cannot parse,
        # which is bad input, not a conflict with the target.
        unreadable = re.search(r"^(?:error: )?((?:corrupt patch|patch fragment without header|git diff header lacks|"
                               r"No valid patches|unrecognized input).*)$", forward_out, re.M)
        if unreadable:
            raise UserError(f"{patch.source.entry.label}: git apply cannot read the remapped patch ({unreadable.group(1)}); "
                            "regenerate the patch with `git diff`")
    if forward_ok and reverse_ok:
        return STATE_CONFLICTS, {}, ["applies both forward and in reverse: cannot tell whether it is already upstream; regenerate it with more context (-U5)"]
    return STATE_CONFLICTS, {}, diagnose_conflict(tree, patch_file, patch, git)


def _offsets(output: str) -> dict[str, dict[int, int]]:
    return {path: {h: o for h, o in report.offsets.items() if o} for path, report in parse_git_apply_output(output).items()}


def hunk_states(tree: Path, patch_file: Path, patch: RemappedPatch, git: GitApply) -> dict[str, dict[int, str]]:
    """Per hunk: 'applies', 'already present' or 'conflicts' (file-level failures as 'error: ...').

    Runs `git apply --reject` forward and in reverse on throwaway copies of the touched files,
    since --check stops at the first failing hunk of a file.
    """
    directions: dict[bool, dict[str, FileApplyReport]] = {}
    for reverse in (False, True):
        with tempfile.TemporaryDirectory(prefix="gate-diagnose-") as scratch:
            copy = Path(scratch) / "tree"
            copy.mkdir()
            for mapped in patch.files:
                for wheel_path in {p for p in (mapped.old_wheel, mapped.new_wheel) if p}:
                    src = tree / wheel_path
                    if src.is_file() and not src.is_symlink():
                        dst = copy / wheel_path
                        dst.parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(src, dst)
            _, output = git.run(copy, patch_file, "--reject", "-v", *(["-R"] if reverse else []))
            directions[reverse] = parse_git_apply_output(output)
    states: dict[str, dict[int, str]] = {}
    for mapped in patch.files:
        forward = directions[False].get(mapped.wheel, FileApplyReport())
        backward = directions[True].get(mapped.wheel, FileApplyReport())
        per_hunk: dict[int, str] = {}
        for hunk in mapped.hunks or (Hunk(0, 0, 0, "(whole file)"),):
            if hunk.number and hunk.number in forward.clean | set(forward.offsets):
                per_hunk[hunk.number] = "applies"
            elif hunk.number and hunk.number in backward.clean | set(backward.offsets):
                per_hunk[hunk.number] = "already present"
            elif forward.errors:
                per_hunk[hunk.number] = "error: " + forward.errors[0]
            else:
                per_hunk[hunk.number] = "conflicts"
        states[mapped.wheel] = per_hunk
    return states


def hunk_bodies(patch: RemappedPatch) -> dict[str, dict[int, list[str]]]:
    """The body lines of every hunk, per wheel path (for the added-line evidence of a conflict)."""
    bodies: dict[str, dict[int, list[str]]] = {}
    _, sections = split_patch(patch.text, patch.source.entry.label)
    for section in sections:
        per_hunk: dict[int, list[str]] = {}
        number = 0
        for line in section.lines[1:]:
            if _HUNK_RE.match(line):
                number += 1
                per_hunk[number] = []
            elif number:
                per_hunk[number].append(line)
        bodies[section.path] = per_hunk
    return bodies


def added_lines_evidence(target: Path, body: list[str]) -> str:
    """How much of a conflicting hunk's added code the target already has (whitespace-insensitive).

    Tells "upstream has this change with different surroundings" from "this change is missing".
    """
    added = [line[1:].strip() for line in body if line.startswith("+") and line[1:].strip()]
    removed = [line[1:].strip() for line in body if line.startswith("-") and line[1:].strip()]
    if not target.is_file():
        return "file absent"
    present = {line.strip() for line in target.read_text(encoding="utf-8", errors="surrogateescape").split("\n")}
    added_found = sum(1 for line in added if line in present)
    removed_found = sum(1 for line in removed if line in present)
    return f"{added_found}/{len(added)} added lines present, {removed_found}/{len(removed)} removed lines still present"


def _short_header(header: str, context: int = 40) -> str:
    """`@@ -a,b +c,d @@ ctx` with the function context cut, so table lines stay readable."""
    ranges, sep, rest = header.partition(" @@")
    rest = rest.strip()
    return f"{ranges}{sep} {rest[:context]}{'...' if len(rest) > context else ''}".rstrip()


def diagnose_conflict(tree: Path, patch_file: Path, patch: RemappedPatch, git: GitApply) -> list[str]:
    """Lines naming each file and hunk that keeps the patch from applying."""
    lines: list[str] = []
    states = hunk_states(tree, patch_file, patch, git)
    bodies = hunk_bodies(patch)
    for mapped in patch.files:
        per_hunk = states[mapped.wheel]
        if all(s == "applies" for s in per_hunk.values()):
            continue
        headers = {h.number: h.header for h in mapped.hunks}
        for number, state in per_hunk.items():
            if state == "applies":
                continue
            where = f"hunk #{number} {_short_header(headers.get(number, ''))}".rstrip() if number else "whole file"
            evidence = ""
            if state == "conflicts":
                evidence = f" ({added_lines_evidence(tree / mapped.wheel, bodies[mapped.wheel].get(number, []))})"
            lines.append(f"{mapped.wheel}: {where}: {state}{evidence}")
    return lines or ["git apply refused the patch but no hunk failed on its own: hunks depend on each other; check the patch"]


def _touched_paths(remapped: list[RemappedPatch]) -> set[str]:
    return {p for patch in remapped for f in patch.files for p in (f.old_wheel, f.new_wheel) if p}


def materialize_work_tree(target: Path, tree: Path, touched: set[str]) -> str:
    """The tree the series is checked and applied in; returns the wheel's sha256 ('' for a directory).

    Only the files the series names (and the dist-info) are put there: git apply reads nothing
    else, and the untouched files are verified straight from the wheel (or directory), which
    spares writing thousands of files for a check.
    """
    started = time.monotonic()
    if target.is_file():
        target_sha = wheel_repack.sha256_file(target)
        tree.mkdir()
        count = wheel_repack.unpack_wheel(target, tree, only=lambda name: name in touched or ".dist-info/" in name)
        log(f"extracted {count} of the files of {target.name} ({target.stat().st_size / 1e6:.1f} MB) in {time.monotonic() - started:.1f} s")
        return target_sha
    if target.is_dir():
        dist = wheel_repack.find_dist_info(target)
        shutil.copytree(target / dist.dirname, tree / dist.dirname, symlinks=True)
        for rel in sorted(touched):
            src = target / rel
            if src.is_file():
                (tree / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, tree / rel)
        log(f"copied the dist-info and {len(touched)} named files of {target} in {time.monotonic() - started:.1f} s")
        return ""
    raise UserError(f"--target {target}: neither a wheel file nor an unpacked wheel directory; pass the pinned wheel")


def _hash_or_none(path: Path) -> str | None:
    return wheel_repack.sha256_file(path) if path.is_file() else None


def run_gate(inputs: GateInputs, out_dir: Path | None, expected_manifest: Path | None = None) -> GateResult:
    """Check and apply the series in a scratch copy; on success move the full tree to out_dir.

    With `expected_manifest`, the built manifest is compared with it before out_dir is touched:
    on drift the previous output stays as it was (result.drift lists the differences).
    """
    expected = _read_manifest(expected_manifest) if expected_manifest else None
    remapped = [remap_patch(source, inputs.layout) for source in inputs.sources]
    touched = _touched_paths(remapped)
    if inputs.target.is_dir():
        for patch in remapped:  # a wheel cannot hold symlinks (unpack refuses them); a directory can
            refuse_symlinked_paths(inputs.target, patch)
    scratch_parent = out_dir.resolve().parent if out_dir else None
    if scratch_parent:
        scratch_parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out_dir.name if out_dir else 'gate'}.scratch-", dir=scratch_parent))
    try:
        work = scratch / "work"
        target_sha = materialize_work_tree(inputs.target, work, touched)
        dist = wheel_repack.find_dist_info(work)
        record = wheel_repack.read_record(work, dist, f"wheel {inputs.target.name}" if target_sha else f"--target {inputs.target}")
        results, before, changed_by = _apply_series(work, scratch / "patches", remapped, inputs.git)
        result = GateResult(inputs=inputs, target_sha256=target_sha, dist=dist, results=results, changed={},
                            untouched_verified=0, record_files=sum(1 for e in record.values() if e.sha256))
        if not result.ok:
            return result
        _verify_touched_before(before, record)
        for path, sha_before in sorted(before.items()):
            sha_after = _hash_or_none(work / path)
            if sha_after != sha_before:
                result.changed[path] = (sha_before, sha_after, changed_by[path])
        started = time.monotonic()
        if target_sha:
            result.untouched_verified = wheel_repack.verify_archive_untouched(inputs.target, record, set(before))
        else:
            result.untouched_verified = wheel_repack.verify_untouched(inputs.target, record, set(before))
        log(f"verified {result.untouched_verified} untouched files against RECORD in {time.monotonic() - started:.1f} s")
        if expected is not None:
            result.expected_manifest = expected_manifest
            result.drift = manifest_drift(expected, build_manifest(result))
            if result.drift:
                return result
        if out_dir is not None:
            replace_dir(_full_tree(inputs.target, work, scratch, set(before)), out_dir)
        return result
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _full_tree(target: Path, work: Path, scratch: Path, touched: set[str]) -> Path:
    """The complete patched tree: the wheel unpacked (or the directory copied), the series' files laid over it."""
    started = time.monotonic()
    full = scratch / "full"
    if target.is_file():
        full.mkdir()
        count = wheel_repack.unpack_wheel(target, full)
    else:
        shutil.copytree(target, full, symlinks=True)
        count = len(wheel_repack.list_tree_files(full))
    for rel in sorted(touched):
        patched, dest = work / rel, full / rel
        if patched.is_file():
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(patched, dest)
        else:
            dest.unlink(missing_ok=True)
            # git apply drops directories a deletion empties; do the same here.
            for parent in dest.parents:
                if parent == full or any(parent.iterdir()):
                    break
                parent.rmdir()
    log(f"wrote {count} files and laid {len(touched)} patched files over them in {time.monotonic() - started:.1f} s")
    return full


def _apply_series(tree: Path, patch_dir: Path, remapped: list[RemappedPatch], git: GitApply
                  ) -> tuple[list[PatchResult], dict[str, str | None], dict[str, list[str]]]:
    """Check patch N against the tree with 1..N-1 applied, apply it if it applies."""
    patch_dir.mkdir()
    results: list[PatchResult] = []
    before: dict[str, str | None] = {}
    changed_by: dict[str, list[str]] = {}
    for index, patch in enumerate(remapped, start=1):
        label = patch.source.entry.label
        log(f"patch {index}/{len(remapped)} {label}: {len(patch.files)} files, {len(patch.excluded)} excluded")
        if not patch.files:
            results.append(PatchResult(index, patch, STATE_EXCLUDED, note="every file excluded: nothing to apply"))
            continue
        refuse_symlinked_paths(tree, patch)
        patch_file = patch_dir / f"{index:02d}.patch"
        patch_file.write_bytes(patch.text.encode("utf-8", errors="surrogateescape"))
        state, offsets, conflicts = classify_patch(tree, patch_file, patch, git)
        if state == STATE_APPLIES:
            for mapped in patch.files:
                for wheel_path in {p for p in (mapped.old_wheel, mapped.new_wheel) if p}:
                    before.setdefault(wheel_path, _hash_or_none(tree / wheel_path))
                    changed_by.setdefault(wheel_path, []).append(label)
            applied, output = git.run(tree, patch_file)
            if not applied:
                state, conflicts = STATE_CONFLICTS, [f"git apply failed after a clean check: {output.strip()}"]
        results.append(PatchResult(index, patch, state, offsets=offsets, conflicts=conflicts))
    return results, before, changed_by


def _verify_touched_before(before: dict[str, str | None], record: dict[str, wheel_repack.RecordEntry]) -> None:
    """The files the series touches must be the pinned upstream bytes before the first patch."""
    for path, sha in sorted(before.items()):
        entry = record.get(path)
        expected = entry.sha256 if entry else None
        if sha != expected:
            what = "absent" if sha is None else ("not in RECORD" if entry is None else "differs from its RECORD sha256")
            raise UserError(f"upstream drift: {path} {what} before patching; re-fetch the pinned wheel")


# --------------------------------------------------------------------------- manifest and table


def build_manifest(result: GateResult) -> dict[str, Any]:
    inputs = result.inputs
    return {
        "schema_version": MANIFEST_SCHEMA_VERSION,
        "series": inputs.series.name,
        "layout": {"file": inputs.layout.name, "sha256": inputs.layout.sha256},
        "target": {
            "pin": inputs.target_pin,
            "sha256": result.target_sha256 or None,
            "dist": result.dist.name if result.dist else None,
            "version": result.dist.version if result.dist else None,
        },
        "patches": [
            {
                "entry": r.patch.source.entry.label,
                "sha256": r.patch.source.sha256,
                "state": r.state,
                "files": [
                    {"source": f.source, "wheel": f.wheel, "hunks": len(f.hunks),
                     "offsets": [{"hunk": h, "lines": o} for h, o in sorted(r.offsets.get(f.wheel, {}).items())]}
                    for f in r.patch.files
                ],
                "excluded": [{"source": e.source, "why": e.reason} for e in r.patch.excluded],
            }
            for r in result.results
        ],
        "changed_files": [
            {"path": path, "sha256_before": b, "sha256_after": a, "changed_by": by}
            for path, (b, a, by) in sorted(result.changed.items())
        ],
        "untouched_files_verified": result.untouched_verified,
        "record_files_with_hash": result.record_files,
    }


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    """Manifest as `key.path -> scalar`, lists keyed by their identifying field so diffs name things."""
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}" if prefix else key, out)
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        for position, item in enumerate(value):
            ident = next((item[k] for k in ("path", "entry", "wheel", "source", "hunk") if k in item), position)
            _flatten(item, f"{prefix}[{ident}]", out)
    else:
        out[prefix] = value


def manifest_drift(expected: dict[str, Any], built: dict[str, Any]) -> list[str]:
    """One line per difference, naming the file / patch / field that drifted."""
    flat_expected: dict[str, Any] = {}
    flat_built: dict[str, Any] = {}
    _flatten(expected, "", flat_expected)
    _flatten(built, "", flat_built)
    lines = []
    for key in sorted(set(flat_expected) | set(flat_built)):
        if key not in flat_built:
            lines.append(f"{key}: expected {flat_expected[key]!r}, not in the built manifest")
        elif key not in flat_expected:
            lines.append(f"{key}: built {flat_built[key]!r}, not in the expected manifest")
        elif flat_expected[key] != flat_built[key]:
            lines.append(f"{key}: expected {flat_expected[key]!r}, built {flat_built[key]!r}")
    return lines


def _format_offsets(offsets: dict[int, int]) -> str:
    return ", ".join(f"#{h} {o:+d}" for h, o in sorted(offsets.items())) or "none"


def render_table(result: GateResult) -> str:
    """The gate's verdict, readable at a glance: one row per file of each patch."""
    inputs = result.inputs
    header = ("#", "patch", "state", "file (wheel path)", "hunks", "offsets")
    rows: list[tuple[str, ...]] = []
    details: list[str] = []
    for r in result.results:
        label = r.patch.source.entry.label
        first = True
        for f in r.patch.files:
            rows.append((str(r.index) if first else "", label if first else "", r.state if first else "",
                         f.wheel, str(len(f.hunks)), _format_offsets(r.offsets.get(f.wheel, {}))
                         if r.state != STATE_CONFLICTS else "-"))
            first = False
        for e in r.patch.excluded:
            rows.append((str(r.index) if first else "", label if first else "", r.state if first else "",
                         f"excluded: {e.source}", "-", "-"))
            first = False
        if first:
            rows.append((str(r.index), label, r.state, r.note or "(no files)", "-", "-"))
        details += [f"  {r.index} {label}: {line}" for line in r.conflicts]
        details += [f"  {r.index} {label}: excluded {e.source} ({e.reason})" for e in r.patch.excluded]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    fmt = lambda row: "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip()  # noqa: E731
    sha = result.target_sha256[:12] if result.target_sha256 else "(directory)"
    lines = [f"patch gate: {inputs.target.name} (sha256 {sha}), series {inputs.series.name} ({len(result.results)} patch{'' if len(result.results) == 1 else 'es'}), layout {inputs.layout.name}",
             fmt(header), fmt(tuple("-" * w for w in widths)), *map(fmt, rows)]
    conflicts = [d for d in details if ": excluded " not in d]
    if conflicts:
        lines += ["conflicts (file: hunk: state):", *conflicts]
    excluded = [d for d in details if ": excluded " in d]
    if excluded:
        lines += ["excluded (not in the wheel):", *excluded]
    if result.accepted:
        lines.append(f"result: series applied; {len(result.changed)} files changed, "
                     f"{result.untouched_verified} untouched files verified against RECORD")
    elif result.ok:
        lines.append(f"result: REFUSED; nothing was written (the built manifest differs from "
                     f"{result.expected_manifest} in {len(result.drift)} places, listed on stderr)")
    else:
        lines.append("result: REFUSED; nothing was written (conflicting patches above; later patches were "
                     "checked against a tree without them)")
    lines.append("offsets: lines a hunk moved from its header's line; fuzz: none (git apply requires every context line)")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- CLI


def _add_gate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--series", type=Path, required=True, help="series file (default.series / pypi.series)")
    parser.add_argument("--target", type=Path, required=True, help="the pinned wheel, or an unpacked wheel directory")
    parser.add_argument("--layout", type=Path, required=True, help="wheel_layout.json mapping source paths to wheel paths")
    parser.add_argument("--pin-file", action="append", default=[], metavar="NAME=PATH", help="file for each pin: entry")
    parser.add_argument("--lock", type=Path, help="pins.lock.json: verify --pin-file and --target-pin sha256 against it")
    parser.add_argument("--target-pin", help="lock pin name of the target (recorded in the manifest)")
    parser.add_argument("--table", type=Path, help="also write the table here")
    parser.add_argument("--git", default="git", help="git executable (default: git on PATH)")


def _gate_inputs(args: argparse.Namespace) -> GateInputs:
    lock = load_lock(args.lock) if args.lock else None
    if lock is not None and args.target_pin and args.target.is_file():
        verify_pin_sha256(lock, args.target_pin, wheel_repack.sha256_file(args.target), f"--target {args.target}")
    entries = read_series(args.series)
    sources = resolve_series(args.series, entries, parse_pin_files(args.pin_file), lock)
    return GateInputs(series=args.series, target=args.target, layout=WheelLayout.load(args.layout), sources=sources,
                      target_pin=args.target_pin, git=GitApply(args.git))


def _report(result: GateResult, table_path: Path | None) -> None:
    table = render_table(result)
    sys.stdout.write(table)
    sys.stdout.flush()
    if table_path is not None and result.accepted:
        write_atomic(table_path, table.encode("utf-8"))


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"--expected-manifest {path}: unreadable ({e}); {fix_command(path)} creates it") from e
    if not isinstance(doc, dict) or doc.get("schema_version") != MANIFEST_SCHEMA_VERSION:
        raise UserError(f"{path}: not a schema_version {MANIFEST_SCHEMA_VERSION} patch gate manifest; {fix_command(path)} rewrites it")
    return doc


def fix_command(expected_path: Path) -> str:
    """The command that rewrites an expected manifest: the Bazel target for the committed ones."""
    stack = expected_path.name.removesuffix(".manifest.json")
    package = expected_path.parent.name
    if expected_path.name.endswith(".manifest.json") and package in ("flashinfer_patches", "sglang_patches"):
        config = "" if stack == "default" else f" --config={stack}"
        return f"`tools/bazel run //{package}:update_manifest{config}`"
    return (f"`python3 -m tools.patch_gate update-manifest <the same --series/--target/--layout/--pin-file/--lock/"
            f"--target-pin> --expected-manifest {expected_path}`")


def print_drift(expected_path: Path, drift: list[str]) -> None:
    """The drift report: the manifest, every differing field (file paths named), and the fix."""
    print(f"manifest drift against {expected_path} ({len(drift)} differences):", file=sys.stderr)
    for line in drift:
        print(f"  {line}", file=sys.stderr)
    print(f"fix the inputs, or if the change is intended run {fix_command(expected_path)} and review the diff of "
          f"{expected_path}", file=sys.stderr)


def cmd_apply(args: argparse.Namespace) -> int:
    inputs = _gate_inputs(args)
    result = run_gate(inputs, None if args.check_only else args.out_dir, args.expected_manifest)
    _report(result, args.table)
    if result.drift:
        print_drift(args.expected_manifest, result.drift)
    if not result.accepted:
        return EXIT_REFUSED
    if args.manifest:
        write_atomic(args.manifest, canonical_json(build_manifest(result)))
    if args.remapped_dir:
        write_remapped(args.remapped_dir, [r.patch for r in result.results])
    return 0


def cmd_check_manifest(args: argparse.Namespace) -> int:
    """Compare a built manifest with the expected one (the Bazel validation of the gate's tree)."""
    try:
        built = json.loads(args.built.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"--built {args.built}: unreadable ({e}); pass the gate's manifest.json") from e
    drift = manifest_drift(_read_manifest(args.expected_manifest), built)
    if drift:
        print_drift(args.expected_manifest, drift)
        return EXIT_REFUSED
    if args.stamp:
        write_atomic(args.stamp, f"{args.expected_manifest}: no drift\n".encode("utf-8"))
    return 0


def cmd_install_manifest(args: argparse.Namespace) -> int:
    """Write a built manifest over the committed expected one (`bazel run //...:update_manifest`)."""
    try:
        data = args.built.read_bytes()
        built = json.loads(data)
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"--built {args.built}: unreadable ({e}); pass the gate's manifest.json") from e
    if not isinstance(built, dict) or built.get("schema_version") != MANIFEST_SCHEMA_VERSION or "patches" not in built:
        raise UserError(f"--built {args.built}: not a patch gate manifest; pass the gate's manifest.json")
    target = _workspace_path(args.expected_manifest)
    try:
        old = json.loads(target.read_text(encoding="utf-8")) if target.is_file() else None
    except (OSError, json.JSONDecodeError):
        old = None  # an unreadable manifest is what this command repairs
    write_atomic(target, canonical_json(built))
    if isinstance(old, dict):
        changes = manifest_drift(old, built)
        log(f"wrote {target}: {len(changes)} fields changed; review `git diff {args.expected_manifest}`")
        for line in changes:
            log(f"  {line}")
    else:
        log(f"wrote {target} (new); review it before committing")
    return 0


def _workspace_path(path: Path) -> Path:
    """A relative path is the workspace's under `bazel run` (which runs in the runfiles tree)."""
    workspace = os.environ.get("BUILD_WORKSPACE_DIRECTORY")
    return Path(workspace) / path if workspace and not path.is_absolute() else path


def cmd_update_manifest(args: argparse.Namespace) -> int:
    inputs = _gate_inputs(args)
    result = run_gate(inputs, None)
    _report(result, args.table)
    if not result.ok:
        return EXIT_REFUSED
    target = _workspace_path(args.expected_manifest)
    write_atomic(target, canonical_json(build_manifest(result)))
    log(f"wrote {target}")
    return 0


def write_remapped(out: Path, patches: list[RemappedPatch]) -> None:
    """The remapped patches (what git apply saw), one file per series entry, for review."""
    out.resolve().parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.resolve().parent))
    tmp.chmod(0o755)  # mkdtemp creates 0700
    try:
        for index, patch in enumerate(patches, start=1):
            name = re.sub(r"[^A-Za-z0-9._-]+", "-", patch.source.entry.label)
            (tmp / f"{index:02d}-{name}.wheel.patch").write_bytes(patch.text.encode("utf-8", errors="surrogateescape"))
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def cmd_remap(args: argparse.Namespace) -> int:
    lock = load_lock(args.lock) if args.lock else None
    sources = resolve_series(args.series, read_series(args.series), parse_pin_files(args.pin_file), lock)
    layout = WheelLayout.load(args.layout)
    patches = [remap_patch(s, layout) for s in sources]
    write_remapped(args.out_dir, patches)
    for p in patches:
        print(f"{p.source.entry.label}: {len(p.files)} files remapped, {len(p.excluded)} excluded")
        for f in p.files:
            print(f"  {f.source} -> {f.wheel}")
        for e in p.excluded:
            print(f"  {e.source} excluded ({e.reason})")
    return 0


def cmd_repack(args: argparse.Namespace) -> int:
    wheel = wheel_repack.repack_wheel(args.tree, args.out_dir, args.local_label, args.modes_from)
    if args.wheel_name_out:
        write_atomic(args.wheel_name_out, (wheel.name + "\n").encode("utf-8"))
    print(wheel)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="patch_gate.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    apply = sub.add_parser("apply", help="check and apply a series to a wheel tree atomically")
    _add_gate_args(apply)
    apply.add_argument("--out-dir", type=Path, required=True, help="patched tree (replaced in one rename)")
    apply.add_argument("--manifest", type=Path, help="write the manifest of changed files here")
    apply.add_argument("--remapped-dir", type=Path, help="write the wheel-layout patches here for review")
    apply.add_argument("--expected-manifest", type=Path, help="also fail (exit 1) on drift against this manifest")
    apply.set_defaults(func=cmd_apply, check_only=False)

    check = sub.add_parser("check", help="run the gate without writing a tree (only the touched files are extracted); with --expected-manifest, fail on drift")
    _add_gate_args(check)
    check.add_argument("--expected-manifest", type=Path, help="fail (exit 1) naming every drift against this manifest")
    check.add_argument("--manifest", type=Path, help="write the built manifest here")
    check.set_defaults(func=cmd_apply, check_only=True, out_dir=None, remapped_dir=None)

    update = sub.add_parser("update-manifest", help="regenerate the expected manifest (review its diff before committing)")
    _add_gate_args(update)
    update.add_argument("--expected-manifest", type=Path, required=True, help="path to (re)write; relative to the workspace under `bazel run`")
    update.set_defaults(func=cmd_update_manifest)

    check_manifest = sub.add_parser("check-manifest", help="fail (exit 1) naming every drift of a built manifest against the expected one")
    check_manifest.add_argument("--built", type=Path, required=True, help="the manifest.json the gate wrote")
    check_manifest.add_argument("--expected-manifest", type=Path, required=True, help="the committed <stack>.manifest.json")
    check_manifest.add_argument("--stamp", type=Path, help="on success write a one-line stamp here (a Bazel validation output)")
    check_manifest.set_defaults(func=cmd_check_manifest)

    install = sub.add_parser("install-manifest", help="write a built manifest over the expected one, atomically (review its diff)")
    install.add_argument("--built", type=Path, required=True, help="the manifest.json the gate wrote")
    install.add_argument("--expected-manifest", type=Path, required=True, help="path to (re)write; relative to the workspace under `bazel run`")
    install.set_defaults(func=cmd_install_manifest)

    remap = sub.add_parser("remap", help="write the wheel-layout patches of a series for review (no target needed)")
    remap.add_argument("--series", type=Path, required=True)
    remap.add_argument("--layout", type=Path, required=True)
    remap.add_argument("--pin-file", action="append", default=[], metavar="NAME=PATH")
    remap.add_argument("--lock", type=Path)
    remap.add_argument("--out-dir", type=Path, required=True)
    remap.set_defaults(func=cmd_remap)

    repack = sub.add_parser("repack-wheel", help="zip a patched tree as <name>-<version>+kimik3.<digest> deterministically")
    repack.add_argument("--tree", type=Path, required=True, help="patched tree from `apply --out-dir`")
    repack.add_argument("--out-dir", type=Path, required=True, help="directory that receives the one wheel")
    repack.add_argument("--local-label", default=wheel_repack.PATCHED_LOCAL_LABEL)
    repack.add_argument("--modes-from", type=Path,
                        help="the upstream wheel: file modes (exec bits) are taken from it, not from disk")
    repack.add_argument("--wheel-name-out", type=Path, help="also write the wheel's file name here")
    repack.set_defaults(func=cmd_repack)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(run_cli(main))
