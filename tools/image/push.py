"""Push an OCI image layout by digest, verify it, then tag it.

Usage:
    python3 -m tools.image.push --layout DIR [--repository HOST[:PORT]/PATH] [--tag T]... [--authfile F]
    python3 -m tools.image.push --stop-local-registry

Steps, each a guarantee:
1. Blob existence is probed with the registry API (HEAD /v2/<repo>/blobs/<digest>) to report how
   many bytes must be uploaded; skopeo skips those same blobs.
2. `skopeo copy --preserve-digests oci:DIR docker://REPO@sha256:M` pushes blobs and the manifest
   by digest only (no tag yet). --preserve-digests makes skopeo fail rather than re-encode.
3. `skopeo inspect --raw` reads the manifest back; its sha256 must equal M.
4. Only then each tag is written (skopeo copy REPO@M -> REPO:T) and read back the same way.
A push that dies in step 2 leaves blobs but no tag; rerunning uploads only what is missing.

Credentials: --authfile, else $KIMI_K3_REGISTRY_USERNAME/$KIMI_K3_REGISTRY_PASSWORD (written to a
0600 temp auth file, never on a command line), else skopeo's usual lookup ($REGISTRY_AUTH_FILE,
$XDG_RUNTIME_DIR/containers/auth.json, ~/.docker/config.json). Credentials are never printed.
TLS is verified except for loopback registries (127.0.0.1, localhost, ::1). The API probes send
Authorization only within the registry's scheme+host+port (a redirect to blob storage on another
host drops it), and Basic credentials go to a Bearer token realm only over https (or loopback).

No --repository: a local registry (Debian's docker-registry) on 127.0.0.1 with storage under
${KIMI_K3_CACHE:-${XDG_CACHE_HOME:-~/.cache}/kimi-k3-build}/registry is reused or started, and
left running so the image can be pulled afterwards; `--stop-local-registry` stops it. Starting
and stopping hold a lock beside the storage (registry/registry.lock), so concurrent pushes share
one registry; and pushes of one repository to it take turns, each holding
registry/locks/<repository>.lock from its first probe to its last tag (docker-registry 2.8 rewrites
a repository's link files in place: see local_push_lock). Pushes to another registry take no lock.

Signing keys are checked before anything else: a key or passphrase file others can read, a
malformed key, a wrong passphrase stop the push before a registry starts or a blob is uploaded.
"""
from __future__ import annotations

import argparse
import base64
import binascii
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from tools.common import credentials
from tools.common.cache import cache_root
from tools.common.errors import UserError, run_cli
from tools.common.files import write_bytes_atomic
from tools.image.layout import LABEL_PREFIX, blob_path, read_index_manifest, sha256_digest
from tools.image.profiles import SGLANG_JIT_IMAGE_PATH, SGLANG_JIT_MANIFEST
from tools.image.signing import skopeo

if TYPE_CHECKING:
    from tools.image import attest

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")
USER_ENV, PASSWORD_ENV = "KIMI_K3_REGISTRY_USERNAME", "KIMI_K3_REGISTRY_PASSWORD"
_REPO_RE = re.compile(r"^(?P<host>[A-Za-z0-9.-]+(?::\d+)?|\[[0-9a-f:]+\](?::\d+)?)/(?P<path>[a-z0-9]+(?:[._/-][a-z0-9]+)*)$")
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


# ---------------------------------------------------------------- repository and credentials

@dataclass(frozen=True)
class Repository:
    host: str  # host[:port] as written in references
    path: str

    @property
    def hostname(self) -> str:
        return self.host.rsplit(":", 1)[0] if not self.host.startswith("[") else self.host.split("]")[0] + "]"

    @property
    def loopback(self) -> bool:
        return self.hostname in LOOPBACK_HOSTS

    @property
    def api(self) -> str:
        return f"{'http' if self.loopback else 'https'}://{self.host}/v2/{self.path}"

    def ref(self, suffix: str) -> str:
        return f"docker://{self.host}/{self.path}{suffix}"

    def __str__(self) -> str:
        return f"{self.host}/{self.path}"


def parse_repository(raw: str) -> Repository:
    m = _REPO_RE.match(raw)
    if not m:
        raise UserError(f"--repository {raw!r}: expected HOST[:PORT]/PATH in lower case, "
                        "e.g. registry.example.com/kimi/k3 or 127.0.0.1:5000/kimi-k3")
    return Repository(m.group("host"), m.group("path"))


def _auth_file_candidates() -> list[Path]:
    """The files containers/image reads, in its order."""
    paths = []
    if os.environ.get("REGISTRY_AUTH_FILE"):
        paths.append(Path(os.environ["REGISTRY_AUTH_FILE"]))
    if os.environ.get("XDG_RUNTIME_DIR"):
        paths.append(Path(os.environ["XDG_RUNTIME_DIR"]) / "containers" / "auth.json")
    home = Path(os.path.expanduser("~"))
    paths += [home / ".config" / "containers" / "auth.json", home / ".docker" / "config.json"]
    return paths


def credentials_from_file(path: Path, repo: Repository) -> tuple[str, str] | None:
    """(user, password) for repo from a docker/containers auth file (longest matching key)."""
    try:
        auths = json.loads(path.read_text()).get("auths", {})
    except (OSError, ValueError, AttributeError) as e:
        raise UserError(f"{path}: unreadable auth file ({type(e).__name__}); fix or remove it") from None
    full = f"{repo.host}/{repo.path}"
    keys = [k for k in auths if full == k.split("://")[-1].rstrip("/")
            or full.startswith(k.split("://")[-1].rstrip("/") + "/")]
    for key in sorted(keys, key=len, reverse=True):
        encoded = auths[key].get("auth") if isinstance(auths[key], dict) else None
        if encoded:
            try:
                user, sep, password = base64.b64decode(encoded, validate=True).decode().partition(":")
            except (binascii.Error, ValueError, TypeError):
                sep = ""
            if not sep:
                raise UserError(f"{path}: auths[{key!r}].auth is not base64 of USER:PASSWORD; fix the entry "
                                f"(skopeo login {repo.host} rewrites it) or remove it")
            return user, password
    return None


@dataclass
class Credentials:
    """Where skopeo finds credentials (an auth file path or None = its own lookup) and the
    (user, password) this tool uses for its read-only API probes, if it could find them."""

    authfile: Path | None
    basic: tuple[str, str] | None
    origin: str


def resolve_credentials(repo: Repository, authfile: Path | None, tmpdir: Path) -> Credentials:
    if authfile is not None:
        if not authfile.is_file():
            raise UserError(f"--authfile {authfile}: no such file; pass a docker/containers auth.json")
        return Credentials(authfile, credentials_from_file(authfile, repo), f"--authfile {authfile}")
    user, password = os.environ.get(USER_ENV), os.environ.get(PASSWORD_ENV)
    if user or password:
        if not (user and password):
            raise UserError(f"${USER_ENV}/${PASSWORD_ENV}: set both or neither")
        path = tmpdir / "auth.json"
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"auths": {repo.host: {"auth": token}}}, f)
        return Credentials(path, (user, password), f"${USER_ENV}/${PASSWORD_ENV}")
    for path in _auth_file_candidates():
        if path.is_file():
            basic = credentials_from_file(path, repo)
            if basic:
                return Credentials(None, basic, str(path))
    return Credentials(None, None, "no credentials found")


# ---------------------------------------------------------------- registry API probes

def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme.lower(), (parts.hostname or "").lower(), parts.port


class _SameOriginAuthRedirect(urllib.request.HTTPRedirectHandler):
    """Redirects keep the Authorization header only within one scheme+host+port: registries send
    blob reads to storage or a CDN on another host, which must never see the credentials."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and _origin(newurl) != _origin(req.full_url):
            for name in [k for k in new.headers if k.lower() == "authorization"]:
                del new.headers[name]
        return new


_OPENER = urllib.request.build_opener(_SameOriginAuthRedirect)


def _urlopen(req: urllib.request.Request | str, timeout: float = 30):  # type: ignore[no-untyped-def]
    return _OPENER.open(req, timeout=timeout)


def _is_loopback_url(url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname or ""
    return host in LOOPBACK_HOSTS or f"[{host}]" in LOOPBACK_HOSTS


class RegistryClient:
    """Just enough of the distribution API to ask 'is this blob there?' (Basic and Bearer auth)."""

    def __init__(self, repo: Repository, creds: Credentials) -> None:
        self.repo = repo
        self.creds = creds
        self.authorization: str | None = None

    def _open(self, method: str, url: str) -> int:
        req = urllib.request.Request(url, method=method)
        if self.authorization:
            req.add_header("Authorization", self.authorization)
        try:
            with _urlopen(req) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as e:
            if e.code == 401 and self.authorization is None and self._authenticate(e.headers.get("WWW-Authenticate", "")):
                return self._open(method, url)
            return int(e.code)

    def _authenticate(self, challenge: str) -> bool:
        if self.creds.basic is None and not challenge.lower().startswith("bearer"):
            return False
        scheme, _, params_text = challenge.partition(" ")
        if scheme.lower() == "basic" and self.creds.basic:
            user, password = self.creds.basic
            self.authorization = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
            return True
        if scheme.lower() == "bearer":
            params = dict(re.findall(r'(\w+)="([^"]*)"', params_text))
            realm = params.get("realm")
            if not realm:
                raise UserError(f"{self.repo}: the registry's Bearer challenge names no realm ({challenge!r}); "
                                "fix the registry's token auth setting (realm) or push to another registry")
            # The token request carries the Basic credentials and returns a push token: never
            # over plain http, except to a token service on this machine.
            if urllib.parse.urlsplit(realm).scheme.lower() != "https" and not _is_loopback_url(realm):
                raise UserError(f"{self.repo}: the registry's token realm {realm} is not https; refusing to send "
                                "credentials there; configure an https realm (plain http only on loopback)")
            query = {"service": params.get("service", ""), "scope": f"repository:{self.repo.path}:pull,push"}
            req = urllib.request.Request(realm + "?" + urllib.parse.urlencode(query))
            if self.creds.basic:
                user, password = self.creds.basic
                req.add_header("Authorization", "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode())
            try:
                with _urlopen(req) as resp:
                    body = json.loads(resp.read())
            except (urllib.error.URLError, ValueError):
                return False
            token = body.get("token") or body.get("access_token")
            if token:
                self.authorization = f"Bearer {token}"
                return True
        return False

    def blob_exists(self, digest: str) -> bool | None:
        """True/False, or None when the registry would not say (auth it cannot do)."""
        status = self._open("HEAD", f"{self.repo.api}/blobs/{digest}")
        if status == 200:
            return True
        if status == 404:
            return False
        if status == 401 and self.creds.basic is not None:
            raise UserError(f"{self.repo}: the registry rejected the credentials from {self.creds.origin}; "
                            "fix them (skopeo login, REGISTRY_AUTH_FILE or "
                            f"${USER_ENV}/${PASSWORD_ENV})")
        return None


def tags(repo: Repository, creds: Credentials) -> list[str]:
    """The repository's tags ([] if it has none yet)."""
    client = RegistryClient(repo, creds)
    req_url = f"{repo.api}/tags/list"
    status = client._open("GET", req_url)
    if status != 200:
        return []
    req = urllib.request.Request(req_url)
    if client.authorization:
        req.add_header("Authorization", client.authorization)
    with _urlopen(req) as resp:
        return list(json.loads(resp.read()).get("tags") or [])


# ---------------------------------------------------------------- skopeo

def run_skopeo(args: Sequence[str], repo: Repository, creds: Credentials, what: str) -> bytes:
    """Run skopeo; a failure becomes a UserError naming what failed and how to recover."""
    proc = subprocess.run([skopeo(), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if proc.returncode == 0:
        return proc.stdout
    err = proc.stderr.decode(errors="replace").strip().splitlines()
    last = err[-1] if err else f"exit {proc.returncode}"
    last = re.sub(r'^time="[^"]*" level=\w+ msg="(.*)"$', r"\1", last)
    if "unauthorized" in last or "authentication required" in last or "denied" in last:
        raise UserError(f"{repo}: {what} was refused by the registry (credentials from {creds.origin}): "
                        f"{last}; fix the credentials (skopeo login, REGISTRY_AUTH_FILE or "
                        f"${USER_ENV}/${PASSWORD_ENV})")
    raise UserError(f"{repo}: {what} failed: {last}; no tag was written; rerun the push "
                    "(blobs already uploaded are skipped)")


def tls_args(repo: Repository, flag: str) -> list[str]:
    # Only loopback registries may skip TLS verification; everything else is verified.
    return [f"--{flag}=false"] if repo.loopback else [f"--{flag}=true"]


def auth_args(creds: Credentials, flag: str) -> list[str]:
    return [f"--{flag}", str(creds.authfile)] if creds.authfile else []


def remote_manifest_digest(repo: Repository, suffix: str, creds: Credentials) -> str:
    raw = run_skopeo(["inspect", "--raw", *tls_args(repo, "tls-verify"), *auth_args(creds, "authfile"),
                      repo.ref(suffix)], repo, creds, f"reading back {suffix}")
    return sha256_digest(raw)


# ---------------------------------------------------------------- local registry

@dataclass(frozen=True)
class RegistryProcess:
    pid: int
    port: int
    root: Path

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def registry_ready(port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=1)
            return True
        except urllib.error.HTTPError:
            return True  # 401 from an auth-enabled registry still means it is serving
        except (urllib.error.URLError, OSError):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)


def start_registry(root: Path, port: int | None = None, htpasswd: Path | None = None) -> RegistryProcess:
    """Start Debian's docker-registry serving `root`/data on 127.0.0.1 (config in `root`)."""
    exe = shutil.which("docker-registry")
    if exe is None:
        raise UserError("docker-registry: not on PATH; install it (apt-get install -y docker-registry)")
    root.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    auth = (f"auth:\n  htpasswd:\n    realm: kimi-k3\n    path: {htpasswd}\n" if htpasswd else "")
    config = (f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {root / 'data'}\n"
              f"  delete:\n    enabled: true\nhttp:\n  addr: 127.0.0.1:{port}\n{auth}")
    (root / "config.yml").write_text(config)
    log = open(root / "registry.log", "ab")
    proc = subprocess.Popen([exe, "serve", str(root / "config.yml")], stdout=log, stderr=log,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    if not registry_ready(port, 10):
        proc.kill()
        raise UserError(f"docker-registry on 127.0.0.1:{port} did not start; see {root / 'registry.log'}")
    return RegistryProcess(proc.pid, port, root)


def stop_registry(reg: RegistryProcess) -> None:
    """Stop a registry this process started (and reap it, so no zombie is left)."""
    try:
        os.kill(reg.pid, signal.SIGTERM)
        os.waitpid(reg.pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie or a reused pid is not our registry
        return "docker-registry" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


@contextmanager
def _registry_lock(root: Path) -> Iterator[None]:
    """Exclusive lock beside the storage: the check-start-record sequence of one push (or a stop)
    runs alone, so concurrent pushes share one registry instead of each starting their own on
    the same storage and rewriting its config."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "registry.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


@contextmanager
def local_push_lock(root: Path, repo: Repository) -> Iterator[None]:
    """One push of `repo` at a time to the local registry whose storage is under `root`, for the
    whole probe, upload, attachments and tags. docker-registry 2.8's filesystem storage rewrites a
    repository's link files in place (truncate, then write): a push reading a manifest or tag back
    while another push of the same repository rewrote that link read a cut digest (HTTP 500
    "invalid checksum digest format"). A push that must wait says so, naming the holder's pid
    (written into the lock file). Lock files stay: deleting one would race a waiter."""
    path = root / "locks" / f"{repo.path.replace('/', '+')}.lock"  # '+' is in no repository path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "?"
            print(f"[oci_push] waiting for another push of {repo} (pid {holder})", file=sys.stderr)
            fcntl.flock(f, fcntl.LOCK_EX)
        f.truncate(0)
        f.write(f"{os.getpid()}\n")
        f.flush()
        yield


def local_registry_root(repo: Repository) -> Path | None:
    """The local registry's root when --repository names it (its pushes take turns too), else None."""
    root = cache_root() / "registry"
    recorded = _recorded_registry(root)
    if recorded and repo.host in (f"127.0.0.1:{recorded[1]}", f"localhost:{recorded[1]}"):
        return root
    return None


def _recorded_registry(root: Path) -> tuple[int, int] | None:
    try:
        info = json.loads((root / "state.json").read_text())
        return int(info["pid"]), int(info["port"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def local_registry() -> RegistryProcess:
    """The user's cached local registry: reused when its recorded pid still serves, else started."""
    root = cache_root() / "registry"
    with _registry_lock(root):
        recorded = _recorded_registry(root)
        if recorded and _pid_alive(recorded[0]) and registry_ready(recorded[1], 1):
            return RegistryProcess(recorded[0], recorded[1], root)
        reg = start_registry(root)
        write_bytes_atomic(root / "state.json", json.dumps({"pid": reg.pid, "port": reg.port}).encode() + b"\n")
    print(f"started local registry {reg.host} (pid {reg.pid}, storage {root / 'data'}); it keeps running; "
          f"stop it with: python3 -m tools.image.push --stop-local-registry", file=sys.stderr)
    return reg


def stop_local_registry() -> int:
    root = cache_root() / "registry"
    if not (root / "state.json").is_file():
        print("no local registry recorded", file=sys.stderr)
        return 0
    with _registry_lock(root):
        recorded = _recorded_registry(root)
        if recorded and _pid_alive(recorded[0]):
            os.kill(recorded[0], signal.SIGTERM)
            deadline = time.monotonic() + 10
            while _pid_alive(recorded[0]):
                if time.monotonic() > deadline:
                    raise UserError(f"local registry pid {recorded[0]} did not stop within 10 s of SIGTERM; "
                                    f"stop it with: kill -9 {recorded[0]}")
                time.sleep(0.05)
            print(f"stopped local registry pid {recorded[0]}", file=sys.stderr)
        (root / "state.json").unlink(missing_ok=True)
    return 0


# ---------------------------------------------------------------- push

@dataclass(frozen=True)
class PushResult:
    reference: str
    manifest_digest: str
    config_digest: str
    index_digest: str
    blobs_total: int
    blobs_uploaded: int | None
    bytes_uploaded: int | None
    tags: tuple[str, ...]


def layout_blobs(layout: Path) -> tuple[str, str, str, list[tuple[str, int]]]:
    """(manifest digest, config digest, index digest, [(blob digest, size)]) of a layout."""
    desc, manifest_bytes = read_index_manifest(layout)
    manifest = json.loads(manifest_bytes)
    blobs = [(manifest["config"]["digest"], int(manifest["config"]["size"]))]
    blobs += [(l["digest"], int(l["size"])) for l in manifest["layers"]]
    for digest, size in blobs:
        path = blob_path(layout, digest)
        if not path.is_file() or path.stat().st_size != size:
            raise UserError(f"{layout}: blob {digest} missing or wrong size; rebuild the layout")
    index_digest = sha256_digest((layout / "index.json").read_bytes())
    return desc["digest"], manifest["config"]["digest"], index_digest, blobs


@dataclass(frozen=True)
class Attestations:
    """What push attaches beside the digest before tagging (tools/image/attest.py)."""

    sbom: Path
    statement: Callable[[str], dict]  # manifest digest -> the provenance statement
    signer: "attest.Signer"
    sbom_cyclonedx: Path | None = None


def push(layout: Path, repo: Repository, tag_names: Sequence[str], authfile: Path | None = None,
         attestations: Attestations | None = None, local_root: Path | None = None) -> PushResult:
    """local_root: the storage root of the local registry `repo` is on (local_registry()), whose
    pushes of one repository take turns (local_push_lock); None for any other registry."""
    for t in tag_names:
        if not _TAG_RE.match(t):
            raise UserError(f"--tag {t!r}: not a valid tag ([A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}})")
    manifest_digest, config_digest, index_digest, blobs = layout_blobs(layout)
    if attestations is not None:
        from tools.image import attest
        attest.signer_keys(attestations.signer)  # a bad key stops the push before any upload
    turn = local_push_lock(local_root, repo) if local_root is not None else nullcontext()
    with tempfile.TemporaryDirectory(prefix="kimi-k3-push.") as tmp, turn:
        creds = resolve_credentials(repo, authfile, Path(tmp))
        client = RegistryClient(repo, creds)
        try:
            present = [client.blob_exists(d) for d, _ in blobs]
        except (urllib.error.URLError, OSError) as e:
            raise UserError(f"{repo}: registry unreachable ({e}); start it or fix --repository") from e
        known = None not in present
        missing = [(d, s) for (d, s), p in zip(blobs, present) if p is False]
        bytes_up = sum(s for _, s in missing) if known else None
        print(f"[oci_push] {repo}: {len(missing) if known else '?'} of {len(blobs)} blobs to upload"
              f" ({bytes_up if known else '?'} bytes)", file=sys.stderr)
        started = time.monotonic()
        run_skopeo(["copy", "--preserve-digests", *tls_args(repo, "dest-tls-verify"),
                    *auth_args(creds, "dest-authfile"), f"oci:{layout}", repo.ref("@" + manifest_digest)],
                   repo, creds, "pushing the manifest by digest")
        print(f"[oci_push] uploaded in {time.monotonic() - started:.1f} s", file=sys.stderr)
        remote = remote_manifest_digest(repo, "@" + manifest_digest, creds)
        if remote != manifest_digest:
            raise UserError(f"{repo}: registry returned manifest {remote}, expected {manifest_digest}; "
                            "no tag written; the registry rewrote the manifest")
        if attestations is not None:
            # Before any tag: whoever pulls a tag finds the attachments already beside its digest.
            attest.attach(attest.Registry(repo, creds, Path(tmp)), manifest_digest, attestations.sbom.read_bytes(),
                          attestations.statement(manifest_digest), attestations.signer,
                          lambda line: print(line, file=sys.stderr),
                          attestations.sbom_cyclonedx.read_bytes() if attestations.sbom_cyclonedx else None)
        write_tags(repo, creds, manifest_digest, tag_names)
    return PushResult(reference=f"{repo}@{manifest_digest}", manifest_digest=manifest_digest,
                      config_digest=config_digest, index_digest=index_digest, blobs_total=len(blobs),
                      blobs_uploaded=len(missing) if known else None, bytes_uploaded=bytes_up,
                      tags=tuple(tag_names))


def write_tags(repo: Repository, creds: Credentials, manifest_digest: str, tag_names: Sequence[str]) -> None:
    """Each tag onto the pushed digest, read back."""
    for t in tag_names:
        run_skopeo(["copy", "--preserve-digests", *tls_args(repo, "src-tls-verify"),
                    *tls_args(repo, "dest-tls-verify"), *auth_args(creds, "src-authfile"),
                    *auth_args(creds, "dest-authfile"), repo.ref("@" + manifest_digest), repo.ref(":" + t)],
                   repo, creds, f"tagging {t}")
        if remote_manifest_digest(repo, ":" + t, creds) != manifest_digest:
            raise UserError(f"{repo}:{t}: tag does not point at {manifest_digest} after tagging; "
                            "someone else pushed the tag concurrently; rerun")


def print_result(r: PushResult) -> None:
    print(f"manifest digest: {r.manifest_digest}")
    print(f"config digest:   {r.config_digest}")
    print(f"index digest:    {r.index_digest}")
    print(f"pushed:          {r.reference}")
    print(f"uploaded:        {r.blobs_uploaded if r.blobs_uploaded is not None else '?'} of {r.blobs_total} blobs, "
          f"{r.bytes_uploaded if r.bytes_uploaded is not None else '?'} bytes")
    repo = r.reference.split("@")[0]
    for t in r.tags:
        print(f"tagged:          {repo}:{t}")


LAYER_ANNOTATION = LABEL_PREFIX + "layer"  # how tools/image/layout.py names each layer
# The manifests of the layers of compiled modules: layer name -> (the manifest's path in the
# layer, how each module's sha256 is read from it, what a printed line calls the module).
_MODULE_MANIFESTS = {
    "kernel_cache": ("flashinfer/data/aot/kernel_cache.json",
                     lambda data: {m: v["sha256"] for m, v in data.get("modules", {}).items()}, "kernel module"),
    "sglang_jit": (f"{SGLANG_JIT_IMAGE_PATH.lstrip('/')}/{SGLANG_JIT_MANIFEST}",
                   lambda data: {m["module"]: m["so_sha256"] for m in data.get("modules", [])}, "sglang-jit module"),
}


def image_layers(layout: Path) -> list[tuple[str, str, int]]:
    """[(layer name, digest, size)] of a layout, bottom first."""
    _, manifest_bytes = read_index_manifest(layout)
    return [(l.get("annotations", {}).get(LAYER_ANNOTATION, "?"), l["digest"], int(l["size"]))
            for l in json.loads(manifest_bytes)["layers"]]


def layer_json(layout: Path, digest: str, path: str) -> dict | None:
    """The JSON file at `path` (a suffix of its path in the image) in the layer blob `digest`."""
    from tools.image.compression import open_layer_blob
    with open_layer_blob(blob_path(layout, digest)) as tar:
        for member in tar:
            if member.isfile() and member.name.lstrip("./").endswith(path):
                return json.loads(tar.extractfile(member).read())  # type: ignore[union-attr]
    return None


def image_contents(layout: Path) -> tuple[list[tuple[str, str, int]], dict[str, dict[str, str]]]:
    """([(layer name, digest, size)], {layer name: {module: sha256}}) of a layout: what a user
    compares with another machine's build (docs/DIGESTS.md) to find the layer, and inside a layer
    of compiled modules (FlashInfer's kernel cache, SGLang's JIT modules) the module, whose bytes
    differ."""
    layers = image_layers(layout)
    modules: dict[str, dict[str, str]] = {}
    for name, digest, _ in layers:
        if name in _MODULE_MANIFESTS:
            path, read, _ = _MODULE_MANIFESTS[name]
            data = layer_json(layout, digest, path)
            if data is not None:
                modules[name] = dict(sorted(read(data).items()))
    return layers, modules


def kernel_selection(layout: Path) -> str:
    """The kernel selection the image's kernel cache was built from ("" without a kernel cache)."""
    for name, digest, _ in image_layers(layout):
        if name == "kernel_cache":
            return str((layer_json(layout, digest, _MODULE_MANIFESTS[name][0]) or {}).get("selection", ""))
    return ""


def print_contents(layout: Path) -> None:
    layers, modules = image_contents(layout)
    for name, digest, size in layers:
        print(f"layer {name:<13} {digest} {size} bytes")
    for layer, found in modules.items():
        for name, sha in found.items():
            print(f"{_MODULE_MANIFESTS[layer][2]} {name:<24} sha256:{sha}")


def default_repository_path(layout: Path) -> str:
    try:
        desc, manifest_bytes = read_index_manifest(layout)
        config_digest = json.loads(manifest_bytes)["config"]["digest"]
        labels = json.loads(blob_path(layout, config_digest).read_bytes()).get("config", {}).get("Labels") or {}
        stack = labels.get("org.kimi-k3.stack", "image")
    except (OSError, ValueError, KeyError):
        stack = "image"
    return f"kimi-k3/{re.sub(r'[^a-z0-9._-]', '-', stack.lower())}"


SIGN_KEY_ENV, SIGN_PASSPHRASE_ENV = "KIMI_K3_SIGNING_KEY", "KIMI_K3_SIGNING_PASSPHRASE_FILE"


def attestations_from_args(args: argparse.Namespace) -> Attestations | None:
    if args.sbom is None:
        return None
    from tools.common.cliargs import named_paths
    from tools.image import attest
    from tools.pins import lock as lockfile

    for flag, path in (("--sbom", args.sbom), ("--sbom-cyclonedx", args.sbom_cyclonedx)):
        if path is not None and not path.is_file():
            raise UserError(f"{flag} {path}: no such file; pass the image SBOM (//image:image_sbom)")
    if not args.stack or args.lock is None:
        raise UserError("--sbom needs --stack and --lock (the provenance records them)")
    signer = signer_from_args(args)
    locks = dict(named_paths(args.provenance_lock, "--provenance-lock", form="WORKSPACE_PATH=FILE"))
    gates = dict(named_paths(args.gate_manifest, "--gate-manifest"))
    lock = lockfile.load(args.lock)
    workspace = args.workspace or Path(os.environ.get("BUILD_WORKSPACE_DIRECTORY", "."))
    source = attest.workspace_source(workspace)
    selection = args.kernel_selection or kernel_selection(args.layout)

    def statement(digest: str) -> dict:
        return attest.provenance_statement(manifest_digest=digest, stack=args.stack,
                                           kernel_selection=selection, locks=locks,
                                           toolchain_pins=attest.toolchain_pins(lock), gate_manifests=gates,
                                           sbom=args.sbom, source=source, sbom_cyclonedx=args.sbom_cyclonedx)
    return Attestations(args.sbom, statement, signer, args.sbom_cyclonedx)


def signer_from_args(args: argparse.Namespace) -> "attest.Signer":
    """The key pair and passphrase file of the flags, else of the environment, else the local key;
    checked here, before a registry starts: a secret others can read, a malformed key, a wrong
    passphrase, a mixed-up pair."""
    from tools.image import attest, signing

    key = args.sign_key or (Path(os.environ[SIGN_KEY_ENV]) if os.environ.get(SIGN_KEY_ENV) else None)
    passphrase = args.sign_passphrase_file or (
        Path(os.environ[SIGN_PASSPHRASE_ENV]) if os.environ.get(SIGN_PASSPHRASE_ENV) else None)
    if key is None and passphrase is None:
        key, passphrase, public = signing.local_key()
    elif key is None or passphrase is None:
        raise UserError(f"--sign-key and --sign-passphrase-file (${SIGN_KEY_ENV}, ${SIGN_PASSPHRASE_ENV}) go "
                        "together: pass both, or neither for the local key")
    else:
        public = Path(str(key).removesuffix(signing.PRIVATE_SUFFIX) + signing.PUBLIC_SUFFIX)
        if not public.is_file():
            raise UserError(f"--sign-key {key}: no {public.name} beside it; keep the key pair together")
    signer = attest.Signer(key, passphrase, public)
    attest.signer_keys(signer)
    return signer


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layout", type=Path, help="OCI image layout from tools/image/layout.py")
    p.add_argument("--repository", help="HOST[:PORT]/PATH; default: a local registry on 127.0.0.1")
    p.add_argument("--tag", action="append", default=[], help="tags to apply after the digest is verified")
    p.add_argument("--authfile", type=Path, help="docker/containers auth file")
    p.add_argument("--stop-local-registry", action="store_true", help="stop the registry this tool started")
    a = p.add_argument_group("attachments (tools/image/attest.py): SBOM, signed provenance, signature")
    a.add_argument("--sbom", type=Path, help="the image's SBOM (tools/image/image_sbom.py); attach all three")
    a.add_argument("--sbom-cyclonedx", type=Path, help="the same SBOM as CycloneDX, attached beside it")
    a.add_argument("--stack", help="the image's stack (provenance)")
    a.add_argument("--kernel-selection", default="", help="the kernel cache's selection (provenance; default: "
                   "the one the image's kernel_cache.json names)")
    a.add_argument("--lock", type=Path, help="pins.lock.json (its toolchains go into the provenance)")
    a.add_argument("--provenance-lock", action="append", default=[], metavar="WORKSPACE_PATH=FILE",
                   help="a lock file the provenance records by digest, under its workspace path")
    a.add_argument("--gate-manifest", action="append", default=[], metavar="NAME=FILE")
    a.add_argument("--workspace", type=Path, help="the checkout built from (default: $BUILD_WORKSPACE_DIRECTORY)")
    a.add_argument("--sign-key", type=Path, help=f"PREFIX.private (default: ${SIGN_KEY_ENV}, else a local key "
                   "generated under the cache root)")
    a.add_argument("--sign-passphrase-file", type=Path, help=f"its passphrase (default: ${SIGN_PASSPHRASE_ENV})")
    args = p.parse_args(argv)
    credentials.restore()  # the proxies' credentials, which tools/bazel keeps out of Bazel
    if args.stop_local_registry:
        return stop_local_registry()
    if args.layout is None:
        raise UserError("--layout: required; pass the OCI layout directory to push")
    attestations = attestations_from_args(args)  # its keys are checked before a registry starts
    if args.repository:
        repo = parse_repository(args.repository)
        local_root = local_registry_root(repo)
    else:
        reg = local_registry()
        repo, local_root = Repository(reg.host, default_repository_path(args.layout)), reg.root
    print_result(push(args.layout, repo, args.tag, args.authfile, attestations, local_root))
    print_contents(args.layout)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
