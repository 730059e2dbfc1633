"""What one layer holds: its entries by path (files, directories, links, devices), from host
trees, single files, bytes and an imported rootfs tar, with owners and modes normalized so a
host's umask or checkout never reaches the layer."""
from __future__ import annotations

import os
import stat
import tarfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Iterator

from tools.common.errors import UserError


@dataclass(frozen=True)
class Entry:
    """One tar entry of a layer. `path` is relative to / with no trailing slash."""

    path: str
    kind: str  # dir, file, symlink, hardlink, char, block, fifo
    mode: int
    uid: int = 0
    gid: int = 0
    size: int = 0
    linkname: str = ""
    devmajor: int = 0
    devminor: int = 0
    host_file: Path | None = None
    data: bytes | None = None
    tar_source: tuple[Path, tarfile.TarInfo] | None = field(default=None, compare=False)


def clean_image_path(raw: str, what: str) -> str:
    """A path inside the image: relative, normalized, no '..'; '' means the root."""
    parts = [p for p in raw.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UserError(f"{what}: image path {raw!r} contains '..'; use a path inside the image")
    return "/".join(parts)


def normalized_mode(kind: str, host_mode: int) -> int:
    """Fixed modes so a host's umask or checkout never reaches the layer."""
    if kind == "dir":
        return 0o755
    if kind == "symlink":
        return 0o777
    return 0o755 if host_mode & 0o111 else 0o644


class LayerContents:
    """The entries of one layer, keyed by path; parents are filled in before writing."""

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}

    def add(self, entry: Entry, origin: str) -> None:
        if not entry.path:
            return  # the root directory itself is never a tar entry
        old = self.entries.get(entry.path)
        if old is not None:
            if old.kind == "dir" and entry.kind == "dir":
                return
            raise UserError(f"{origin}: {entry.path!r} is already in this layer; "
                            "give each file one source (split the inputs into separate layers)")
        self.entries[entry.path] = entry

    def add_tree(self, image_dir: str, host_dir: Path) -> None:
        """Every file under host_dir, placed under image_dir, with normalized modes, owner 0."""
        if not host_dir.is_dir():
            raise UserError(f"--tree {host_dir}: not a directory; pass an existing directory")
        base = clean_image_path(image_dir, f"--tree {image_dir}")
        origin = f"--tree {host_dir}"
        self.add(Entry(base, "dir", 0o755), origin)
        # Hard links become tar hard links to the first path in sorted order, so a tree with
        # links (Bazel outputs, wheels installed twice) does not store the bytes twice.
        first_path_of_inode: dict[tuple[int, int], str] = {}
        for host_path in sorted(walk(host_dir), key=lambda p: p.relative_to(host_dir).as_posix()):
            rel = host_path.relative_to(host_dir).as_posix()
            path = f"{base}/{rel}" if base else rel
            st = host_path.lstat()
            if stat.S_ISDIR(st.st_mode):
                self.add(Entry(path, "dir", 0o755), origin)
            elif stat.S_ISLNK(st.st_mode):
                self.add(Entry(path, "symlink", 0o777, linkname=os.readlink(host_path)), origin)
            elif stat.S_ISREG(st.st_mode):
                key = (st.st_dev, st.st_ino)
                if st.st_nlink > 1 and key in first_path_of_inode:
                    self.add(Entry(path, "hardlink", normalized_mode("file", st.st_mode),
                                   linkname=first_path_of_inode[key]), origin)
                    continue
                first_path_of_inode[key] = path
                self.add(Entry(path, "file", normalized_mode("file", st.st_mode), size=st.st_size,
                               host_file=host_path), origin)
            else:
                raise UserError(f"{origin}: {host_path} is a device, socket or fifo; "
                                "layers from trees hold only files, directories and symlinks")

    def add_file(self, image_path: str, host_file: Path, mode: int | None) -> None:
        if not host_file.is_file():
            raise UserError(f"--file {host_file}: not a regular file; pass an existing file")
        path = clean_image_path(image_path, f"--file {image_path}")
        st = host_file.stat()
        self.add(Entry(path, "file", mode if mode is not None else normalized_mode("file", st.st_mode),
                       size=st.st_size, host_file=host_file), f"--file {host_file}")

    def add_bytes(self, image_path: str, data: bytes, mode: int = 0o644) -> None:
        path = clean_image_path(image_path, image_path)
        self.add(Entry(path, "file", mode, size=len(data), data=data), image_path)

    def add_tar(self, tar_path: Path) -> None:
        """Import a rootfs tar (e.g. mmdebstrap's), keeping numeric owners and permission bits.

        The base OS needs its owners and special bits (/tmp 1777, setuid su, group shadow); only
        names, mtimes and order are normalized. Whiteouts are refused: a base has nothing below.
        """
        try:
            tf = tarfile.open(tar_path, mode="r:")  # random access: entries are re-read sorted
        except (OSError, tarfile.TarError) as e:
            raise UserError(f"--tar {tar_path}: cannot read as an uncompressed tar ({e}); "
                            "pass the rootfs as a plain .tar") from e
        origin = f"--tar {tar_path}"
        for member in tf.getmembers():
            path = clean_image_path(member.name, origin)
            if PurePosixPath(path).name.startswith(".wh."):
                raise UserError(f"{origin}: whiteout {member.name!r} in a base tar; pass a flat rootfs")
            kind = _kind_of_member(member, origin)
            linkname = member.linkname
            if kind == "hardlink":
                linkname = clean_image_path(member.linkname, origin)
            perm = stat.S_IMODE(member.mode) & 0o7777
            self.add(Entry(path, kind, perm, uid=member.uid, gid=member.gid,
                           size=member.size if kind == "file" else 0, linkname=linkname,
                           devmajor=member.devmajor, devminor=member.devminor,
                           tar_source=(tar_path, member)), origin)
        tf.close()

def walk(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        d = Path(dirpath)
        for name in dirnames + filenames:
            yield d / name


def _kind_of_member(member: tarfile.TarInfo, origin: str) -> str:
    if member.isdir():
        return "dir"
    if member.issym():
        return "symlink"
    if member.islnk():
        return "hardlink"
    if member.isreg():
        return "file"
    if member.ischr():
        return "char"
    if member.isblk():
        return "block"
    if member.isfifo():
        return "fifo"
    raise UserError(f"{origin}: unsupported tar entry type for {member.name!r}; pass a plain rootfs tar")
