"""Where pinned bytes come from, in order: the cache, each mirror directory, each origin URL.

A source with the wrong size or bytes is reported and skipped, and no source is read past the
lock's size (+1 byte, to tell "too long"). Downloads stream into a temp file inside the cache
while hashing, and enter the CAS only after the hash matched.
"""
from __future__ import annotations

import hashlib
import http.client
import os
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Callable, Sequence

from tools.common.errors import UserError
from tools.common.progress import Progress
from tools.fetch.cache import Cache
from tools.pins.lock import FilePin, Pin

CHUNK = 1 << 20
DOWNLOAD_ATTEMPTS = 2
RETRY_DELAY_S = 1.0
USER_AGENT = "kimi-k3-fetch/1"
FILL_MIRROR_HINT = "python3 -m tools.fetch mirror --pin {pin} --mirror DIR"


class _ResolvedOnce:
    """Each host's addresses, looked up once per process and then reused.

    Why: urllib opens a new connection for every download and resolves the host again each
    time. Some resolvers drop a query now and then, and glibc then waits its whole timeout (5 s
    by default) before it asks again, so a Debian set of hundreds of small .debs paid that wait
    many times over (docs/measurements/2026-12-07.md, "Twelfth session"). A lookup that fails is
    not remembered: the next download asks again.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._addresses: dict[tuple[str, int], list[str]] = {}

    def addresses(self, host: str, port: int) -> list[str]:
        with self._lock:
            known = self._addresses.get((host, port))
        if known is None:
            infos = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
            known = list(dict.fromkeys(str(info[4][0]) for info in infos))
            with self._lock:
                self._addresses[(host, port)] = known
        return known

    def create_connection(self, address: tuple[str, int], *args, **kwargs) -> socket.socket:  # type: ignore[no-untyped-def]
        """socket.create_connection to `address` through the remembered addresses, each tried in
        the resolver's order as socket.create_connection does (a numeric address needs no lookup)."""
        host, port = address
        error: OSError | None = None
        for ip in self.addresses(host, port):
            try:
                return socket.create_connection((ip, port), *args, **kwargs)
            except OSError as e:
                error = e
        raise error or OSError(f"{host}: no address")


_RESOLVED_ONCE = _ResolvedOnce()


class _HTTPConnection(http.client.HTTPConnection):
    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self._create_connection = _RESOLVED_ONCE.create_connection


class _HTTPSConnection(http.client.HTTPSConnection):
    # TLS still verifies, and names in SNI, the host of the URL (self.host), not the address.
    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self._create_connection = _RESOLVED_ONCE.create_connection


class _HTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, req):  # type: ignore[no-untyped-def]
        return self.do_open(_HTTPConnection, req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def https_open(self, req):  # type: ignore[no-untyped-def]
        # As urllib's own handler passes them (check_hostname exists up to Python 3.11).
        checks = {"check_hostname": self._check_hostname} if hasattr(self, "_check_hostname") else {}
        return self.do_open(_HTTPSConnection, req, context=self._context, **checks)


def _opener() -> urllib.request.OpenerDirector:
    """urlopen's defaults otherwise (redirects, TLS checks, and the proxies of the environment as
    it is now: the CLIs put the proxies' credentials back into it after this module is imported)."""
    return urllib.request.build_opener(_HTTPHandler, _HTTPSHandler)


def mirror_dirs(flags: Sequence[str]) -> list[Path]:
    """--mirror flags first, then $KIMI_K3_MIRROR (colon-separated), each once."""
    env = [p for p in os.environ.get("KIMI_K3_MIRROR", "").split(":") if p]
    return [Path(p) for p in dict.fromkeys([*flags, *env])]


class SourceFailed(Exception):
    """A source could not deliver (absent, unreachable, unreadable, truncated, wrong bytes): try
    the next one. `transient` failures (dropped connection, timeout) are worth one more attempt;
    `corrupt` ones (the source has the file, but wrong bytes or a wrong size) and `unreadable`
    ones (it is there, but this user may not read it) are reported as they happen."""

    def __init__(self, message: str, *, transient: bool = False, corrupt: bool = False,
                 unreadable: bool = False) -> None:
        super().__init__(message)
        self.transient = transient
        self.corrupt = corrupt
        self.unreadable = unreadable


def evict_command(pin: Pin) -> str:
    return f"python3 -m tools.fetch evict --pin {pin.name}"


def hash_mismatch(expected: str, actual: str, source: str) -> SourceFailed:
    # Not fatal by itself: a later mirror or the origin may hold the right bytes.
    return SourceFailed(f"{source}: sha256 mismatch: expected {expected}, actual {actual}", corrupt=True)


def note_failure(pin_name: str, error: SourceFailed, failures: list[str]) -> bool:
    """Record a failed source for the final error; a corrupt or unreadable one is also reported
    now, since the fetch may still succeed from the next source. Returns whether it was corrupt."""
    failures.append(str(error))
    if error.corrupt or error.unreadable:
        print(f"fetch {pin_name}: warning: {error}; skipping this source", file=sys.stderr, flush=True)
    return error.corrupt


def copy_stream_verified(src: IO[bytes], dst: IO[bytes], progress: Progress, limit: int | None,
                         write_failed: Callable[[OSError], Exception]) -> tuple[str, int]:
    """Copy `src` to `dst` hashing on the way; returns (sha256 hex, byte count). With `limit`
    (the lock's size) it stops after limit + 1 bytes: an endless or oversized body then costs
    one byte more than the pin, not the disk, and the count says it was too long. An OSError
    reading `src` propagates (the source's failure); one writing `dst` (a full disk) raises
    write_failed(error) instead, so no caller can take it for the source's."""
    digest = hashlib.sha256()
    size = 0
    while True:
        want = CHUNK if limit is None else min(CHUNK, limit + 1 - size)
        if want <= 0:
            break
        chunk = src.read(want)
        if not chunk:
            break
        digest.update(chunk)
        try:
            dst.write(chunk)
        except OSError as e:
            raise write_failed(e) from None
        size += len(chunk)
        progress.advance(len(chunk))
    try:
        dst.flush()
        os.fsync(dst.fileno())
    except OSError as e:
        raise write_failed(e) from None
    return digest.hexdigest(), size


def unreadable_mirror_file(path: Path, error: OSError) -> SourceFailed:
    return SourceFailed(f"mirror file {path}: cannot read it ({error.strerror or error}: make it and {path.parent} "
                        "readable for this user, or drop that mirror)", unreadable=True)


def check_size(expected: int | None, actual: int, source: str) -> None:
    if expected is None or actual == expected:
        return
    if actual > expected:  # copy_stream_verified stopped at expected + 1
        raise SourceFailed(f"{source}: more than {expected} bytes, the lock's size (stopped reading; wrong file)",
                           corrupt=True)
    raise SourceFailed(f"{source}: got {actual} bytes, the lock says {expected} (truncated or wrong file)",
                       corrupt=True)


def from_mirror_file(cache: Cache, key: str, name: str, sha256: str, size: int | None, path: Path) -> Path:
    source = f"mirror file {path}"
    try:
        if not path.is_file():
            raise SourceFailed(f"mirror {path.parent}: no {path.name}")
        on_disk = path.stat().st_size
        if size is not None and on_disk != size:
            raise SourceFailed(f"{source}: {on_disk} bytes, the lock says {size} (truncated or wrong file)",
                               corrupt=True)
        src = open(path, "rb")
    except OSError as e:  # e.g. a directory or file this user may not read: the next source may do
        raise unreadable_mirror_file(path, e) from None
    with src, cache.temp_file(key) as (tmp, out):
        progress = Progress(f"fetch {name}", on_disk)
        try:
            actual, got = copy_stream_verified(src, out, progress, size, lambda e: cache.write_failed(e, tmp))
        except OSError as e:  # reading: writes raise write_failed's UserError
            raise unreadable_mirror_file(path, e) from None
        check_size(size, got, source)
        if actual != sha256:
            raise hash_mismatch(sha256, actual, source)
        progress.finish(f"copied from {path}:")
        return cache.commit(tmp, sha256)


def from_url(cache: Cache, key: str, name: str, sha256: str, size: int | None, url: str, timeout: float) -> Path:
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
    with cache.temp_file(key) as (tmp, out):
        try:
            # The opener honours the https_proxy/no_proxy environment like every urllib client.
            with _opener().open(request, timeout=timeout) as response:
                announced = response.headers.get("Content-Length")
                if size is not None and announced and announced.isdigit() and int(announced) > size:
                    # Refused before the body: it cannot be the pinned file.
                    raise SourceFailed(f"{url}: Content-Length {announced} is more than {size} bytes, the lock's "
                                       "size (wrong file; not downloaded)", corrupt=True)
                total = int(announced) if announced and announced.isdigit() else size
                progress = Progress(f"fetch {name}", total)
                # A failed write (a full disk) is a UserError, not an OSError: never a network error.
                actual, got = copy_stream_verified(response, out, progress, size,
                                                   lambda e: cache.write_failed(e, tmp))
        except urllib.error.HTTPError as e:
            raise SourceFailed(f"{url}: HTTP {e.code} {e.reason}") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            # A refused connection or an unknown host is final; a lookup the resolver could not
            # answer this time (EAI_AGAIN) is worth the second attempt like a dropped connection.
            refused = isinstance(reason, ConnectionRefusedError) or (
                isinstance(reason, socket.gaierror) and reason.errno != socket.EAI_AGAIN)
            raise SourceFailed(f"{url}: {reason}", transient=not refused) from None
        # http.client returns a short body as a clean EOF, so compare with Content-Length here:
        # a dropped connection must read as "truncated", not as a (misleading) hash mismatch.
        if announced and announced.isdigit() and got != int(announced):
            raise SourceFailed(f"{url}: connection closed after {got} of {announced} bytes", transient=True)
        check_size(size, got, url)
        if actual != sha256:
            raise hash_mismatch(sha256, actual, url)
        progress.finish(f"downloaded from {url}:")
        return cache.commit(tmp, sha256)


REPIN_HINT = "re-pin with `python3 -m tools.pins.pypi add-pypi` or `python3 -m tools.fetch add-git-diff`"


def unavailable(pin: Pin, failures: Sequence[str], corrupt: bool = False, *, fill_hint: str | None = None,
                repin_hint: str | None = None) -> UserError:
    """The one-line error when no source delivered `pin`. Callers whose pins live in another lock
    (tools.fetch.debian: the Debian lock) pass their own mirror-fill and re-pin commands."""
    tried = "; ".join(failures) if failures else "no mirror and no origin URL"
    bad = (f"; a source served wrong bytes: fix or remove it, or if every source agrees the lock is wrong "
           f"({repin_hint or REPIN_HINT})") if corrupt else ""
    if not corrupt and repin_hint and any(": HTTP 404 " in f or ": HTTP 410 " in f for f in failures):
        # e.g. Debian drops superseded versions from its pool
        bad = f"; the origin no longer has it: {repin_hint}, or use a mirror filled while it was there"
    fill = fill_hint or FILL_MIRROR_HINT.format(pin=pin.name)
    return UserError(f"pin '{pin.name}': no source delivered it ({tried}){bad}; check the network/proxy, or fill a "
                     f"mirror on a connected host with `{fill}` and pass --mirror DIR or KIMI_K3_MIRROR=DIR")


def fetch_file_pin(pin: FilePin, cache: Cache, mirrors: Sequence[Path], timeout: float, *,
                   fill_hint: str | None = None, repin_hint: str | None = None) -> Path:
    """The verified CAS entry of `pin`: the cache, then each mirror (`<mirror>/<filename>`), then
    each URL. `fill_hint`/`repin_hint` replace the commands the error names (see unavailable)."""
    what = f"pin '{pin.name}'"
    # `evict --sha256` works for pins of any lock; `--pin` only for pins.lock.json's own.
    evict_hint = evict_command(pin) if fill_hint is None else f"python3 -m tools.fetch evict --sha256 {pin.sha256}"
    hit = cache.verified_entry(pin.sha256, what, evict_hint)
    if hit:
        return hit
    with cache.locked(pin.sha256):
        # Another process may have filled the entry while we waited for the lock.
        hit = cache.verified_entry(pin.sha256, what, evict_hint)
        if hit:
            return hit
        cache.clean_stale_temps(pin.sha256)
        failures: list[str] = []
        corrupt = False
        for mirror in mirrors:
            try:
                return from_mirror_file(cache, pin.sha256, pin.name, pin.sha256, pin.size, mirror / pin.filename)
            except SourceFailed as e:
                corrupt |= note_failure(pin.name, e, failures)
        for url in pin.urls:
            for attempt in range(1, DOWNLOAD_ATTEMPTS + 1):
                try:
                    return from_url(cache, pin.sha256, pin.name, pin.sha256, pin.size, url, timeout)
                except SourceFailed as e:
                    if not e.transient or attempt == DOWNLOAD_ATTEMPTS:
                        corrupt |= note_failure(pin.name, e, failures)
                        break
                    print(f"fetch {pin.name}: {e}; retrying (attempt {attempt + 1}/{DOWNLOAD_ATTEMPTS})",
                          file=sys.stderr, flush=True)
                    time.sleep(RETRY_DELAY_S)
        raise unavailable(pin, failures, corrupt, fill_hint=fill_hint, repin_hint=repin_hint)
