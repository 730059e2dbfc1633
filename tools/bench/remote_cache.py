"""End-to-end proof that the kernel cache is shared through a remote HTTP cache (not a test).

    python3 -m tools.bench.remote_cache [--only silu_and_mul,norm] [--stack pypi] [--keep]
    python3 -m tools.bench.remote_cache --corrupt-blob [--only silu_and_mul] [--stack pypi]

It starts Debian's nginx (WebDAV PUT) on 127.0.0.1 as a Bazel HTTP cache, clones HEAD of this
repository twice (checkouts A and B, in different directories), builds
`//kernel_cache:sm120_cache --//kernel_cache:only=...` with `--config=remote-cache` in A and
then in B, each with its own Bazel output root (so nothing is shared but the remote cache), and
reads each build's execution log: B must run no KernelCacheCompile/KernelCacheLink action
locally (every one a remote cache hit). The hit time is B's critical path (its wall time also
holds a fresh output root's repository fetch and analysis). Prints a table; exits 1 when B ran
a compile or link action (or A ran none, which would prove nothing), naming the first part of
the action key (argument, environment variable, input) that differs from A's spawn with the
same outputs. nginx and the temp dirs go away on every exit path (--keep keeps the dirs).

--corrupt-blob instead builds in A, flips one bit of one CAS blob on the server (the first
module's .so), and runs a sequence of builds in B whose assemble action runs locally and so needs
that blob: Bazel must name the digest and stay failed through its retries, --noremote_accept_cached
and `bazel clean`; deleting the blob on the server, or `bazel clean` plus one build with
--noremote_accept_cached, must rebuild it with the correct bytes (B's output and the server's
blob); docs/BAZEL.md "Remote cache" says why.

It installs nothing: nginx must be on PATH (`apt-get install nginx`; Debian's has the dav
module). It drives Bazel itself (two output roots, two servers), so it is not a py_test, and it
compiles the chosen modules once (a few minutes for silu_and_mul,norm on 2 cores).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator, Sequence

from tools.common.errors import UserError, run_cli
from tools.common.hashing import sha256_file

REPO_ROOT = Path(__file__).resolve().parents[2]
TARGET = "//kernel_cache:sm120_cache"
# The actions that run compilers; everything else (gen-sources, assemble, the patch gate) is
# reported but does not decide the result.
COMPILE_MNEMONICS = ("KernelCacheCompile", "KernelCacheLink")
SUMMARY_RE = re.compile(r"INFO: (\d+) process(?:es)?: (.*)\.")
ELAPSED_RE = re.compile(r"INFO: Elapsed time: ([\d.]+)s, Critical Path: ([\d.]+)s")

NGINX_CONF = """\
# Bazel HTTP cache for tools/bench/remote_cache.py: GET/PUT of /ac/<hash> and /cas/<hash>.
daemon off;
# One process running as the invoking user: no worker switching to `nobody`, which could not
# write into this private temp dir.
master_process off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 512; }}
http {{
    access_log {d}/access.log;
    # Every temp path inside the temp dir (the defaults are root-owned /var/lib/nginx).
    client_body_temp_path {d}/body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    server {{
        listen 127.0.0.1:{port};
        root {d}/store;
        # Kernel objects and module .so files run to hundreds of MB: no body limit.
        client_max_body_size 0;
        location / {{
            dav_methods PUT;
            create_full_put_path on;
            dav_access user:rw;
        }}
    }}
}}
"""


def log(msg: str) -> None:
    print(f"remote_cache: {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Nginx:
    """nginx under this process, config/storage/logs in `work`; stop() always safe to call."""

    def __init__(self, work: Path) -> None:
        self.dir = work / "nginx"
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def start(self) -> str:
        exe = shutil.which("nginx") or next(
            (p for p in ("/usr/sbin/nginx", "/sbin/nginx") if os.access(p, os.X_OK)), None)
        if exe is None:
            raise UserError("nginx not found (needed as the local HTTP cache): "
                            "install it with `apt-get install nginx` and retry")
        (self.dir / "store").mkdir(parents=True)
        self.port = free_port()
        conf = self.dir / "nginx.conf"
        conf.write_text(NGINX_CONF.format(d=self.dir, port=self.port))
        # -e: the error log before the config is read (else /var/log/nginx/error.log);
        # own session: a Ctrl-C reaches Bazel, and the finally below stops nginx.
        self.proc = subprocess.Popen(
            [exe, "-p", str(self.dir), "-c", str(conf), "-e", str(self.dir / "error.log")],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True)
        url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 20
        while True:
            if self.proc.poll() is not None:
                err = (self.proc.stderr.read().decode(errors="replace").strip().splitlines()
                       or ["(no output)"])[-1]
                raise UserError(f"nginx exited at start ({err}); see {self.dir}/error.log")
            try:
                urllib.request.urlopen(url + "/ready-probe", timeout=2)
            except urllib.error.HTTPError:
                break  # a 404 from nginx: it is serving
            except OSError:
                if time.monotonic() > deadline:
                    raise UserError(f"nginx did not answer on {url} within 20 s; "
                                    f"see {self.dir}/error.log")
                time.sleep(0.2)
        # PUT then GET one blob: proves the dav module accepts writes before Bazel relies on it.
        req = urllib.request.Request(url + "/probe/x", data=b"ok", method="PUT")
        try:
            urllib.request.urlopen(req, timeout=5)
            got = urllib.request.urlopen(url + "/probe/x", timeout=5).read()
        except OSError as e:
            raise UserError(f"nginx on {url} does not take PUT ({e}): it needs the http_dav "
                            "module (Debian's `apt-get install nginx` has it)") from None
        if got != b"ok":
            raise UserError(f"nginx on {url} returned {got!r} for a blob it stored")
        shutil.rmtree(self.dir / "store" / "probe")
        return url

    def stored(self) -> tuple[int, int]:
        """(blobs, bytes) in the cache's storage root."""
        n = size = 0
        for p in (self.dir / "store").rglob("*"):
            if p.is_file():
                n += 1
                size += p.stat().st_size
        return n, size

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGQUIT)  # graceful: finish in-flight requests
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def bazel_env(out_root: Path) -> dict:
    env = dict(os.environ)
    env["KIMI_K3_BAZEL_OUTPUT_ROOT"] = str(out_root)
    # tools/bazel's sealed root sees /tmp at its own path; any other temp dir must be bound.
    if not str(out_root).startswith("/tmp/"):
        env["KIMI_K3_EXTRA_BINDS"] = (env.get("KIMI_K3_EXTRA_BINDS", "") + " " +
                                      str(out_root.parent)).strip()
    return env


def run_bazel(name: str, checkout: Path, out_root: Path, args: Sequence[str], *, check: bool = True) -> dict:
    """Run tools/bazel in `checkout`, echoing its output prefixed.

    Returns wall seconds (server start and repository fetches included: the output root is
    fresh), Bazel's own elapsed and critical-path seconds, its process summary line, its exit
    code and its output lines. A non-zero exit is a UserError unless check=False.
    """
    cmd = [str(checkout / "tools" / "bazel"), *args]
    log(f"[{name}] {' '.join(cmd[1:])}")
    t0 = time.monotonic()
    summary, elapsed, critical = "", float("nan"), float("nan")
    lines: list[str] = []
    proc = subprocess.Popen(cmd, cwd=checkout, env=bazel_env(out_root), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    for raw in proc.stdout:
        line = raw.decode(errors="replace").rstrip()
        lines.append(line)
        if SUMMARY_RE.search(line):
            summary = SUMMARY_RE.search(line).group(0)
        m = ELAPSED_RE.search(line)
        if m:
            elapsed, critical = float(m.group(1)), float(m.group(2))
        print(f"  [{name} {time.monotonic() - t0:5.0f}s] {line}", file=sys.stderr, flush=True)
    rc = proc.wait()
    secs = time.monotonic() - t0
    if rc != 0 and check:
        raise UserError(f"checkout {name}: `tools/bazel {args[0]}` failed (exit {rc}); "
                        "see its output above")
    return {"wall": secs, "elapsed": elapsed, "critical": critical, "summary": summary, "rc": rc,
            "lines": lines}


def read_exec_log(path: Path) -> Iterator[dict]:
    """SpawnExec records of --execution_log_json_file (a stream of JSON objects, no array)."""
    text = path.read_text()
    dec = json.JSONDecoder()
    i = 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return
        obj, i = dec.raw_decode(text, i)
        yield obj


def cache_hit(spawn: dict) -> bool:
    # Bazel 7.7 writes "cacheHit" (older releases "remoteCacheHit"); with --disk_cache= empty
    # the only cache a spawn can hit is the remote one.
    return bool(spawn.get("cacheHit", spawn.get("remoteCacheHit")))


def tally(spawns: list[dict]) -> dict:
    hits = [s for s in spawns if cache_hit(s)]
    local = [s for s in spawns if not cache_hit(s)]
    return {
        "spawns": len(spawns),
        "hits": len(hits),
        "hit_compiles": sum(s.get("mnemonic") in COMPILE_MNEMONICS for s in hits),
        "local_compiles": [s for s in local if s.get("mnemonic") in COMPILE_MNEMONICS],
        "local_other": sorted({s.get("mnemonic", "?") for s in local
                               if s.get("mnemonic") not in COMPILE_MNEMONICS}),
        "uncacheable": sum(not s.get("remoteCacheable", True) for s in spawns
                           if s.get("mnemonic") in COMPILE_MNEMONICS),
    }


def _key_parts(s: dict) -> dict:
    return {
        "command line": s.get("commandArgs", []),
        "environment": {e["name"]: e["value"] for e in s.get("environmentVariables", [])},
        "platform": s.get("platform", {}),
        "inputs": {i["path"]: (i.get("digest") or {}).get("hash", "") for i in s.get("inputs", [])},
    }


def explain_miss(b: dict, a_spawns: list[dict]) -> str:
    """The first part of B's action key that differs from the A spawn with the same outputs."""
    outs = tuple(b.get("listedOutputs", []))
    match = next((a for a in a_spawns if tuple(a.get("listedOutputs", [])) == outs), None)
    if match is None:
        return f"{outs[:1]}: no spawn in A with the same outputs"
    ka, kb = _key_parts(match), _key_parts(b)
    for part in ka:
        if ka[part] == kb[part]:
            continue
        if isinstance(ka[part], dict):
            diff = sorted(k for k in set(ka[part]) | set(kb[part])
                          if ka[part].get(k) != kb[part].get(k))
            return f"{outs[0] if outs else '?'}: {part} differ at {diff[:3]}"
        la, lb = ka[part], kb[part]
        i = next((i for i, (x, y) in enumerate(zip(la, lb)) if x != y), min(len(la), len(lb)))
        return (f"{outs[0] if outs else '?'}: {part} differ at argument {i}: "
                f"A {la[i] if i < len(la) else '(none)'!r} vs B {lb[i] if i < len(lb) else '(none)'!r}")
    return f"{outs[0] if outs else '?'}: same key parts in both logs (cache eviction or upload failure?)"


def rmtree(path: Path) -> None:
    # Bazel leaves read-only files and dirs (install base, outputs): make them writable first.
    def onerror(func, p, _exc):
        os.chmod(os.path.dirname(p), stat.S_IRWXU)
        if os.path.isdir(p) and not os.path.islink(p):
            os.chmod(p, stat.S_IRWXU)
        func(p)
    shutil.rmtree(path, onerror=onerror)


def report(rows: list, spawns: dict[str, list[dict]], only: str, head: str) -> int:
    """Print the table; 0 when B ran no compile/link action and A ran some, else 1."""
    print(f"\nRemote cache proof: {TARGET} --//kernel_cache:only={only}, HEAD {head[:12]}, "
          "nginx WebDAV on 127.0.0.1, two clones, two output roots\n")
    print("| checkout | wall s | bazel elapsed s | critical path s | spawns | remote cache hits "
          "| compile/link hits | compile/link run locally | other run locally | cache after |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for name, res, t, blobs, size in rows:
        print(f"| {name} | {res['wall']:.1f} | {res['elapsed']:.1f} | {res['critical']:.1f} "
              f"| {t['spawns']} | {t['hits']} | {t['hit_compiles']} | "
              f"{len(t['local_compiles'])} | {', '.join(t['local_other']) or '-'} | "
              f"{blobs} blobs, {size / 2**20:.1f} MiB |")
    for name, res, *_ in rows:
        print(f"{name}: {res['summary'] or 'no process summary'}")
    a, b = rows[0][2], rows[1][2]
    if not a["local_compiles"]:
        print("FAIL: checkout A compiled nothing locally, so B's hits prove nothing "
              "(was the cache not empty?)")
        return 1
    if b["local_compiles"]:
        print(f"FAIL: checkout B ran {len(b['local_compiles'])} compile/link actions locally "
              f"({a['uncacheable']} of A's were marked not remote-cacheable); first miss: "
              + explain_miss(b["local_compiles"][0], spawns["A"]))
        return 1
    print(f"OK: checkout B ran 0 compile/link actions ({b['hit_compiles']} remote cache hits); "
          f"hit time (B's critical path) {rows[1][1]['critical']:.1f} s against A's "
          f"{rows[0][1]['critical']:.1f} s (Bazel elapsed {rows[1][1]['elapsed']:.1f} s vs "
          f"{rows[0][1]['elapsed']:.1f} s, both including a fresh output root's fetch and analysis)")
    return 0


def clone(work: Path, name: str, head: str) -> tuple[Path, Path]:
    """A fresh clone of HEAD (checkout<name>) and an empty output root (out<name>) under `work`."""
    checkout, out_root = work / f"checkout{name}", work / f"out{name}"
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO_ROOT), str(checkout)], check=True)
    subprocess.run(["git", "-C", str(checkout), "checkout", "--quiet", head], check=True)
    out_root.mkdir()
    return checkout, out_root


def build_args(url: str, only: str, stack_args: Sequence[str], *extra: str) -> list[str]:
    return ["build", TARGET, f"--//kernel_cache:only={only}", *stack_args,
            "--config=remote-cache", f"--remote_cache={url}",
            # Only the remote cache may serve hits: no disk cache from any other rc file.
            "--disk_cache=", "--curses=no", "--color=no", "--show_progress_rate_limit=20", *extra]


def sharing_proof(work: Path, nginx: Nginx, url: str, head: str, only: str, stack_args: Sequence[str],
                  started: list[tuple[Path, Path]]) -> tuple[list, dict[str, list[dict]]]:
    """Build in A, then in B; the table's rows and each checkout's spawns."""
    rows = []
    spawns: dict[str, list[dict]] = {}
    for name in ("A", "B"):
        checkout, out_root = clone(work, name, head)
        exec_log = work / f"exec{name}.json"
        started.append((checkout, out_root))
        res = run_bazel(name, checkout, out_root, build_args(
            url, only, stack_args, f"--execution_log_json_file={exec_log}", "--execution_log_sort=false"))
        spawns[name] = list(read_exec_log(exec_log))
        t = tally(spawns[name])
        blobs, size = nginx.stored()
        rows.append((name, res, t, blobs, size))
        log(f"[{name}] done in {res['wall']:.0f} s: {res['summary'] or 'no process summary'}; "
            f"cache holds {blobs} blobs, {size / 2**20:.1f} MiB")
    return rows, spawns


# --corrupt-blob: B's assemble action runs outside the remote cache, as any consumer that runs
# locally does (a target the cache never saw, a no-remote action): it needs the module .so, which
# the remote cache hit of its link left on the server only (--remote_download_toplevel). A corrupt
# top-level output would not show the trap: Bazel downloads it at the hit, sees the mismatch and
# runs that action locally instead.
LOCAL_CONSUMER = "--modify_execution_info=KernelCacheAssemble=+no-remote-cache"
MISMATCH_RE = re.compile(r"Expected digest '([0-9a-f]{64})/\d+' does not match received digest '([0-9a-f]{64})/\d+'")


def link_output(spawns: list[dict], module: str) -> tuple[str, int]:
    """(sha256, size) of `module`'s .so as checkout A's link action produced (and uploaded) it."""
    for spawn in spawns:
        if spawn.get("mnemonic") != "KernelCacheLink":
            continue
        for out in spawn.get("actualOutputs", []):
            if out.get("path", "").endswith(f"/{module}.so") and out.get("digest"):
                return out["digest"]["hash"], int(out["digest"]["sizeBytes"])
    raise UserError(f"checkout A's execution log has no KernelCacheLink output {module}.so: was it a cache "
                    "hit from an earlier run? (the proof needs an empty cache)")


def sha256_of(path: Path) -> str | None:
    return sha256_file(path) if path.is_file() else None


def corrupt_blob_proof(work: Path, nginx: Nginx, url: str, head: str, only: str, stack_args: Sequence[str],
                       started: list[tuple[Path, Path]]) -> int:
    """A fills the cache; one CAS blob (a module .so) is corrupted on the server; B shows that
    Bazel names its digest and stays failed (retries, --noremote_accept_cached, bazel clean), and
    that each documented recovery rebuilds with the correct bytes. Prints a table; 0 when every
    step ended as expected."""
    module = only.split(",")[0]
    checkout_a, out_a = clone(work, "A", head)
    started.append((checkout_a, out_a))
    exec_log = work / "execA.json"
    run_bazel("A", checkout_a, out_a, build_args(url, only, stack_args, f"--execution_log_json_file={exec_log}",
                                                 "--execution_log_sort=false"))
    digest, size = link_output(list(read_exec_log(exec_log)), module)
    blob = nginx.dir / "store" / "cas" / digest
    good = blob.read_bytes()
    if len(good) != size:
        raise UserError(f"nginx holds {len(good)} bytes for cas/{digest}, A's log says {size}")
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0x01  # same size, one bit: only the digest check can tell
    log(f"corrupting cas/{digest} ({module}.so, {size} bytes) on the server")
    checkout_b, out_b = clone(work, "B", head)
    started.append((checkout_b, out_b))
    so_b = checkout_b / "bazel-bin" / "kernel_cache" / f"{TARGET.split(':')[1]}_aot" / "flashinfer" / "data" / \
        "aot" / module / f"{module}.so"

    def corrupt() -> None:
        blob.write_bytes(bytes(bad))

    def delete_blob() -> None:
        blob.unlink()

    def clean() -> None:
        run_bazel("B", checkout_b, out_b, ["clean"])

    # (what was done, before the build, extra build flags, whether the build must pass)
    steps = [
        ("corrupt blob on the server; build", corrupt, [], False),
        ("build again with --noremote_accept_cached", None, ["--noremote_accept_cached"], False),
        ("RECOVERY: delete cas/<digest> on the server; build", delete_blob, [], True),
        ("corrupt it again; bazel clean; build", lambda: (corrupt(), clean()), [], False),
        ("RECOVERY without server access: bazel clean; build with --noremote_accept_cached", clean,
         ["--noremote_accept_cached"], True),
    ]
    rows = []
    for what, before, extra, must_pass in steps:
        if before is not None:
            before()
        res = run_bazel("B", checkout_b, out_b, build_args(url, only, stack_args, LOCAL_CONSUMER, *extra),
                        check=False)
        named = any((m := MISMATCH_RE.search(line)) and m.group(1) == digest for line in res["lines"])
        retries = sum("retrying the build" in line for line in res["lines"])
        server_ok, b_ok = sha256_of(blob) == digest, sha256_of(so_b) == digest
        ok = (res["rc"] == 0) == must_pass and (not must_pass or (server_ok and b_ok)) and (must_pass or named)
        rows.append((what, res, named, retries, server_ok, b_ok, must_pass, ok))
        log(f"[B] {what}: exit {res['rc']}, digest named: {named}, server blob correct: {server_ok}")

    print(f"\nCorrupt CAS blob: {TARGET} --//kernel_cache:only={only} {' '.join(stack_args)}, HEAD {head[:12]}; "
          f"cas/{digest} ({module}.so, {size} bytes) with one bit flipped on the nginx server; checkout B "
          f"builds with {LOCAL_CONSUMER}\n")
    print("| step (checkout B) | exit | Bazel named the digest | build retries | server blob correct "
          "| B's module .so correct | expected | as expected |")
    print("|---|---:|---|---:|---|---|---|---|")
    for what, res, named, retries, server_ok, b_ok, must_pass, ok in rows:
        print(f"| {what} | {res['rc']} | {'yes' if named else 'no'} | {retries} | {'yes' if server_ok else 'no'} | "
              f"{'yes' if b_ok else 'no'} | {'passes' if must_pass else 'fails'} | {'yes' if ok else 'NO'} |")
    if not all(row[-1] for row in rows):
        print("FAIL: a step did not end as expected (see the table)")
        return 1
    print("OK: Bazel detects the corrupt blob and names its digest, but neither its retries, "
          "--noremote_accept_cached nor bazel clean get past it; deleting the blob on the server (or, without "
          "server access, bazel clean plus one build with --noremote_accept_cached) rebuilds it with the "
          "correct bytes, on the server too")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m tools.bench.remote_cache",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="kernel-cache modules to build (--//kernel_cache:only); default "
                    "silu_and_mul,norm, with --corrupt-blob silu_and_mul")
    ap.add_argument("--stack", choices=("default", "pypi"), default="default",
                    help="the stack to build (pypi: --config=pypi, no FlashInfer #4460 mirror needed)")
    ap.add_argument("--corrupt-blob", action="store_true",
                    help="corrupt one CAS blob on the server and prove detection and the documented recovery")
    ap.add_argument("--keep", action="store_true", help="keep the temp dirs (clones, logs, store)")
    ap.add_argument("--work", type=Path, help="parent of the temp dir (default: /tmp)")
    args = ap.parse_args(argv)
    default_only = "silu_and_mul" if args.corrupt_blob else "silu_and_mul,norm"
    only = ",".join(m.strip() for m in (args.only or default_only).split(",") if m.strip())
    if not only:
        raise UserError("--only is empty: name modules, e.g. --only silu_and_mul,norm "
                        "(the whole plan takes hours on a small host)")
    stack_args = ["--config=pypi"] if args.stack == "pypi" else []
    if not (REPO_ROOT / ".git").exists():
        raise UserError(f"{REPO_ROOT} is not a git checkout: the proof clones HEAD; run it from one")
    head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()

    if subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
                      check=True, capture_output=True, text=True).stdout.strip():
        log(f"note: uncommitted changes in {REPO_ROOT} are not part of the proof (it clones HEAD)")

    work = Path(tempfile.mkdtemp(prefix="kimi-k3-remote-cache-",
                                 dir=str(args.work) if args.work else "/tmp"))
    nginx = Nginx(work)
    started: list[tuple[Path, Path]] = []  # (checkout, output root) with a Bazel server
    try:
        url = nginx.start()
        log(f"nginx {url} (storage {nginx.dir}/store); clones of HEAD {head[:12]} in {work}")
        if args.corrupt_blob:
            return corrupt_blob_proof(work, nginx, url, head, only, stack_args, started)
        rows, spawns = sharing_proof(work, nginx, url, head, only, stack_args, started)
    finally:
        for checkout, out_root in started:
            subprocess.run([str(checkout / "tools" / "bazel"), "shutdown"], cwd=checkout,
                           env=bazel_env(out_root), stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        nginx.stop()
        if args.keep:
            log(f"kept {work}")
        else:
            rmtree(work)

    return report(rows, spawns, only, head)


if __name__ == "__main__":
    sys.exit(run_cli(main))
