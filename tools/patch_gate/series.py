"""Series files: which patches, in which order, and the bytes each entry resolves to.

A series line is `pin:<lock pin name>` (a fetched file, its sha256 checked against the lock) or
`file:<patch next to the series>`; `#` starts a comment.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from tools.common.cliargs import named_paths
from tools.common.errors import UserError
from tools.common.hashing import sha256_bytes
from tools.patch_gate.wheel import check_member_path
from tools.pins import lock as pins_lock


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
    try:
        content = path.read_bytes().decode("utf-8-sig")  # -sig: a leading BOM is not part of line 1
    except OSError as e:
        raise UserError(f"--series {path}: unreadable ({e.strerror}); pass a readable series file") from None
    except UnicodeDecodeError as e:
        line = e.object[: e.start].count(b"\n") + 1
        raise UserError(f"--series {path}:{line}: byte {e.object[e.start]:#04x} is not UTF-8; save the file as UTF-8") from None
    entries: list[SeriesEntry] = []
    for number, raw in enumerate(content.split("\n"), start=1):
        text = raw.split("#", 1)[0].strip()
        if not text:
            continue
        kind, sep, ref = text.partition(":")
        if not sep or kind not in ("pin", "file") or not ref.strip() or re.search(r"[\s\x00-\x1f\x7f]", ref.strip()):
            raise UserError(f"{path}:{number}: {text!r} is not `pin:<lock pin name>` or `file:<patch path>`; fix the line")
        entries.append(SeriesEntry(kind=kind, ref=ref.strip(), line=number))
    labels = [e.label for e in entries]
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        raise UserError(f"{path}: {duplicates[0]} is listed twice; a patch can be applied only once")
    return entries


def parse_pin_files(values: Sequence[str]) -> dict[str, Path]:
    """`--pin-file NAME=PATH` arguments as a dict."""
    return named_paths(values, "--pin-file", what="pin", example="flashinfer-pr4460=/path/to/the.diff")


def load_lock(path: Path) -> pins_lock.Lock:
    """The lock, validated by its own loader (a malformed lock is refused here, not half used)."""
    return pins_lock.load(path)


def verify_pin_sha256(lock: pins_lock.Lock, name: str, data_sha256: str, origin: str) -> None:
    """Refuse a file whose sha256 is not the lock's for that pin (the fetch stage should have caught it)."""
    pin = lock.pins.get(name)
    if pin is None:
        raise UserError(f"{origin}: pin {name!r} is not in the lock; add it to third_party/pins.lock.json or fix the name")
    # A git_tree pin has no file sha256: no fetched file can match it.
    pinned = getattr(pin, "sha256", None)
    if pinned != data_sha256:
        raise UserError(f"{origin}: sha256 {data_sha256} is not the lock's {pinned} for pin {name}; re-fetch it")


def resolve_series(series: Path, entries: list[SeriesEntry], pin_files: dict[str, Path], lock: pins_lock.Lock | None) -> list[PatchSource]:
    """Read the patch bytes of every entry (pins from --pin-file, files next to the series)."""
    sources: list[PatchSource] = []
    for entry in entries:
        if entry.kind == "pin":
            if entry.ref not in pin_files:
                raise UserError(f"{series}:{entry.line}: {entry.label} has no --pin-file {entry.ref}=PATH; pass the fetched file")
            path = pin_files[entry.ref]
        else:
            rel = check_member_path(entry.ref, f"{series}:{entry.line}")
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
