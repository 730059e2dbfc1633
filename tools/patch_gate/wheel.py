"""Wheel trees for the patch gate: safe unpack, RECORD verification, deterministic repack.

A library module (the CLI lives in `tools/patch_gate`, subcommand `repack-wheel`).

Why hand-written and not the `installer` library: installer *installs* a wheel (scheme paths,
entry-point scripts, RECORD rewritten for the install); the gate needs the archive's own tree
byte for byte, checked against the archive's own RECORD, and the repack needs a deterministic
zip, which no well-kept packaging library writes (wheel/build embed current times).
"""
from __future__ import annotations

import base64
import binascii
import csv
import hashlib
import io
import os
import re
import stat
import time
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable

from tools.common.errors import UserError
from tools.common.files import temp_sibling
from tools.common.hashing import sha256_file

# Zip timestamps cannot predate 1980-01-01 00:00:00 UTC.
ZIP_EPOCH_MIN = 315532800
# The local version label that marks a wheel patched by this project.
PATCHED_LOCAL_LABEL = "kimik3"
_HASH_CHUNK = 1 << 20


@dataclass(frozen=True)
class RecordEntry:
    """One RECORD row: the file's sha256 (hex) and size, or None for RECORD itself/signatures."""

    sha256: str | None
    size: int | None


@dataclass(frozen=True)
class DistInfo:
    """The `.dist-info` directory of a wheel tree and the distribution it names."""

    dirname: str
    name: str
    version: str


def check_member_path(name: str, origin: str) -> PurePosixPath:
    """Refuse archive/patch member paths that could land outside the tree or inside git metadata."""
    if not name or name.startswith("/") or "\\" in name or re.match(r"^[A-Za-z]:", name):
        raise UserError(f"{origin}: path {name!r} is absolute or not POSIX; rebuild it with relative paths")
    # Split by hand: PurePosixPath would silently drop '.' and empty components.
    for part in name.split("/"):
        if part in ("..", ".", "") or part == ".git":
            raise UserError(f"{origin}: path {name!r} contains {part!r}; rebuild it with plain relative paths")
    return PurePosixPath(name)


def wheel_members(archive: zipfile.ZipFile, origin: str) -> dict[str, zipfile.ZipInfo]:
    """The file members of a wheel by path, refusing unsafe or duplicate members.

    zipfile.extractall sanitises '..' silently instead of refusing, and drops modes; the gate
    must refuse (a wheel with such members is not the pinned upstream) and keep exec bits.
    """
    members: dict[str, zipfile.ZipInfo] = {}
    seen: set[str] = set()
    for info in archive.infolist():
        mode = info.external_attr >> 16
        name = info.filename[:-1] if info.filename.endswith("/") else info.filename
        check_member_path(name, origin)
        if stat.S_ISLNK(mode):
            raise UserError(f"{origin}: member {info.filename} is a symlink; wheels carry no symlinks, re-fetch the pinned wheel")
        if name in seen:
            raise UserError(f"{origin}: member {name} appears twice; re-fetch the pinned wheel")
        seen.add(name)
        if not info.is_dir():
            members[name] = info
    return members


def open_wheel(wheel: Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise UserError(f"wheel {wheel}: cannot open as zip ({e}); pass the pinned .whl file") from e


# What zipfile raises for a damaged member: bad CRC-32 / truncated data (BadZipFile, EOFError),
# corrupt deflate stream (zlib.error), unknown compression or encryption (NotImplementedError,
# RuntimeError), a bad local header (BadZipFile, ValueError).
_MEMBER_ERRORS = (zipfile.BadZipFile, EOFError, zlib.error, NotImplementedError, RuntimeError, ValueError)


def read_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, wheel: Path, sink: Callable[[bytes], object]) -> None:
    """Stream one member's bytes into `sink`; a damaged member is a one-line error naming it."""
    try:
        with archive.open(info) as member:
            for chunk in iter(lambda: member.read(_HASH_CHUNK), b""):
                sink(chunk)
    except _MEMBER_ERRORS as e:
        raise UserError(f"wheel {wheel.name}: member {info.filename} is damaged ({e}); re-fetch the pinned wheel") from e


def unpack_wheel(wheel: Path, dest: Path, only: Callable[[str], bool] | None = None) -> int:
    """Extract a wheel's files (all, or those `only` accepts) into a directory; returns the count."""
    count = 0
    with open_wheel(wheel) as archive:
        for name, info in wheel_members(archive, f"wheel {wheel.name}").items():
            if only is not None and not only(name):
                continue
            target = dest.joinpath(*name.split("/"))
            target.parent.mkdir(parents=True, exist_ok=True)
            with target.open("wb") as out:
                read_member(archive, info, wheel, out.write)
            target.chmod(0o755 if (info.external_attr >> 16) & 0o111 else 0o644)
            count += 1
    return count


def find_dist_info(tree: Path) -> DistInfo:
    """The single top-level `*.dist-info` of a wheel tree, with Name/Version from its METADATA."""
    candidates = sorted(p.name for p in tree.iterdir() if p.is_dir() and p.name.endswith(".dist-info"))
    if len(candidates) != 1:
        raise UserError(f"wheel tree {tree}: expected exactly one *.dist-info directory, found {candidates}; pass an unpacked wheel")
    dirname = candidates[0]
    name, version = read_metadata_name_version(tree / dirname / "METADATA")
    return DistInfo(dirname=dirname, name=name, version=version)


def read_metadata_name_version(metadata: Path) -> tuple[str, str]:
    """Name and Version headers of a core-metadata file (the header block ends at the first blank line)."""
    if not metadata.is_file():
        raise UserError(f"{metadata}: missing; the tree is not an unpacked wheel")
    fields: dict[str, str] = {}
    for line in metadata.read_text(encoding="utf-8", errors="surrogateescape").split("\n"):
        if not line.strip():
            break
        key, sep, value = line.partition(":")
        if sep and key in ("Name", "Version") and key not in fields:
            fields[key] = value.strip()
    if "Name" not in fields or "Version" not in fields:
        raise UserError(f"{metadata}: no Name/Version header; the tree is not an unpacked wheel")
    return fields["Name"], fields["Version"]


def _record_digest_to_hex(digest: str, origin: str) -> str:
    algo, sep, b64 = digest.partition("=")
    if not sep or algo != "sha256":
        raise UserError(f"{origin}: hash {digest!r} is not sha256; only sha256 RECORDs are verifiable")
    try:
        raw = base64.b64decode(b64 + "=" * (-len(b64) % 4), altchars=b"-_", validate=True)
    except (binascii.Error, ValueError) as e:
        raise UserError(f"{origin}: hash {digest!r} is not urlsafe base64 ({e}); re-fetch the pinned wheel") from e
    if len(raw) != hashlib.sha256().digest_size:
        raise UserError(f"{origin}: hash {digest!r} is {len(raw)} bytes, not a sha256; re-fetch the pinned wheel")
    return raw.hex()


def read_record(tree: Path, dist: DistInfo, origin: str | None = None) -> dict[str, RecordEntry]:
    """RECORD of a wheel tree as path -> entry (csv: paths may be quoted).

    `origin` names the input in errors (e.g. `wheel X.whl`) when the tree is a scratch copy.
    """
    record_path = tree / dist.dirname / "RECORD"
    where = f"{origin}: {dist.dirname}/RECORD" if origin else str(record_path)
    if not record_path.is_file():
        raise UserError(f"{where}: missing; the wheel has no RECORD to verify against")
    entries: dict[str, RecordEntry] = {}
    try:
        with record_path.open(newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))
    except (UnicodeDecodeError, csv.Error) as e:
        raise UserError(f"{where}: unreadable ({e}); re-fetch the pinned wheel") from e
    for number, row in enumerate(rows, start=1):
        if not row:
            continue
        if len(row) != 3:
            raise UserError(f"{where}: malformed row {number} {row!r}; re-fetch the pinned wheel")
        path, digest, size = row
        member = f"{where} row {number} ({path})"
        sha = _record_digest_to_hex(digest, member) if digest else None
        if size and not (size.isascii() and size.isdigit()):
            raise UserError(f"{member}: size {size!r} is not a number; re-fetch the pinned wheel")
        entries[path] = RecordEntry(sha256=sha, size=int(size) if size else None)
    return entries


def list_tree_files(tree: Path) -> dict[str, Path]:
    """Every non-directory entry of a tree as posix relpath -> path (symlinks included, not followed)."""
    files: dict[str, Path] = {}
    for root, dirs, names in os.walk(tree):
        root_path = Path(root)
        # os.walk lists symlinked directories in `dirs` without descending (followlinks=False);
        # report them as entries so verification sees them.
        for name in names + [d for d in dirs if (root_path / d).is_symlink()]:
            full = root_path / name
            files[full.relative_to(tree).as_posix()] = full
    return files


def verify_untouched(tree: Path, record: dict[str, RecordEntry], touched: set[str]) -> int:
    """Check every file of a tree the series did not touch against RECORD; returns the count verified.

    Refuses (naming the file) on a content mismatch, a symlink, a file RECORD does not list,
    or a RECORD file missing from the tree.
    """
    actual: dict[str, str | None] = {}
    for rel, full in list_tree_files(tree).items():
        if rel not in touched:
            actual[rel] = None if full.is_symlink() else sha256_file(full)
    return compare_with_record(actual, record, touched)


def verify_archive_untouched(wheel: Path, record: dict[str, RecordEntry], touched: set[str]) -> int:
    """Like verify_untouched, hashing the wheel's members as stored (no extraction needed)."""
    actual: dict[str, str | None] = {}
    with open_wheel(wheel) as archive:
        for name, info in wheel_members(archive, f"wheel {wheel.name}").items():
            if name in touched:
                continue
            digest = hashlib.sha256()
            read_member(archive, info, wheel, digest.update)
            actual[name] = digest.hexdigest()
    return compare_with_record(actual, record, touched)


def compare_with_record(actual: dict[str, str | None], record: dict[str, RecordEntry], touched: set[str]) -> int:
    """`actual` maps every untouched path to its sha256 (None: a symlink); refuse on any drift."""
    verified = 0
    problems: list[str] = []
    for rel, sha in sorted(actual.items()):
        entry = record.get(rel)
        if sha is None:
            problems.append(f"{rel} is a symlink")
        elif entry is None:
            problems.append(f"{rel} is not listed in RECORD")
        elif entry.sha256 is None:
            continue  # RECORD itself (and signatures) carry no hash
        elif sha != entry.sha256:
            problems.append(f"{rel} differs from its RECORD sha256")
        else:
            verified += 1
    missing = sorted(set(record) - set(actual) - touched)
    problems += [f"{rel} is listed in RECORD but missing" for rel in missing]
    if problems:
        more = f" (and {len(problems) - 1} more: {'; '.join(problems[1:4])})" if len(problems) > 1 else ""
        raise UserError(f"upstream drift: {problems[0]}{more}; re-fetch the pinned wheel or fix the series")
    return verified


ExecBits = Callable[[str, Path], bool]


def exec_bits(modes_from: Path | None) -> ExecBits:
    """Which files are executable: as in the upstream wheel `modes_from` (files the patches
    added: not executable), else as on disk. Build systems (Bazel) mark every output file
    executable, so the disk is only trusted when there is no upstream wheel to ask."""
    if modes_from is None:
        return lambda rel, full: bool(full.stat().st_mode & 0o111)
    with zipfile.ZipFile(modes_from) as zf:
        executable = {i.filename for i in zf.infolist() if (i.external_attr >> 16) & 0o111}
    return lambda rel, full: rel in executable


def content_digest(tree: Path, dist: DistInfo, is_exec: ExecBits | None = None) -> str:
    """sha256 over every file outside the dist-info (path, exec bit, content): names the patched content."""
    is_exec = is_exec or exec_bits(None)
    digest = hashlib.sha256()
    for rel, full in sorted(list_tree_files(tree).items()):
        if rel.split("/", 1)[0] == dist.dirname:
            continue
        executable = "x" if is_exec(rel, full) else "-"
        digest.update(f"{rel}\0{executable}\0{sha256_file(full)}\n".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


def _dist_info_dirname(name: str, version: str) -> str:
    # Binary distribution format: name normalised to lowercase with runs of -_. as "_".
    return f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}.dist-info"


def _with_version(metadata: bytes, version: str) -> bytes:
    """METADATA with its Version header (in the header block only) replaced."""
    lines = metadata.split(b"\n")
    for i, line in enumerate(lines):
        if not line.strip():
            break
        if line.startswith(b"Version:"):
            lines[i] = b"Version: " + version.encode("ascii")
            return b"\n".join(lines)
    raise UserError("METADATA has no Version header; the tree is not an unpacked wheel")


def _record_line(rel: str, data: bytes) -> list[str]:
    b64 = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode("ascii")
    return [rel, f"sha256={b64}", str(len(data))]


def _zip_date_time() -> tuple[int, int, int, int, int, int]:
    epoch_text = os.environ.get("SOURCE_DATE_EPOCH", str(ZIP_EPOCH_MIN))
    if not epoch_text.isdigit():
        raise UserError(f"SOURCE_DATE_EPOCH={epoch_text!r} is not a non-negative integer; set it to seconds since 1970")
    t = time.gmtime(max(int(epoch_text), ZIP_EPOCH_MIN))
    # Zip stores 2-second resolution; round down so the value round-trips.
    return (t.tm_year, t.tm_mon, t.tm_mday, t.tm_hour, t.tm_min, t.tm_sec - t.tm_sec % 2)


def repack_wheel(tree: Path, out_dir: Path, local_label: str = PATCHED_LOCAL_LABEL,
                 modes_from: Path | None = None) -> Path:
    """Zip a patched wheel tree as `<name>-<version>+<label>.<8 hex>-<tags>.whl` in out_dir.

    Deterministic: entries sorted (dist-info last, RECORD very last, as the wheel spec
    recommends), timestamps from SOURCE_DATE_EPOCH (or 1980), modes 0644/0755, deflate level 6,
    no directory entries; exec bits from the upstream wheel `modes_from` when given (see
    exec_bits). Returns the wheel path.
    """
    if not tree.is_dir():
        raise UserError(f"--tree {tree}: not a directory; pass the patched tree written by `python3 -m tools.patch_gate apply --out-dir`")
    dist = find_dist_info(tree)
    if "+" in dist.version:
        raise UserError(f"wheel tree {tree}: version {dist.version} already has a local label; repack the unpatched-version tree")
    if not re.fullmatch(r"[a-z][a-z0-9]*", local_label):
        raise UserError(f"--local-label {local_label!r}: use lowercase letters and digits, e.g. kimik3")
    wheel_meta = (tree / dist.dirname / "WHEEL").read_text(encoding="utf-8")
    tags = sorted(line.split(":", 1)[1].strip() for line in wheel_meta.splitlines() if line.startswith("Tag:"))
    if not tags:
        raise UserError(f"{tree / dist.dirname / 'WHEEL'}: no Tag line; the tree is not an unpacked wheel")
    is_exec = exec_bits(modes_from)
    new_version = f"{dist.version}+{local_label}.{content_digest(tree, dist, is_exec)[:8]}"
    new_dirname = _dist_info_dirname(dist.name, new_version)
    tag_text = _compressed_tags(tags)
    wheel_name = f"{re.sub(r'[-_.]+', '_', dist.name).lower()}-{new_version}-{tag_text}.whl"

    members = _repacked_members(tree, dist, new_dirname, new_version, is_exec)
    date_time = _zip_date_time()
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp_name = temp_sibling(out_dir / wheel_name)
    try:
        with open(tmp_name, "wb") as raw, zipfile.ZipFile(raw, "w") as zf:
            for rel, data, executable in members:
                info = zipfile.ZipInfo(rel, date_time=date_time)
                info.create_system = 3  # unix, so external_attr modes are honoured
                info.external_attr = ((0o100755 if executable else 0o100644) & 0xFFFF) << 16
                zf.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=6)
        final = out_dir / wheel_name
        os.replace(tmp_name, final)
    except BaseException:
        tmp_name.unlink(missing_ok=True)
        raise
    return final


def _compressed_tags(tags: list[str]) -> str:
    """WHEEL Tag lines back to the filename's compressed tag set (py3-none-any, cp311-cp311-...)."""
    pythons, abis, platforms = (sorted({t.split("-")[i] for t in tags}) for i in range(3))
    return f"{'.'.join(pythons)}-{'.'.join(abis)}-{'.'.join(platforms)}"


def _repacked_members(tree: Path, dist: DistInfo, new_dirname: str, new_version: str,
                      is_exec: ExecBits) -> list[tuple[str, bytes, bool]]:
    """(archive path, bytes, executable) in archive order, with METADATA and RECORD rewritten."""
    body: list[tuple[str, bytes, bool]] = []
    meta: list[tuple[str, bytes, bool]] = []
    for rel, full in sorted(list_tree_files(tree).items()):
        if full.is_symlink():
            raise UserError(f"wheel tree {tree}: {rel} is a symlink; wheels carry no symlinks")
        top, _, rest = rel.partition("/")
        executable = is_exec(rel, full)
        if top != dist.dirname:
            body.append((rel, full.read_bytes(), executable))
            continue
        # RECORD is regenerated; signatures over the old RECORD would be invalid, so they go.
        if rest in ("RECORD", "RECORD.jws", "RECORD.p7s"):
            continue
        data = full.read_bytes()
        if rest == "METADATA":
            data = _with_version(data, new_version)
        meta.append((f"{new_dirname}/{rest}", data, executable))
    members = body + meta
    record_rel = f"{new_dirname}/RECORD"
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for rel, data, _ in members:
        writer.writerow(_record_line(rel, data))
    writer.writerow([record_rel, "", ""])
    members.append((record_rel, buf.getvalue().encode("utf-8"), False))
    return members
