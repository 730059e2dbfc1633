"""A layer blob's encoding: the media types, the one compressor at its fixed level (the bytes a
digest covers), and the reader that tells an encoding by its magic bytes.

Why zstd by default: the layers are GBs of tar, and zstd level 3 costs a small fraction of the
CPU of zlib's gzip level 1 for smaller blobs (docs/measurements/2026-12-02.md); on a small build
host that CPU competes with the kernel compile. Runtimes that read zstd layers:
containerd 1.5+, Docker Engine 23.0+, podman/CRI-O (containers/image 5.x), umoci 0.4.7+, skopeo.
Older runtimes take the gzip build (`--//image:layer_compression=gzip`, a different digest).
"""
from __future__ import annotations

import contextlib
import tarfile
import zlib
from pathlib import Path
from typing import BinaryIO, Iterator

GZIP_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"
ZSTD_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar+zstd"
TAR_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar"
MEDIA_TYPES = {"zstd": ZSTD_MEDIA_TYPE, "gzip": GZIP_MEDIA_TYPE, "none": TAR_MEDIA_TYPE}
# zstd's own default level; fixed like GZIP_LEVEL (a change changes every digest).
ZSTD_LEVEL = 3
# Level 1: the torch + CUDA layer is ~5.5 GB; level 6 roughly triples the time for ~10% smaller
# blobs. Changing the level changes every layer digest, so it is a constant, not an option.
GZIP_LEVEL = 1


def compression_id(compression: str = "gzip") -> str:
    """What produced the compressed bytes (a descriptor field, and an image label)."""
    if compression == "zstd":
        import zstandard

        return f"zstd-{'.'.join(map(str, zstandard.ZSTD_VERSION))}-level{ZSTD_LEVEL}"
    if compression == "gzip":
        return f"gzip-zlib-{zlib.ZLIB_RUNTIME_VERSION}-level{GZIP_LEVEL}"
    return "none"


def compressor(compression: str):  # an object with compress(bytes) and flush(), or None
    if compression == "zstd":
        import zstandard

        # Single-threaded, no content size or checksum in the frame: the bytes depend only on
        # the input, the level and the library version.
        return zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=0, write_checksum=False,
                                        write_content_size=False).compressobj()
    if compression == "gzip":
        return zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 31)
    return None


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


