"""The image's entrypoint layer: the launch profiles checked as `python3 -m tools.image.profiles
validate` checks them (the entrypoint guard's own rule included), then the layer written by
tools/image/layer.py, in one action, so no image is built with a profile its entrypoint would
refuse or fail to load.

Usage (what tools/image/private/layer.bzl `entrypoint_layer` runs):
    python3 -m tools.image.entrypoint_layer --entrypoint FILE --entrypoint-image-path PATH
        --profile FILE... --profiles-image-dir DIR --needs FILE --selections FILE --lock FILE
        --name NAME --out LAYER.tar.gz --descriptor LAYER.json --source-date-epoch N [--compression zstd|gzip]

The layer holds the entrypoint (mode 755) at PATH and each profile at DIR/NAME.json, the files
just checked; a check that fails writes nothing.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from tools.common.errors import UserError, run_cli
from tools.image import layer
from tools.image.backend_needs import load_needs
from tools.image.launch_profiles import check_profiles, load_profile_files


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--entrypoint", type=Path, required=True, help="image/entrypoint.py")
    p.add_argument("--entrypoint-image-path", required=True)
    p.add_argument("--profile", type=Path, action="append", default=[], help="a launch profile NAME.json")
    p.add_argument("--profiles-image-dir", required=True)
    p.add_argument("--needs", type=Path, required=True)
    p.add_argument("--selections", type=Path, required=True)
    p.add_argument("--lock", type=Path, required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--descriptor", required=True)
    p.add_argument("--source-date-epoch", required=True)
    p.add_argument("--compression", default="zstd", help="the blob's encoding (tools/image/layer.py --compression)")
    args = p.parse_args(argv)
    if not args.profile:
        raise UserError("entrypoint layer: no --profile given; the image ships its launch profiles (image/profiles/)")
    loaded = load_profile_files(args.profile)
    load_needs(args.needs)
    check_profiles(loaded, args.selections, args.lock, args.entrypoint)
    files = [f"{args.entrypoint_image_path}={args.entrypoint}:755"]
    files += [f"{args.profiles_image_dir}/{path.name}={path}" for path in args.profile]
    return layer.main(["--name", args.name, "--out", args.out, "--descriptor", args.descriptor,
                       "--source-date-epoch", args.source_date_epoch, "--compression", args.compression,
                       *(x for f in files for x in ("--file", f))])


if __name__ == "__main__":
    sys.exit(run_cli(main))
