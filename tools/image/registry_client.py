"""Talking to a registry: a repository reference, its credentials (never printed, never on a
command line), the API probes (blob existence, tags) with Authorization kept within the
registry's origin, and skopeo run against it (TLS verified except on loopback)."""
from __future__ import annotations

import base64
import binascii
import json
import os
import re
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from tools.common.errors import UserError
from tools.common.jsondata import ANY, STRING, MapOf, Object, load_json_file
from tools.image.layout import sha256_digest
from tools.image.signing import skopeo

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")
USER_ENV, PASSWORD_ENV = "KIMI_K3_REGISTRY_USERNAME", "KIMI_K3_REGISTRY_PASSWORD"
_REPO_RE = re.compile(r"^(?P<host>[A-Za-z0-9.-]+(?::\d+)?|\[[0-9a-f:]+\](?::\d+)?)/(?P<path>[a-z0-9]+(?:[._/-][a-z0-9]+)*)$")


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


# What credentials_from_file reads of a docker/containers auth file; the rest is other tools'.
AUTH_FILE = Object({}, optional={"auths": MapOf(Object({}, optional={"auth": STRING}, other=ANY))}, other=ANY)


def credentials_from_file(path: Path, repo: Repository, what: str = "auth file") -> tuple[str, str] | None:
    """(user, password) for repo from a docker/containers auth file (longest matching key)."""
    auths = load_json_file(path, what, AUTH_FILE, "fix or remove it").get("auths", {})
    full = f"{repo.host}/{repo.path}"
    keys = [k for k in auths if full == k.split("://")[-1].rstrip("/")
            or full.startswith(k.split("://")[-1].rstrip("/") + "/")]
    for key in sorted(keys, key=len, reverse=True):
        encoded = auths[key].get("auth")
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
        return Credentials(authfile, credentials_from_file(authfile, repo, "--authfile"), f"--authfile {authfile}")
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

