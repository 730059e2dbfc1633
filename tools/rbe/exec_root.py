"""What a remote action runs over: the same root and interpreter a local action runs over.

tools/bazel runs Bazel, and so every local action, in its sealed Debian root (set `bazel-root`),
with the host's Python prefix and the artifact cache bound in at their own paths; the actions'
interpreter is a venv under `<cache root>/venvs` whose python links into that prefix. A worker
whose actions saw another root (the cluster's own, set `rbe-cluster`: python3.13, no git) would
fail on the first real action, or give other bytes. So each worker's bubblewrap runner binds,
read-only, the sealed root's system directories at `/usr`, `/bin`, `/lib`, `/lib64`, `/etc`, and
the Python prefix and the venvs at their own paths. Nothing else of the host or the cache: an
action reading an undeclared file fails remotely.

tools/bazel writes `<cache root>/sealed-root.json` ({"root", "python_prefix"}) each time it enters
the root; this module only reads it, so the root's path is computed in one place.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tools.common import cache as cache_env
from tools.common.errors import UserError
from tools.common.jsondata import TEXT, Object, load_json_file

RECORD = "sealed-root.json"
FIX = "run `tools/bazel version` once (it provisions the sealed root and writes this file)"
# The root's directories an action names by path: the loader, /bin/sh, the tools, /etc's users
# and certificates. /bin, /lib and /lib64 are links into /usr in sid; bound, they resolve there.
SYSTEM_DIRS = ("/usr", "/bin", "/lib", "/lib64", "/etc")


@dataclass(frozen=True)
class ExecRoot:
    root: Path  # the sealed root's directory on the host
    python_prefix: Path
    venvs: Path

    def host_paths(self) -> list[str]:
        """What the cluster's namespace must see at its own path, read-only."""
        return [str(self.root), str(self.python_prefix), str(self.venvs)]

    def runner_binds(self) -> list[tuple[str, str]]:
        """(source in the worker's namespace, path inside the action), in bind order."""
        binds = [(f"{self.root}{d}", d) for d in SYSTEM_DIRS]
        return binds + [(str(self.python_prefix),) * 2, (str(self.venvs),) * 2]


def find() -> ExecRoot:
    """The sealed root tools/bazel last entered, checked: one line naming what is missing."""
    cache = cache_env.cache_root()
    path = cache / RECORD
    if not path.is_file():
        raise UserError(f"{path}: not found: remote actions run over Bazel's sealed root; {FIX}")
    value = load_json_file(path, "the sealed root's record", Object({"root": TEXT, "python_prefix": TEXT}), FIX)
    root, prefix, venvs = Path(value["root"]), Path(value["python_prefix"]), cache / "venvs"
    for what, p in (("the sealed root", root / "usr" / "bin"), ("the Python prefix", prefix)):
        if not p.is_dir():
            raise UserError(f"{path}: {what} {p} is not a directory; {FIX}")
    venvs.mkdir(parents=True, exist_ok=True)  # the build makes its venvs there later: bound now
    return ExecRoot(root, prefix, venvs)
