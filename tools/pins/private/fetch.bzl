"""Fetching one pin of the lock from a repository rule: `python3 -m tools.fetch fetch` (verified,
content-addressed cache, mirrors first) run with the interpreter named by KIMI_K3_PYTHON.

Used by the pins extension (one repository per pin) and by stages whose repositories are made of
several pins (the kernel cache's CUDA root). Each caller watches the Python sources of the
packages that command imports, so a changed tool re-runs it.
"""

# `python3 -m tools.fetch` imports tools, tools.fetch, tools.pins (lock) and tools.common
# (tools/fetch/__init__.py states that graph): a file of each package, whose directory is watched.
_TOOL_PACKAGES = [
    Label("//tools/fetch:BUILD.bazel"),
    Label("//tools/pins:BUILD.bazel"),
    Label("//tools/common:BUILD.bazel"),
]
_TOOL_FILES = [Label("//tools:__init__.py")]

# Variables a fetch reads: the interpreter, the cache, mirror directories and proxies.
FETCH_ENVIRON = ["KIMI_K3_PYTHON", "KIMI_K3_CACHE", "KIMI_K3_MIRROR"]

# tools/common/credentials.py ENV: the private file of the forwarded variables' credentials.
CREDENTIALS_ENV = "KIMI_K3_CREDENTIALS_FILE"

def watch_python_sources(rctx, packages = _TOOL_PACKAGES):
    """Watch every .py file of the tool packages (subdirectories too), but not the directory
    listings (readdir(watch = "no")): `__pycache__` appearing after a plain `python3 -m
    tools.fetch` run must not re-run every pin, and a new module only matters once an existing,
    watched, module imports it."""
    for label in _TOOL_FILES:
        rctx.watch(rctx.path(label))
    todo = [rctx.path(label).dirname for label in packages]
    for _ in range(10000):  # Starlark has no while loop; the trees are small
        if not todo:
            break
        directory = todo.pop()
        for entry in directory.readdir(watch = "no"):
            if entry.basename == "__pycache__":
                continue
            if entry.is_dir:
                todo.append(entry)
            elif entry.basename.endswith(".py"):
                rctx.watch(entry)

def tool_env(rctx):
    """Environment for `python3 -m tools.<stage>` run from a repository rule."""
    workspace = rctx.path(Label("//:MODULE.bazel")).dirname
    env = {"PYTHONPATH": str(workspace), "PYTHONDONTWRITEBYTECODE": "1"}

    # CREDENTIALS_ENV: the proxies' credentials, which tools/bazel keeps out of Bazel
    # (tools/common/credentials.py). Not watched (not in FETCH_ENVIRON): its path is new with
    # every command, and what it holds never changes what a pin fetches.
    for k in ["KIMI_K3_CACHE", "KIMI_K3_MIRROR", "http_proxy", "https_proxy", "no_proxy", CREDENTIALS_ENV]:
        if k in rctx.os.environ:
            env[k] = rctx.os.environ[k]
    return env

def tool_python(rctx):
    return rctx.os.environ.get("KIMI_K3_PYTHON", "") or "python3.11"

def fetch_pin_file(rctx, lock, pin, out, archive = False):
    """Fetch `pin` of the lock file `lock` (a path in the repository) to `out`, or fail with the
    fetcher's one-line error naming the pin and the fix. `archive`: a git_tree pin's tar is placed
    as one file (an action unpacks it), not unpacked into a source directory."""
    watch_python_sources(rctx)
    args = [tool_python(rctx), "-m", "tools.fetch", "fetch", "--lock", lock, "--pin", pin, "--out", out]
    if archive:
        args.append("--archive")
    rctx.report_progress("fetching pin %s" % pin)
    res = rctx.execute(args, environment = tool_env(rctx), timeout = 7200, quiet = False)
    if res.return_code != 0:
        # tools/fetch prints a one-line `error: ...` naming the pin and the fix.
        fail("pin '%s': %s" % (pin, (res.stderr.strip().splitlines() or ["fetch failed"])[-1]))
