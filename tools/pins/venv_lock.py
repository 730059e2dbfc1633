"""Lock the tools/tests venv: third_party/requirements.in -> third_party/requirements_lock.txt.

Resolves with pip itself (`pip install --dry-run --report`, which reads PEP 658 metadata and so
downloads little), then writes every resolved distribution as `name==version --hash=sha256:...`
for `pip install --require-hashes`. Distributions pip resolved from a local file (this machine's
CPU torch under its find-links directory) are hashed from disk.

Usage: python3.11 -m tools.pins.venv_lock [--in third_party/requirements.in]
                                             [--out third_party/requirements_lock.txt]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import urllib.parse
from pathlib import Path
from typing import Sequence

from tools.common.errors import UserError, run_cli
from tools.common.files import write_text_atomic
from tools.common.hashing import sha256_file

HEADER = """\
# Hashed lock of the venv that runs this project's tools and tests (the Bazel Python toolchain,
# tools/pins/private/python_venv.bzl). Generated from requirements.in by:
#     python3.11 -m tools.pins.venv_lock
# Do not edit by hand. torch is the CPU build (2.13.0+cpu, the version SGLang 0.5.19-0.5.21 pin):
# the CPU suite must never pull a multi-GB CUDA torch.
"""


def _sha256_of_local(url: str) -> str:
    return sha256_file(Path(urllib.parse.unquote(urllib.parse.urlparse(url).path)))


def resolve(requirements_in: Path, isolated: bool = False) -> list[tuple[str, str, str]]:
    """Return sorted (name, version, sha256) for the full closure of requirements_in.

    isolated: ignore this machine's pip configuration (its local CPU torch and constraints), for
    locks that must resolve against PyPI alone (the GPU venv's CUDA torch).
    """
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
               "--only-binary=:all:", "--quiet", "--report", str(report), "-r", str(requirements_in)]
        env = dict(os.environ)
        if isolated:
            cmd.insert(3, "--isolated")
            env = {k: v for k, v in env.items() if not k.startswith("PIP_")}
            env["PIP_CONFIG_FILE"] = os.devnull
        res = subprocess.run(cmd, text=True, capture_output=True, env=env)
        if res.returncode != 0:
            raise UserError(f"{requirements_in}: pip could not resolve it: {res.stderr.strip().splitlines()[-1:]}")
        data = json.loads(report.read_text())
    out: list[tuple[str, str, str]] = []
    for item in data["install"]:
        meta = item["metadata"]
        info = item["download_info"]
        hashes = info.get("archive_info", {}).get("hashes", {})
        sha = hashes.get("sha256") or (
            _sha256_of_local(info["url"]) if info["url"].startswith("file:") else "")
        if not sha:
            raise UserError(f"{meta['name']}=={meta['version']}: pip reported no sha256 for {info['url']}")
        out.append((meta["name"].lower(), meta["version"], sha))
    return sorted(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--in", dest="src", type=Path, default=Path("third_party/requirements.in"))
    ap.add_argument("--out", type=Path, default=Path("third_party/requirements_lock.txt"))
    ap.add_argument("--isolated", action="store_true", help="ignore this machine's pip config (PyPI only)")
    ap.add_argument("--header", default=HEADER, help=argparse.SUPPRESS)
    # Another venv's interpreter (the RBE cluster's BuildGrid needs 3.13): pip resolves wheels,
    # markers and Requires-Python for the interpreter it runs under, so the lock is made by that one.
    ap.add_argument("--python-version", default="3.11", help="the venv's Python (run this with it; default 3.11)")
    args = ap.parse_args(argv)
    if "%d.%d" % sys.version_info[:2] != args.python_version:
        raise UserError(f"run this with Python {args.python_version} (the venv's version), not {sys.version.split()[0]}")
    if args.python_version != "3.11":
        flags = f"--python-version {args.python_version} --in {args.src} --out {args.out}" + (" --isolated" if args.isolated else "")
        args.header = (f"# Hashed lock of a Python {args.python_version} venv, generated from {args.src.name} by:\n"
                       f"#     python{args.python_version} -m tools.pins.venv_lock {flags}\n# Do not edit by hand.\n")
    header = HEADER if not args.isolated else HEADER.replace(
        "torch is the CPU build (2.13.0+cpu, the version SGLang 0.5.19-0.5.21 pin):\n# the CPU suite must never pull a multi-GB CUDA torch.",
        "resolved against PyPI alone (--isolated): torch is the CUDA 13 build, for GPU hosts.")
    header = header.replace("from requirements.in by:\n#     python3.11 -m tools.pins.venv_lock",
                            f"from {args.src.name} by:\n#     python3.11 -m tools.pins.venv_lock --in {args.src} --out {args.out}" + (" --isolated" if args.isolated else ""))
    if args.python_version != "3.11":
        header = args.header
    lines = [header]
    for name, version, sha in resolve(args.src, args.isolated):
        lines.append(f"{name}=={version} \\\n    --hash=sha256:{sha}\n")
    write_text_atomic(args.out, "".join(lines))
    print(f"wrote {args.out}: {len(lines) - 1} distributions", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
