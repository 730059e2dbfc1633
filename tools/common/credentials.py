"""Credentials in the variables tools/bazel forwards, kept out of every file a build writes.

Bazel writes its client environment into the output base (java.log lists every variable whose
name does not look secret; the file is world-readable), a repository's marker file records the
values of the variables its rule watches, and pip or urllib print the URLs they fail on. A proxy
or index URL with `user:password@` in it (https_proxy=http://user:secret@proxy:3128,
PIP_INDEX_URL=https://user:token@host/simple) would land in clear in those files.

So tools/bazel gives Bazel each such variable with the userinfo of every URL removed (`split`)
and keeps the original values in a 0600 file in a private 0700 directory under the cache root
(`<cache>/credentials/`), named by $KIMI_K3_CREDENTIALS_FILE and removed when the command ends.
The path is the only thing Bazel sees. The tools that make the requests (tools.fetch,
the Debian CLI, the image push, the venv build's pip) call `restore()` first: each variable
they were given in its stripped form gets its original value back, in their own process only.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Iterable, MutableMapping, Sequence

from tools.common.errors import UserError, run_cli

ENV = "KIMI_K3_CREDENTIALS_FILE"

# Proxy variables may name the proxy without a scheme (user:secret@proxy:3128), as urllib and
# curl accept.
PROXY_NAMES = frozenset({"http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"})

# scheme:// and the authority after it; a password may hold a raw '@', so the userinfo ends at
# the authority's last '@' (as urllib.parse reads it).
_URL_AUTHORITY = re.compile(r"(?<![A-Za-z0-9+.-])([A-Za-z][A-Za-z0-9+.-]*://)([^/?#\s]*)")


def _without_userinfo(authority: str) -> str:
    return authority.rpartition("@")[2]


def strip(name: str, value: str) -> str:
    """value with the `user:password@` of each URL in it removed (a list of URLs too)."""
    stripped = _URL_AUTHORITY.sub(lambda m: m.group(1) + _without_userinfo(m.group(2)), value)
    if name in PROXY_NAMES and "://" not in value:
        stripped = _without_userinfo(value.strip())
    return stripped


def split(environ: dict[str, str], names: Iterable[str]) -> tuple[dict[str, str], dict[str, str]]:
    """(stripped, originals) for the variables among `names` whose value holds credentials."""
    stripped, originals = {}, {}
    for name in names:
        value = environ.get(name)
        if value is None:
            continue
        clean = strip(name, value)
        if clean != value:
            stripped[name], originals[name] = clean, value
    return stripped, originals


def write_private(path: Path, originals: dict[str, str]) -> None:
    """originals as JSON in a new file that only its owner can read (never replaces a file)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(originals, f)


def restore(environ: MutableMapping[str, str] = os.environ) -> None:
    """Give back the original value of each variable in $KIMI_K3_CREDENTIALS_FILE whose stripped
    form is what `environ` holds; variables absent or changed since are left as they are."""
    path = environ.get(ENV)
    if not path:
        return
    try:
        originals = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        # It lives only as long as the tools/bazel command that wrote it: the stripped values stand.
        return
    except (OSError, ValueError) as e:
        raise UserError(f"${ENV}={path}: cannot read the forwarded credentials ({e}); it is tools/bazel's "
                        "private file for one command: unset the variable") from None
    for name, original in originals.items():
        if isinstance(original, str) and environ.get(name) == strip(name, original):
            environ[name] = original


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="tools/bazel: strip the credentials of forwarded variables")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("split", help="print NAME=STRIPPED (NUL-terminated) for each variable that held "
                                     "credentials; their original values go to --out (0600), if any")
    s.add_argument("--out", type=Path, required=True, help="the private file to create")
    s.add_argument("names", nargs="*", help="the variables forwarded")
    args = p.parse_args(argv)
    stripped, originals = split(dict(os.environ), args.names)
    if originals:
        write_private(args.out, originals)
    for name, value in stripped.items():
        sys.stdout.write(f"{name}={value}\0")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
