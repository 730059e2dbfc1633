"""The exec root as an OCI image: what a hosted REAPI engine's worker runs an action in, so the
action sees the files a loopback worker's bubblewrap binds (exec_root.ExecRoot.runner_binds), at
the same paths, and nothing else of the host.

Three layers, bottom first, each one part of those binds:
- exec-root-system: the sealed root's /usr and /etc trees, and /bin, /lib, /lib64 as the root has
  them (links into usr in sid: a bind of such a link shows its target, as the link does here);
- exec-root-python: the Python prefix at its own absolute path (the venvs' interpreters link into it);
- exec-root-venvs: the venvs directory at its own absolute path.
Split so a rebuilt venv uploads one layer again; the system and Python layers keep their digests.

Written by the image stage's reproducible code (layer_contents, layer_tar, layout): fixed entry
order, owners, modes and mtimes (a fixed SOURCE_DATE_EPOCH), so the same root, prefix and venvs
give the same manifest digest (with the same zstd, which a label names). Modes are the layers'
normalized ones (layer_contents): owner root, files 0644 or 0755. So a file only root may read
on a loopback worker (/etc/shadow) is readable in the image, and setuid bits are gone (an action
on a loopback worker has no capabilities to use them either).

How each hosted engine takes the image (each as its own documentation or example deployment
shows it; the value is the pushed digest, never a tag, so an action's key names fixed bytes):
- BuildBuddy: exec property `container-image` = `docker://REPO@sha256:...`; its executor pulls
  the image and runs the action's command through the image's ENTRYPOINT if there is one, so
  this image sets none (CMD is ignored there).
- EngFlow: exec property `container-image` = `docker://REPO@sha256:...` (with `OSFamily`), in
  the platform's exec_properties; its executor runs the action in that container.
- Buildbarn: no property makes bb_worker pull an image. The operator runs this image as the
  runner container (bb_runner installed into it by bb-runner-installer and started with
  `sh -c`, which the root's /bin/sh provides), and the worker's config lists the platform
  properties it serves, which the scheduler matches exactly: its example deployment lists
  `container-image=docker://...@sha256:...` there, so the same line is the match key.
"""
from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path, PurePosixPath
from typing import Sequence

from tools.common import credentials
from tools.common.cache import cache_root
from tools.common.errors import UserError
from tools.common.files import check_replaceable_dir, scratch_dir
from tools.image import push as image_push
from tools.image.layer_contents import Entry, LayerContents
from tools.image.layer_tar import source_date_epoch, write_descriptor, write_layer
from tools.image.layout import LABEL_PREFIX, BuiltImage, Layer, build_image, read_layer_descriptor
from tools.image.local_registry import local_registry_root
from tools.image.registry_client import Repository, parse_repository
from tools.image.signing import skopeo
from tools.rbe import exec_root
from tools.rbe.exec_root import FIX, SYSTEM_DIRS, ExecRoot

# The project's images' fixed time is image/constants.bzl's SOURCE_DATE_EPOCH (one definition,
# read from there), used when neither --source-date-epoch nor $SOURCE_DATE_EPOCH names another:
# a by-hand run must not take "now".
CONSTANTS = Path(os.path.abspath(__file__)).parents[2] / "image" / "constants.bzl"


def default_epoch() -> int:
    try:
        m = re.search(r'^SOURCE_DATE_EPOCH = "(\d+)"$', CONSTANTS.read_text(), re.M)
    except OSError as e:
        raise UserError(f"{CONSTANTS}: cannot read the images' SOURCE_DATE_EPOCH ({e.strerror}); "
                        "run from a checkout or pass --source-date-epoch") from None
    if m is None:
        raise UserError(f"{CONSTANTS}: no line `SOURCE_DATE_EPOCH = \"<seconds>\"`; restore it or pass "
                        "--source-date-epoch")
    return int(m.group(1))
LAYERS = ("exec-root-system", "exec-root-python", "exec-root-venvs")
TITLE = "kimi-k3 remote-execution root"
CONTAINER_IMAGE = "container-image"  # the exec property BuildBuddy and EngFlow read (above)
_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


def image_epoch(flag: str | None) -> int:
    """--source-date-epoch, else $SOURCE_DATE_EPOCH (as layout.py reads them), else the images' own."""
    if flag is None and os.environ.get("SOURCE_DATE_EPOCH") is None:
        return default_epoch()
    return source_date_epoch(flag)


def check_disjoint(er: ExecRoot) -> None:
    """A worker binds each part over the earlier ones, hiding what lies below; layers merge
    instead. So two parts where one holds the other would show other files: refused."""
    parts = [(f"the root's {d}", d) for d in SYSTEM_DIRS] + [
        (f"the Python prefix {er.python_prefix}", str(er.python_prefix)), (f"the venvs {er.venvs}", str(er.venvs))]
    for i, (what, path) in enumerate(parts):
        for other, other_path in parts[i + 1:]:
            a, b = PurePosixPath(path), PurePosixPath(other_path)
            if a == b or a.is_relative_to(b) or b.is_relative_to(a):
                raise UserError(f"{what} and {other} overlap: a worker's bind hides what a layer would merge; "
                                f"{FIX} with a Python installed outside /usr and /etc")


def system_contents(er: ExecRoot) -> LayerContents:
    """The root's /usr and /etc trees; /bin, /lib and /lib64 as links where the root has links."""
    contents = LayerContents()
    trees = [d.lstrip("/") for d in SYSTEM_DIRS if not (er.root / d.lstrip("/")).is_symlink()]
    for name in (d.lstrip("/") for d in SYSTEM_DIRS):
        host = er.root / name
        if host.is_symlink():
            target = os.readlink(host)
            # The worker binds the link's target as the host resolves it: a relative link stays in
            # the root, as it does in the image; an absolute one would name the host's own /usr.
            inside = os.path.normpath(target)
            if os.path.isabs(target) or not any(inside == t or inside.startswith(t + "/") for t in trees):
                raise UserError(f"{host}: a link to {target!r}, not into the root's own "
                                f"{', '.join('/' + t for t in trees)}; the image cannot show what a worker binds "
                                f"there; {FIX}")
            contents.add(Entry(name, "symlink", 0o777, linkname=target), str(host))
        elif host.is_dir():
            contents.add_tree(name, host)
        else:
            raise UserError(f"{host}: missing, and every worker binds it at /{name}; {FIX}")
    return contents


def tree_contents(path: Path, what: str) -> LayerContents:
    if not path.is_dir():
        raise UserError(f"{what} {path}: not a directory; {FIX}")
    contents = LayerContents()
    contents.add_tree(str(path), path)  # at its own absolute path, as the worker binds it
    return contents


def check_out(er: ExecRoot, out: Path) -> None:
    """Before any work: --out must be replaceable, and not inside a tree the image holds (the
    layers would take in their own scratch files)."""
    check_replaceable_dir(out, "--out", None)
    where = out.absolute()
    for what, host in [(f"the root's {d}", er.root / d.lstrip("/")) for d in SYSTEM_DIRS] + [
            ("the Python prefix", er.python_prefix), ("the venvs", er.venvs)]:
        if where.is_relative_to(host.absolute()) or where.resolve().is_relative_to(host.resolve()):
            raise UserError(f"--out {out}: inside {what} {host}, which the image holds; pass a path outside it")


def build(er: ExecRoot, out: Path, epoch: int, *, compression: str = "zstd", progress: bool = True) -> BuiltImage:
    """Write the image's OCI layout at `out` (a new or empty directory, replaced atomically)."""
    check_disjoint(er)
    check_out(er, out)
    parts = [(LAYERS[0], lambda: system_contents(er)),
             (LAYERS[1], lambda: tree_contents(er.python_prefix, "the Python prefix")),
             (LAYERS[2], lambda: tree_contents(er.venvs, "the venvs"))]
    out.absolute().parent.mkdir(parents=True, exist_ok=True)
    # The blobs are written beside `out` (same file system: build_image hard-links them in) in a
    # scratch dir that is removed afterwards, and by the next run if this one is killed.
    with scratch_dir(f".{out.name}.exec-image-layers.", parent=out.absolute().parent) as scratch:
        layers: list[Layer] = []
        for name, make in parts:
            started = time.monotonic()
            contents = make()
            blob, desc_path = scratch / f"{name}.blob", scratch / f"{name}.json"
            desc = write_layer(contents, name, blob, epoch, compression, progress)
            write_descriptor(desc, desc_path)
            layers.append(read_layer_descriptor(desc_path, blob))
            if progress:
                print(f"[exec_image] {name}: {len(contents.entries)} entries, {desc.tar_size >> 20} MiB of tar, "
                      f"{desc.size >> 20} MiB {compression}, {time.monotonic() - started:.1f} s", file=sys.stderr)
        labels = {"org.opencontainers.image.title": TITLE,
                  "org.opencontainers.image.description": "Bazel's sealed root (/usr, /bin, /lib, /lib64, /etc), "
                  "the Python prefix and the venvs, as a loopback worker's actions see them (tools/rbe/exec_image.py)",
                  LABEL_PREFIX + "exec-root": str(er.root), LABEL_PREFIX + "python-prefix": str(er.python_prefix),
                  LABEL_PREFIX + "venvs": str(er.venvs)}
        # No entrypoint and no cmd: the engine runs the action's own argv (see the docstring).
        return build_image(out, layers, epoch, labels=labels)


def container_image_property(repo: Repository, manifest_digest: str) -> str:
    """`container-image=docker://REPO@sha256:...`: the exec property naming the pushed image."""
    if not _DIGEST_RE.match(manifest_digest):
        raise UserError(f"manifest digest {manifest_digest!r}: expected sha256:<64 hex>; rebuild the layout")
    return f"{CONTAINER_IMAGE}={repo.ref('@' + manifest_digest)}"


def image_cli(out: Path, push_to: str | None, tags: Sequence[str], authfile: Path | None,
              epoch_flag: str | None) -> int:
    """`python3 -m tools.rbe image`: build, then (with --push) push by digest and print the
    property line; every input is checked before the multi-GB build."""
    repo = None
    if push_to is not None:
        try:
            repo = parse_repository(push_to)
        except UserError:
            raise UserError(f"--push {push_to!r}: expected HOST[:PORT]/PATH in lower case, e.g. "
                            "registry.example.com/kimi-k3/exec-root") from None
        image_push.check_tags(tags)  # push() checks too, but only after the multi-GB build
        skopeo()  # the push's tool, found before the build
    elif tags:
        raise UserError("--tag: tags are written on the pushed image; add --push HOST[:PORT]/PATH")
    if authfile is not None and not authfile.is_file():
        raise UserError(f"--authfile {authfile}: no such file; pass a docker/containers auth file")
    fixed_time = image_epoch(epoch_flag)
    try:
        import zstandard  # noqa: F401  the layers' compressor (tools/image/compression.py)
    except ImportError:
        raise UserError(f"{sys.executable}: has no zstandard, the layers' compressor; run this with the tools "
                        f"venv's python ({cache_root()}/venvs/requirements_lock-*/bin/python3)") from None
    er = exec_root.find()
    started = time.monotonic()
    image = build(er, out, fixed_time)
    size = sum(l.size for l in image.layers)
    print(f"rbe: exec-root image at {image.layout}: {len(image.layers)} layers, {size / 2**30:.2f} GiB, "
          f"built in {time.monotonic() - started:.0f} s", file=sys.stderr)
    if repo is None:
        print(f"manifest digest: {image.manifest_digest}")
        return 0
    credentials.restore()  # the proxies' credentials, which tools/bazel keeps out of Bazel
    result = image_push.push(image.layout, repo, tags, authfile, local_root=local_registry_root(repo))
    # Not for --remote_default_exec_properties: Bazel uses those only for a platform without
    # exec_properties, and //rbe:platform has some; the user's own platform replaces it.
    print(f"rbe: pushed {result.reference}; add this line to the exec_properties of the platform your "
          "user.bazelrc registers (build:rbe --extra_execution_platforms=//your:platform):", file=sys.stderr)
    print(container_image_property(repo, result.manifest_digest))
    return 0
