"""The layer tar itself: entries in a fixed order and form, compressed and hashed as one stream,
written atomically; its descriptor.

Why a hand-written writer: GNU tar, skopeo, buildah and umoci all take entry order, owners,
mtimes, modes or the compressor's header from the host or their own version, so none of them
can promise byte-identical layers. Here every one of those is fixed:
- entries sorted by path, every parent directory present before its children;
- mtime = SOURCE_DATE_EPOCH, uid/gid 0 with empty user/group names (imported base tars keep
  their numeric owners and permission bits, which the OS needs, e.g. /tmp 1777);
- modes normalized: directories 0755, files 0755 if any execute bit else 0644, symlinks 0777;
- tar headers from Python's tarfile in PAX format with int mtimes (no float pax records);
- one compressor at a fixed level, single-threaded: zstd (the default) from the `zstandard`
  package of the tools venv's lock, whose bundled libzstd fixes the bytes on every machine; or
  gzip from zlib with wbits=31 (header with mtime 0 and no file name), whose bytes depend on the
  zlib build the interpreter links. Each descriptor names its compressor and version, and the
  image records it in a label, so a changed digest can be traced to it.

"""
from __future__ import annotations

import hashlib
import io
import os
import sys
import tarfile
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from tools.common.errors import UserError
from tools.common.files import temp_sibling, write_bytes_atomic
from tools.common.jsonfmt import canonical_json
from tools.image.compression import MEDIA_TYPES, compression_id, compressor
from tools.image.layer_contents import Entry, LayerContents


def source_date_epoch(value: str | None = None) -> int:
    """SOURCE_DATE_EPOCH as an int; unset or malformed is a UserError (no silent 'now')."""
    raw = value if value is not None else os.environ.get("SOURCE_DATE_EPOCH")
    if raw is None or not raw.strip().isdigit():
        raise UserError(f"SOURCE_DATE_EPOCH={raw!r}: set it to a non-negative integer "
                        "(e.g. the lock file's commit time) so layer mtimes are fixed")
    return int(raw)


_TAR_TYPE = {"dir": tarfile.DIRTYPE, "file": tarfile.REGTYPE, "symlink": tarfile.SYMTYPE,
             "hardlink": tarfile.LNKTYPE, "char": tarfile.CHRTYPE, "block": tarfile.BLKTYPE,
             "fifo": tarfile.FIFOTYPE}


def with_parents(entries: dict[str, Entry]) -> list[Entry]:
    """All entries sorted by path, with a 0755 directory for every missing parent."""
    full = _hardlinks_point_backwards(dict(entries))
    for path in list(entries):
        parent = PurePosixPath(path).parent
        while str(parent) not in (".", ""):
            full.setdefault(str(parent), Entry(str(parent), "dir", 0o755))
            parent = parent.parent
    # Sorting the strings puts a directory before its children ('a' < 'a/...').
    return [full[p] for p in sorted(full)]


def _hardlinks_point_backwards(entries: dict[str, Entry]) -> dict[str, Entry]:
    """Make the first path (in sorted order) of each hard-link group carry the bytes.

    A tar hard link must name an entry written before it; an imported tar may have its links
    the other way round once entries are sorted.
    """
    groups: dict[str, list[str]] = {}
    for e in entries.values():
        if e.kind == "hardlink":
            if e.linkname not in entries or entries[e.linkname].kind != "file":
                raise UserError(f"hard link {e.path!r} -> {e.linkname!r}: target is not a file in "
                                "this layer; pass a self-contained rootfs")
            groups.setdefault(e.linkname, []).append(e.path)
    for target, links in groups.items():
        carrier = min([target, *links])
        if carrier == target:
            continue
        data = entries[target]
        entries[carrier] = replace(data, path=carrier)
        for path in [target, *links]:
            if path != carrier:
                entries[path] = replace(entries[path] if path != target else data, path=path,
                                        kind="hardlink", size=0, linkname=carrier,
                                        host_file=None, data=None, tar_source=None)
    return entries


class _DigestingSink:
    """File-like sink: hashes the tar stream (diff_id), compresses it, hashes the blob."""

    def __init__(self, out: BinaryIO, compression: str) -> None:
        self.out = out
        self.diff_hash = hashlib.sha256()
        self.blob_hash = hashlib.sha256()
        self.blob_size = 0
        self.tar_size = 0
        self.compressor = compressor(compression)

    def _emit(self, data: bytes) -> None:
        if data:
            self.out.write(data)
            self.blob_hash.update(data)
            self.blob_size += len(data)

    def write(self, data: bytes) -> int:
        self.diff_hash.update(data)
        self.tar_size += len(data)
        self._emit(self.compressor.compress(data) if self.compressor else bytes(data))
        return len(data)

    def finish(self) -> None:
        if self.compressor:
            self._emit(self.compressor.flush())

    def close(self) -> None:  # tarfile's stream calls close(); the caller owns `out`
        pass


@dataclass(frozen=True)
class LayerDescriptor:
    name: str
    media_type: str
    compression: str
    digest: str
    size: int
    diff_id: str
    tar_size: int

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "mediaType": self.media_type, "digest": self.digest,
                "size": self.size, "diff_id": self.diff_id, "tar_size": self.tar_size,
                "compression": self.compression}


def _tarinfo(entry: Entry, epoch: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(entry.path)
    info.type = _TAR_TYPE[entry.kind]
    info.mode = entry.mode
    info.uid, info.gid = entry.uid, entry.gid
    info.uname = info.gname = ""
    info.mtime = epoch
    info.size = entry.size if entry.kind == "file" else 0
    info.linkname = entry.linkname
    info.devmajor, info.devminor = entry.devmajor, entry.devminor
    return info


def write_layer(contents: LayerContents, name: str, out: Path, epoch: int, compression: str = "zstd",
                progress: bool = True) -> LayerDescriptor:
    """Write the layer blob to `out` atomically and return its descriptor."""
    entries = with_parents(contents.entries)
    tmp = temp_sibling(out)
    open_tars: dict[Path, tarfile.TarFile] = {}
    try:
        with open(tmp, "wb") as raw:
            sink = _DigestingSink(raw, compression)
            with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT,  # type: ignore[call-overload]
                              encoding="utf-8", errors="surrogateescape") as tf:
                for i, entry in enumerate(entries):
                    _add_entry(tf, entry, epoch, open_tars)
                    if progress and (i + 1) % 5000 == 0:
                        print(f"[oci_layer] {name}: {i + 1}/{len(entries)} entries, "
                              f"{sink.tar_size >> 20} MiB", file=sys.stderr)
            sink.finish()
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        for t in open_tars.values():
            t.close()
    return LayerDescriptor(name=name, media_type=MEDIA_TYPES[compression], compression=compression_id(compression),
                           digest="sha256:" + sink.blob_hash.hexdigest(), size=sink.blob_size,
                           diff_id="sha256:" + sink.diff_hash.hexdigest(), tar_size=sink.tar_size)


def _add_entry(tf: tarfile.TarFile, entry: Entry, epoch: int,
               open_tars: dict[Path, tarfile.TarFile]) -> None:
    info = _tarinfo(entry, epoch)
    if entry.kind != "file":
        tf.addfile(info)
    elif entry.data is not None:
        tf.addfile(info, io.BytesIO(entry.data))
    elif entry.host_file is not None:
        with open(entry.host_file, "rb") as f:
            if os.fstat(f.fileno()).st_size != entry.size:
                raise UserError(f"{entry.host_file}: changed size while the layer was written; "
                                "do not modify inputs during a build")
            tf.addfile(info, f)
    else:
        assert entry.tar_source is not None
        tar_path, member = entry.tar_source
        src = open_tars.get(tar_path) or open_tars.setdefault(tar_path, tarfile.open(tar_path, "r:"))
        data = src.extractfile(member)
        assert data is not None
        tf.addfile(info, data)


def write_descriptor(desc: LayerDescriptor, path: Path) -> None:
    write_bytes_atomic(path, canonical_json(desc.to_json()) + b"\n")
