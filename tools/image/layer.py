"""Reproducible OCI layer tars: same inputs -> byte-identical blob, same digest.

Usage:
    python3 -m tools.image.layer --out-tree DIR [--wheel WHEEL]... [--wheel-dir DIR]...
    python3 -m tools.image.layer --name NAME --out LAYER.tar.gz --descriptor LAYER.json \
        [--tree IMAGE_DIR=HOST_DIR]... [--site-tree HOST_DIR]... [--wheel WHEEL]... \
        [--wheel-dir DIR]... [--file IMAGE_PATH=HOST_FILE[:MODE]]... [--tar ROOTFS.tar]
        [--compression zstd|gzip|none]
        [--kernel-cache-arch ARCH]

The descriptor JSON ({name, mediaType, digest, size, diff_id}) is what tools/image/layout.py reads.

--kernel-cache-arch ARCH: every --tree/--site-tree is a FlashInfer kernel cache, and one built
for another arch is refused: its flashinfer/data/aot/kernel_cache.json must say arch_list ARCH
(an empty flashinfer/data/aot, a stack without a cache, passes). The image's kernel-cache layer
sets it to the image's FLASHINFER_CUDA_ARCH_LIST, so no build flag can ship other kernels.

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

Why zstd by default: the layers are GBs of tar, and zstd level 3 costs a small fraction of the
CPU of zlib's gzip level 1 for smaller blobs (docs/measurements/2026-12-02.md); on a small build
host that CPU competes with the kernel compile. Runtimes that read zstd layers:
containerd 1.5+, Docker Engine 23.0+, podman/CRI-O (containers/image 5.x), umoci 0.4.7+, skopeo.
Older runtimes take the gzip build (`--//image:layer_compression=gzip`, a different digest).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import shutil
import stat
import sys
import tarfile
import tempfile
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Iterable, Iterator, Sequence

from tools.common.errors import UserError, run_cli
from tools.common.files import dir_replaced_atomically, temp_dir_sibling, temp_sibling, write_bytes_atomic
from tools.common.jsonfmt import canonical_json

GZIP_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"
ZSTD_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar+zstd"
TAR_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar"
MEDIA_TYPES = {"zstd": ZSTD_MEDIA_TYPE, "gzip": GZIP_MEDIA_TYPE, "none": TAR_MEDIA_TYPE}
# zstd's own default level; fixed like GZIP_LEVEL (a change changes every digest).
ZSTD_LEVEL = 3
# Level 1: the torch + CUDA layer is ~5.5 GB; level 6 roughly triples the time for ~10% smaller
# blobs. Changing the level changes every layer digest, so it is a constant, not an option.
GZIP_LEVEL = 1
# Debian's python3 puts /usr/local/lib/python3.11/dist-packages on sys.path (not site-packages).
SITE_PACKAGES = "usr/local/lib/python3.11/dist-packages"
IMAGE_PYTHON = "/usr/bin/python3"
_CHUNK = 1 << 20


def compression_id(compression: str = "gzip") -> str:
    """What produced the compressed bytes (a descriptor field, and an image label)."""
    if compression == "zstd":
        import zstandard

        return f"zstd-{'.'.join(map(str, zstandard.ZSTD_VERSION))}-level{ZSTD_LEVEL}"
    if compression == "gzip":
        return f"gzip-zlib-{zlib.ZLIB_RUNTIME_VERSION}-level{GZIP_LEVEL}"
    return "none"


def _compressor(compression: str):  # an object with compress(bytes) and flush(), or None
    if compression == "zstd":
        import zstandard

        # Single-threaded, no content size or checksum in the frame: the bytes depend only on
        # the input, the level and the library version.
        return zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=0, write_checksum=False,
                                        write_content_size=False).compressobj()
    if compression == "gzip":
        return zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 31)
    return None


def source_date_epoch(value: str | None = None) -> int:
    """SOURCE_DATE_EPOCH as an int; unset or malformed is a UserError (no silent 'now')."""
    raw = value if value is not None else os.environ.get("SOURCE_DATE_EPOCH")
    if raw is None or not raw.strip().isdigit():
        raise UserError(f"SOURCE_DATE_EPOCH={raw!r}: set it to a non-negative integer "
                        "(e.g. the lock file's commit time) so layer mtimes are fixed")
    return int(raw)


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
        for host_path in sorted(_walk(host_dir), key=lambda p: p.relative_to(host_dir).as_posix()):
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

def _install_wheel(wheel: Path, staging: Path) -> None:
    """Install a wheel as Debian's python3 would see it, without running the image.

    Uses the `installer` library (what pip uses inside), prefix /usr/local, purelib and
    platlib = Debian's dist-packages, script shebangs = /usr/bin/python3. No byte-compiling:
    marshal output can depend on the compiling interpreter (this build host's, not the
    image's python3.11), which would leak the host into the layer; python3 writes its
    __pycache__ on first import instead.
    """
    from installer import install
    from installer.destinations import SchemeDictionaryDestination
    from installer.sources import WheelFile

    if not wheel.is_file() or wheel.suffix != ".whl":
        raise UserError(f"--wheel {wheel}: not a .whl file; pass a wheel from the fetch cache")
    scheme = {
        "purelib": "/" + SITE_PACKAGES,
        "platlib": "/" + SITE_PACKAGES,
        "headers": "/usr/local/include/python3.11/" + wheel.name.split("-")[0],
        "scripts": "/usr/local/bin",
        "data": "/usr/local",
    }
    destination = SchemeDictionaryDestination(
        scheme, interpreter=IMAGE_PYTHON, script_kind="posix",
        bytecode_optimization_levels=(), destdir=str(staging))
    try:
        with WheelFile.open(wheel) as source:
            install(source, destination, additional_metadata={"INSTALLER": b"kimi-k3-build\n"})
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"--wheel {wheel}: cannot install ({e}); check the wheel is intact "
                        "and not installed twice in this layer") from e


def _walk(root: Path) -> Iterator[Path]:
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
        self.compressor = _compressor(compression)

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


_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_GZIP_MAGIC = b"\x1f\x8b"


def decompressed(blob: BinaryIO) -> BinaryIO:
    """A reader of the tar inside a layer blob, whatever its encoding (zstd, gzip, none), told
    by its magic bytes."""
    import gzip

    head = blob.read(4)
    blob.seek(0)
    if head == _ZSTD_MAGIC:
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(blob)  # type: ignore[return-value]
    if head[:2] == _GZIP_MAGIC:
        return gzip.GzipFile(fileobj=blob, mode="rb")  # type: ignore[return-value]
    return blob


@contextlib.contextmanager
def open_layer_blob(path: Path) -> Iterator[tarfile.TarFile]:
    """The layer blob at `path` as a stream tarfile (members in order; read each as you meet it)."""
    with open(path, "rb") as raw, tarfile.open(fileobj=decompressed(raw), mode="r|") as tf:
        yield tf


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


def _split_assignment(raw: str, flag: str) -> tuple[str, str]:
    if "=" not in raw:
        raise UserError(f"{flag} {raw!r}: expected IMAGE_PATH=HOST_PATH")
    left, right = raw.split("=", 1)
    return left, right


def wheels_in_dirs(dirs: Iterable[str]) -> list[str]:
    """The .whl files directly inside each directory (a Bazel rule's directory output, e.g. the
    patch gate's repacked +kimik3 wheel, whose file name is only known after the build)."""
    found: list[str] = []
    for raw in dirs:
        d = Path(raw)
        wheels = sorted(str(w) for w in d.glob("*.whl")) if d.is_dir() else []
        if not wheels:
            raise UserError(f"--wheel-dir {raw}: no .whl file in it; pass the directory a wheel was written to")
        found += wheels
    return found


KERNEL_CACHE_AOT = Path("flashinfer") / "data" / "aot"
KERNEL_CACHE_JSON = "kernel_cache.json"  # tools/kernel_cache CACHE_JSON_NAME


def check_kernel_cache_arch(flag: str, host_dir: Path, arch: str) -> None:
    """Refuse a kernel cache tree whose kernel_cache.json is not for `arch`."""
    aot = host_dir / KERNEL_CACHE_AOT
    if not aot.is_dir():
        raise UserError(f"{flag} {host_dir}: no {KERNEL_CACHE_AOT} in it; --kernel-cache-arch layers take "
                        "a kernel cache tree (tools/kernel_cache assemble)")
    cache_json = aot / KERNEL_CACHE_JSON
    if not cache_json.exists():
        if any(aot.iterdir()):
            raise UserError(f"{flag} {host_dir}: {KERNEL_CACHE_AOT} holds modules but no {KERNEL_CACHE_JSON}; "
                            "pass a cache assembled by tools/kernel_cache")
        return  # the empty stand-in of a stack without a cache: FlashInfer compiles at first use
    try:
        found = json.loads(cache_json.read_text()).get("arch_list")
    except (OSError, ValueError, AttributeError) as e:
        raise UserError(f"{cache_json}: unreadable ({type(e).__name__}); rebuild the kernel cache") from None
    if found != arch:
        raise UserError(f"{flag} {host_dir}: kernel cache built for arch {found!r}, this layer is for {arch!r}; "
                        f"pass a cache built for {arch} (the image takes //kernel_cache:sm120_cache)")


def build_contents(trees: Iterable[str], site_trees: Iterable[str], wheels: Iterable[str],
                   files: Iterable[str], tars: Iterable[str], staging: Path) -> LayerContents:
    contents = LayerContents()
    for tar in tars:
        contents.add_tar(Path(tar))
    for raw in trees:
        image_dir, host_dir = _split_assignment(raw, "--tree")
        contents.add_tree(image_dir, Path(host_dir))
    for host_dir in site_trees:
        contents.add_tree(SITE_PACKAGES, Path(host_dir))
    for raw in files:
        image_path, spec = _split_assignment(raw, "--file")
        mode: int | None = None
        host, sep, mode_text = spec.rpartition(":")
        if sep and mode_text and all(c in "01234567" for c in mode_text):
            mode = int(mode_text, 8)
        else:
            host = spec
        contents.add_file(image_path, Path(host), mode)
    if wheels:
        installed = staging / "installed"
        install_wheels([Path(w) for w in wheels], installed)
        contents.add_tree("", installed)
    return contents


def install_wheels(wheels: Sequence[Path], out: Path) -> None:
    """Install wheels into one tree rooted at the image's / (what a layer of them holds), and
    refuse a file two wheels both install. The tree is what the layer is written from, and what
    the launch-profile check mounts as the image's root (tools/image/smoke.py rootfs plans)."""
    with dir_replaced_atomically(out, "--out-tree", tool=None) as tree:
        stages = temp_dir_sibling(out)
        try:
            owner: dict[str, str] = {}
            for i, wheel in enumerate(sorted(wheels, key=lambda w: w.name)):
                stage = stages / f"{i}-{wheel.name}"
                stage.mkdir()
                _install_wheel(wheel, stage)
                # Moved file by file into the merged tree (one filesystem: renames, no copies).
                for host_path in sorted(_walk(stage), key=lambda p: p.relative_to(stage).as_posix()):
                    rel = host_path.relative_to(stage).as_posix()
                    target = tree / rel
                    if host_path.is_dir() and not host_path.is_symlink():
                        target.mkdir(exist_ok=True)
                        continue
                    if rel in owner or target.exists() or target.is_symlink():
                        raise UserError(f"--wheel {wheel}: {rel!r} is already installed by "
                                        f"{owner.get(rel, 'another input')}; give each file one source "
                                        "(split the wheels into separate layers)")
                    owner[rel] = wheel.name
                    os.rename(host_path, target)
        finally:
            shutil.rmtree(stages, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--name", help="layer name (recorded in the descriptor)")
    p.add_argument("--out", type=Path, help="layer blob to write")
    p.add_argument("--descriptor", type=Path, help="descriptor JSON to write")
    p.add_argument("--out-tree", type=Path, metavar="DIR",
                   help="instead of a blob: install the --wheel/--wheel-dir wheels into DIR (the "
                        "layer's tree, rooted at the image's /) and write nothing else")
    p.add_argument("--tree", action="append", default=[], metavar="IMAGE_DIR=HOST_DIR")
    p.add_argument("--site-tree", action="append", default=[], metavar="HOST_DIR",
                   help=f"a tree placed under /{SITE_PACKAGES} (patched packages, kernel cache)")
    p.add_argument("--wheel", action="append", default=[], metavar="WHEEL")
    p.add_argument("--wheel-dir", action="append", default=[], metavar="DIR", help="every .whl in DIR")
    p.add_argument("--file", action="append", default=[], metavar="IMAGE_PATH=HOST_FILE[:MODE]")
    p.add_argument("--tar", action="append", default=[], metavar="ROOTFS_TAR")
    p.add_argument("--compression", choices=sorted(MEDIA_TYPES), default="zstd",
                   help="the blob's encoding (default zstd; gzip for runtimes older than containerd 1.5 / Docker 23)")
    p.add_argument("--kernel-cache-arch", metavar="ARCH",
                   help="refuse a --tree/--site-tree kernel cache whose kernel_cache.json is for another arch")
    p.add_argument("--source-date-epoch", default=None, help="default: $SOURCE_DATE_EPOCH")
    args = p.parse_args(argv)
    if args.out_tree is not None:
        others = [f for f, v in (("--out", args.out), ("--descriptor", args.descriptor), ("--tree", args.tree),
                                 ("--site-tree", args.site_tree), ("--file", args.file), ("--tar", args.tar)) if v]
        if others:
            raise UserError(f"--out-tree installs wheels only: drop {', '.join(others)} (the blob is written "
                            "from the tree with --tree =DIR)")
        wheels = [Path(w) for w in [*args.wheel, *wheels_in_dirs(args.wheel_dir)]]
        if not wheels:
            raise UserError("--out-tree: no --wheel/--wheel-dir to install; pass the layer's wheels")
        install_wheels(wheels, args.out_tree)
        print(f"installed {len(wheels)} wheels into {args.out_tree}", file=sys.stderr)
        return 0
    missing = [f for f, v in (("--name", args.name), ("--out", args.out), ("--descriptor", args.descriptor)) if not v]
    if missing:
        raise UserError(f"{', '.join(missing)}: required to write a layer blob (or pass --out-tree to install wheels)")
    epoch = source_date_epoch(args.source_date_epoch)
    if args.kernel_cache_arch is not None:
        if not (args.tree or args.site_tree):
            raise UserError("--kernel-cache-arch: no --tree/--site-tree to check; pass the kernel cache tree")
        for raw in args.tree:
            check_kernel_cache_arch("--tree", Path(_split_assignment(raw, "--tree")[1]), args.kernel_cache_arch)
        for raw in args.site_tree:
            check_kernel_cache_arch("--site-tree", Path(raw), args.kernel_cache_arch)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".oci_layer_stage.", dir=args.out.parent) as staging:
        wheels = [*args.wheel, *wheels_in_dirs(args.wheel_dir)]
        contents = build_contents(args.tree, args.site_tree, wheels, args.file, args.tar, Path(staging))
        if not contents.entries:
            raise UserError(f"--name {args.name}: the layer has no inputs; pass --tree/--wheel/--file/--tar")
        desc = write_layer(contents, args.name, args.out, epoch, compression=args.compression)
    write_descriptor(desc, args.descriptor)
    print(f"layer {desc.name}: {desc.digest} {desc.size} bytes (tar {desc.tar_size} bytes, "
          f"{len(contents.entries)} entries)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
