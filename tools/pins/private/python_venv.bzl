"""Module extension: the Python toolchain for tools and tests, a venv built from a hashed lock.

rules_python 0.22.1's pip.parse breaks on newer interpreters and cannot register a venv as the
toolchain, so this extension does the two things we need with pip itself:
  1. `<python3.11> -m venv` with the interpreter named by KIMI_K3_PYTHON (the launcher sets it;
     never whatever python3 is on PATH), checked to be 3.11 (the pinned cp311 wheels need it);
  2. `pip install --require-hashes --no-deps -r requirements_lock.txt` into it;
then registers the venv's interpreter as the py_runtime of a toolchain.
"""

load(":fetch.bzl", "CREDENTIALS_ENV")

_WANT_PYTHON = "3.11"

# pip settings that point at this machine's local wheel sources (find-links, file indexes,
# constraints): passed through so the CPU torch build is taken from disk where it lies.
_PIP_ENV = [
    "PIP_FIND_LINKS",
    "PIP_EXTRA_INDEX_URL",
    "PIP_INDEX_URL",
    "PIP_CONSTRAINT",
    "PIP_CERT",
    "PIP_DEFAULT_TIMEOUT",
    "PIP_CONFIG_FILE",
    "http_proxy",
    "https_proxy",
    "no_proxy",
]

# sha256 of what the venv is made of: the lock's bytes, the interpreter's real path and version.
_KEY_SCRIPT = """
import hashlib, os, sys
h = hashlib.sha256(b"kimi-k3-venv-v1\\0")
h.update(open(sys.argv[1], "rb").read())
h.update(("\\0%s\\0%s" % (os.path.realpath(sys.executable), sys.version)).encode())
print(h.hexdigest()[:24])
"""

# Runs under `flock <venv>.lock`: reuse a complete venv, else build it afresh in place. pip gets
# back the credentials of its index and proxy URLs, which tools/bazel keeps out of Bazel (and so
# out of this rule's marker file and the output base's logs), from tools/bazel's private file.
_BUILD_SCRIPT = """
import os, shutil, subprocess, sys
venv, lock, workspace = sys.argv[1], sys.argv[2], sys.argv[3]
marker = os.path.join(venv, ".kimi-k3-complete")
if os.path.exists(marker) and os.path.exists(os.path.join(venv, "bin", "python3")):
    sys.exit(0)
sys.path.insert(0, workspace)
from tools.common import credentials
credentials.restore()
shutil.rmtree(venv, ignore_errors=True)
subprocess.run([sys.executable, "-m", "venv", venv], check=True)
subprocess.run([os.path.join(venv, "bin", "python"), "-m", "pip", "install", "--require-hashes", "--no-deps",
                "--only-binary=:all:", "--no-cache-dir", "-q", "-r", lock], check=True)
open(marker, "w").close()
"""

def _cache_root(rctx):
    """The shared artifact cache root (tools/common/cache.py; tools/bazel exports KIMI_K3_CACHE)."""
    env = rctx.os.environ
    if env.get("KIMI_K3_CACHE"):
        return env["KIMI_K3_CACHE"]
    return (env.get("XDG_CACHE_HOME") or (env.get("HOME", "") + "/.cache")) + "/kimi-k3-build"

def _fail_on(result, what):
    if result.return_code != 0:
        fail("%s failed (exit %d):\n%s\n%s" % (what, result.return_code, result.stdout[-4000:], result.stderr[-4000:]))

def _venv_impl(rctx):
    python = rctx.os.environ.get("KIMI_K3_PYTHON", "")
    if not python:
        found = rctx.which("python" + _WANT_PYTHON)
        if not found:
            fail("Python %s not found: set KIMI_K3_PYTHON=/path/to/python%s (tools/bazel does this)" % (_WANT_PYTHON, _WANT_PYTHON))
        python = str(found)
    res = rctx.execute([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"])
    got = res.stdout.strip() if res.return_code == 0 else "unusable (%s)" % res.stderr.strip()
    if got != _WANT_PYTHON:
        fail("KIMI_K3_PYTHON=%s is Python %s; wanted Python %s: point KIMI_K3_PYTHON at a python%s" % (python, got, _WANT_PYTHON, _WANT_PYTHON))

    lock = rctx.path(rctx.attr.requirements_lock)
    rctx.watch(lock)

    # The venv lives outside Bazel's output base, at a path named by its content (the lock's
    # bytes, the interpreter and its version): every action runs `<venv>/bin/python3` by its
    # absolute path, and that path is part of the action key, so a venv inside the output base
    # would make the keys of two checkouts (or two users) differ and no remote-cache entry would
    # ever be shared. Same lock + same interpreter = same path = same keys.
    key = rctx.execute([python, "-c", _KEY_SCRIPT, str(lock)])
    _fail_on(key, "hashing %s" % rctx.attr.requirements_lock)
    venvs = _cache_root(rctx) + "/venvs"
    venv = "%s/%s-%s" % (venvs, rctx.attr.requirements_lock.name.removesuffix(".txt"), key.stdout.strip())
    _fail_on(rctx.execute(["mkdir", "-p", venvs]), "mkdir -p " + venvs)

    env = {k: rctx.os.environ[k] for k in _PIP_ENV + [CREDENTIALS_ENV] if k in rctx.os.environ}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    rctx.report_progress("venv %s (pip install --require-hashes -r %s)" % (venv, rctx.attr.requirements_lock.name))

    # Built once per key under a lock (concurrent first builds build it once); a venv counts
    # only once its completion marker exists, so a killed build is redone, never used.
    _fail_on(rctx.execute(
        ["flock", venv + ".lock", python, "-c", _BUILD_SCRIPT, venv, str(lock), str(rctx.path(Label("//:MODULE.bazel")).dirname)],
        environment = env,
        timeout = 3600,
        quiet = False,
    ), "building the venv %s from %s" % (venv, rctx.attr.requirements_lock))

    rctx.file("BUILD.bazel", """\
load("@rules_python//python:defs.bzl", "py_runtime", "py_runtime_pair")

# The venv's interpreter (built from {lock}); the stub that launches py_binary/py_test uses the
# base interpreter it was created from, not python3 from PATH.
py_runtime(
    name = "py3_runtime",
    interpreter_path = "{venv}/bin/python3",
    python_version = "PY3",
    stub_shebang = "#!{base}",
)

py_runtime_pair(
    name = "runtime_pair",
    py3_runtime = ":py3_runtime",
)

toolchain(
    name = "toolchain",
    toolchain = ":runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)

exports_files(["python_path.txt"])
""".format(lock = rctx.attr.requirements_lock, venv = venv, base = python))
    rctx.file("python_path.txt", "%s/bin/python3\n" % venv)
    rctx.symlink(venv, "venv")  # the familiar external/<repo>/venv path, for people

_venv_repo = repository_rule(
    implementation = _venv_impl,
    attrs = {"requirements_lock": attr.label(allow_single_file = True)},
    environ = ["KIMI_K3_PYTHON", "KIMI_K3_CACHE"] + _PIP_ENV,
)

def _python_venv_impl(mctx):
    for mod in mctx.modules:
        for v in mod.tags.venv:
            _venv_repo(name = v.name, requirements_lock = v.requirements_lock)

python_venv = module_extension(
    implementation = _python_venv_impl,
    tag_classes = {"venv": tag_class(attrs = {
        "name": attr.string(mandatory = True),
        "requirements_lock": attr.label(mandatory = True),
    })},
)
