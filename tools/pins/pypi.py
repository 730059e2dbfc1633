"""Wheel pins from PyPI: add/bump one pin, and lock a stack's whole dependency closure.

    add-pypi      NAME==VERSION [--platform P] [--python X.Y] [--pin-name N] [--index-url URL]
    lock-closure  --stack S [--stack S]... [--platform P] [--python X.Y] [--index-url URL]

`lock-closure` asks pip to resolve the stack for the image's target (Linux x86_64, CPython 3.11)
with `--dry-run --report`, which reads PEP 658 metadata instead of downloading the multi-GB
wheels, then records every resolved wheel as a `file` pin and lists them in the stack's `wheels`.
pip runs `--isolated` with PIP_CONFIG_FILE=/dev/null so a host's find-links, local indexes and
constraints (e.g. a CPU torch) cannot leak into the lock.

Everything here needs only the index's metadata (PEP 691 JSON pages: sha256 and size of every
file; PEP 658 `.metadata` files), read with urllib or by pip, never tools.fetch: the package
graph stays tools.common <- tools.pins.lock <- tools.fetch, with this module beside fetch.
Stdlib only; pip is run as a subprocess of the current interpreter.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import email.parser
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from tools.common.errors import UserError, run_cli
from tools.common.hashing import sha256_bytes
from tools.pins import lock as lockfile
from tools.pins.lock import FilePin

PYPI_SIMPLE = "https://pypi.org/simple"
SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"
DEFAULT_PLATFORM = "manylinux_2_34_x86_64"
DEFAULT_PYTHON = "3.11"
# flashinfer's prebuilt-kernel companions: their versions must match flashinfer-python, and an
# official jit-cache beside a patched wheel would silently run unpatched kernels.
FLASHINFER_COMPANIONS = ("flashinfer-cubin", "flashinfer-jit-cache")
# A wheel's METADATA is kilobytes; the cap keeps a broken index from streaming without end.
METADATA_LIMIT = 16 << 20
_LEGACY_MANYLINUX = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}


def normalize(name: str) -> str:
    """PEP 503 project name normalization."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pin_name_for(project: str, version: str) -> str:
    return f"{normalize(project)}-{version}"


def parse_requirement(text: str) -> tuple[str, str]:
    match = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([A-Za-z0-9.+!_-]+)\s*", text)
    if not match:
        raise UserError(f"requirement {text!r}: pass an exact pin NAME==VERSION, e.g. sglang==0.5.21")
    return match.group(1), match.group(2)


# ---------------------------------------------------------------------------------------------
# Wheel selection (PEP 425 tags, just what a fixed Linux/CPython target needs)


@dataclass(frozen=True)
class WheelName:
    project: str
    version: str
    python_tags: tuple[str, ...]
    abi_tags: tuple[str, ...]
    platform_tags: tuple[str, ...]


def parse_wheel_filename(filename: str) -> WheelName | None:
    if not filename.endswith(".whl"):
        return None
    parts = filename[:-4].split("-")
    if len(parts) not in (5, 6):
        return None
    py, abi, plat = parts[-3:]
    return WheelName(parts[0], parts[1], tuple(py.split(".")), tuple(abi.split(".")), tuple(plat.split(".")))


def python_rank(wheel: WheelName, python: str) -> int | None:
    """Higher is more specific; None when the wheel cannot run on CPython `python` (X.Y)."""
    major, minor = python.split(".")
    cp = f"cp{major}{minor}"
    best: int | None = None
    for py in wheel.python_tags:
        for abi in wheel.abi_tags:
            rank = None
            if py == cp and abi == cp:
                rank = 4
            elif abi == "abi3" and py.startswith(f"cp{major}") and int(py[len(f"cp{major}"):] or 0) <= int(minor):
                rank = 3
            elif py in (cp, f"py{major}{minor}") and abi == "none":
                rank = 2
            elif py in (f"py{major}", "py2.py3") and abi == "none":
                rank = 1
            if rank is not None and (best is None or rank > best):
                best = rank
    return best


def platform_rank(wheel: WheelName, platform: str) -> int | None:
    """Higher is more specific (newer glibc); None when the wheel does not run on `platform`."""
    target = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", platform)
    best: int | None = None
    for tag in wheel.platform_tags:
        rank = None
        if tag == "any":
            rank = 0
        elif tag == platform:
            rank = 10_000
        elif target:
            glibc_max, arch = (int(target.group(1)), int(target.group(2))), target.group(3)
            m = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", tag)
            legacy = re.fullmatch(r"(manylinux1|manylinux2010|manylinux2014)_(\w+)", tag)
            glibc = (int(m.group(1)), int(m.group(2))) if m else _LEGACY_MANYLINUX[legacy.group(1)] if legacy else None
            tag_arch = m.group(3) if m else legacy.group(2) if legacy else None
            if glibc and tag_arch == arch and glibc <= glibc_max:
                rank = 1 + glibc[0] * 100 + glibc[1]
        if rank is not None and (best is None or rank > best):
            best = rank
    return best


def choose_wheel(files: Iterable[dict[str, Any]], project: str, version: str, platform: str,
                 python: str) -> dict[str, Any]:
    """The most specific non-yanked wheel of project==version for the target."""
    candidates: list[tuple[int, int, str, dict[str, Any]]] = []
    seen_versions: set[str] = set()
    for entry in files:
        wheel = parse_wheel_filename(entry.get("filename", ""))
        if wheel is None or normalize(wheel.project) != normalize(project):
            continue
        seen_versions.add(wheel.version)
        if wheel.version != version or entry.get("yanked"):
            continue
        py_rank, plat_rank = python_rank(wheel, python), platform_rank(wheel, platform)
        if py_rank is not None and plat_rank is not None:
            candidates.append((py_rank, plat_rank, entry["filename"], entry))
    if not candidates:
        if version not in seen_versions:
            near = ", ".join(sorted(seen_versions)[-5:]) or "none"
            raise UserError(f"{project}=={version}: no wheel of that version on the index (latest wheels: {near}); "
                            "check the version")
        raise UserError(f"{project}=={version}: no wheel for CPython {python} on {platform}; "
                        "pass --platform/--python for a target that has one")
    candidates.sort(key=lambda c: (-c[0], -c[1], c[2]))
    return candidates[0][3]


def fetch_simple_json(index_url: str, project: str, timeout: float) -> tuple[str, dict[str, Any]]:
    """(page URL, decoded PEP 691 JSON) for a project on a simple index."""
    url = f"{index_url.rstrip('/')}/{normalize(project)}/"
    request = urllib.request.Request(url, headers={"Accept": SIMPLE_JSON, "User-Agent": "kimi-k3-lock/1"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            content_type = response.headers.get("Content-Type", "")
            body = response.read()
    except urllib.error.HTTPError as e:
        hint = "check the project name" if e.code == 404 else "retry later or pass --index-url"
        raise UserError(f"{url}: HTTP {e.code} {e.reason}; {hint}") from None
    except (urllib.error.URLError, OSError) as e:
        raise UserError(f"{url}: {getattr(e, 'reason', e)}; check the network/proxy or pass --index-url") from None
    if "json" not in content_type:
        raise UserError(f"{url}: index answered {content_type or 'no content type'}, not {SIMPLE_JSON}; "
                        "pass --index-url of a PEP 691 (JSON) simple index")
    try:
        return url, json.loads(body)
    except json.JSONDecodeError:
        raise UserError(f"{url}: index returned invalid JSON; pass --index-url of a PEP 691 index") from None


def file_pin_entry(page_url: str, entry: dict[str, Any], project: str, version: str) -> dict[str, Any]:
    """Lock JSON for one index file entry."""
    sha256 = entry.get("hashes", {}).get("sha256")
    if not sha256:
        raise UserError(f"{page_url}: {entry.get('filename')} has no sha256 on the index; cannot pin it")
    pin: dict[str, Any] = {
        "kind": "file",
        "package": {"name": normalize(project), "version": version},
        "filename": entry["filename"],
        "urls": [urllib.parse.urljoin(page_url, entry["url"]).split("#")[0]],
        "sha256": sha256,
    }
    if not isinstance(entry.get("size"), int):
        # The lock requires it: the size caps every download of the pin.
        raise UserError(f"{page_url}: {entry.get('filename')} has no size on the index; cannot pin it (use an "
                        "index that lists file sizes, PEP 700)")
    pin["size"] = entry["size"]
    return pin


def add_pypi_pin(lock_path: Path | str, requirement: str, *, platform: str = DEFAULT_PLATFORM,
                 python: str = DEFAULT_PYTHON, pin_name: str | None = None, index_url: str = PYPI_SIMPLE,
                 timeout: float = 60.0) -> str:
    """Add (or replace) the pin for one wheel; returns the pin name."""
    lock_path = Path(lock_path)
    project, version = parse_requirement(requirement)
    page_url, page = fetch_simple_json(index_url, project, timeout)
    entry = choose_wheel(page.get("files", []), project, version, platform, python)
    name = pin_name or pin_name_for(project, version)
    raw = lockfile.read_raw(lock_path)
    raw.setdefault("pins", {})[name] = file_pin_entry(page_url, entry, project, version)
    lockfile.write(lock_path, raw)
    print(f"{name}: {entry['filename']} sha256 {entry['hashes']['sha256']}", file=sys.stderr)
    return name


# ---------------------------------------------------------------------------------------------
# Stack closures


def stack_requirements(lock: lockfile.Lock, stack_name: str) -> list[str]:
    """NAME==VERSION for the stack's sglang and flashinfer pins (mooncake stays a separate pin)."""
    stack = lock.stack(stack_name)
    requirements = []
    for role in ("sglang", "flashinfer"):
        pin = lock.pins.get(stack.roles.get(role, ""))
        if not isinstance(pin, FilePin) or pin.package is None:
            raise UserError(f"{lock.path}: stack '{stack_name}': role '{role}' must name a file pin with a package")
        requirements.append(f"{pin.package.name}=={pin.package.version}")
    return requirements


def without_extras(requirements: Iterable[str]) -> list[str]:
    """The Requires-Dist entries that apply without extras (markers kept for pip)."""
    return [r for r in requirements if not re.search(r"\bextra\s*==", r)]


def metadata_requirements(text: str) -> list[str]:
    """The Requires-Dist entries of a wheel's METADATA text that apply without extras."""
    return without_extras(email.parser.Parser().parsestr(text, headersonly=True).get_all("Requires-Dist") or [])


def index_metadata_requirements(pin: FilePin, index_url: str, timeout: float) -> list[str] | None:
    """The pin's Requires-Dist from the index's PEP 658 metadata file, or None when the index
    cannot vouch for it: only when the index lists the lock's exact file (same name and sha256)
    with a metadata sha256, and the `.metadata` file has that sha256. Spares the wheel download."""
    assert pin.package is not None
    try:
        page_url, page = fetch_simple_json(index_url, pin.package.name, timeout)
    except UserError as e:
        print(f"lock-closure: {pin.name}: no index page ({e}); reading the wheel itself", file=sys.stderr)
        return None
    entry = next((f for f in page.get("files", []) if f.get("filename") == pin.filename), None)
    if entry is None or entry.get("hashes", {}).get("sha256") != pin.sha256:
        return None
    meta = entry.get("core-metadata", entry.get("dist-info-metadata"))
    expected = meta.get("sha256") if isinstance(meta, dict) else None
    if not expected:
        return None
    url = urllib.parse.urljoin(page_url, entry["url"]).split("#")[0] + ".metadata"
    request = urllib.request.Request(url, headers={"User-Agent": "kimi-k3-lock/1"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read(METADATA_LIMIT + 1)
    except (urllib.error.URLError, OSError) as e:
        print(f"lock-closure: {url}: {getattr(e, 'reason', e)}; reading the wheel itself", file=sys.stderr)
        return None
    if len(body) > METADATA_LIMIT or sha256_bytes(body) != expected:
        print(f"lock-closure: {url}: not the metadata the index lists (sha256 {expected}); reading the wheel itself",
              file=sys.stderr)
        return None
    try:
        return metadata_requirements(body.decode("utf-8"))
    except UnicodeDecodeError:
        return None


def pinned_wheel_requirements(pin: FilePin, *, platform: str, python: str, index_url: str,
                              timeout: float) -> list[str]:
    """The Requires-Dist (without extras) of exactly the pinned wheel: from the index's PEP 658
    metadata when it vouches for the lock's sha256, else pip reads the wheel from the pin's URLs
    with the lock's sha256 as the URL's hash (pip refuses other bytes)."""
    requirements = index_metadata_requirements(pin, index_url, timeout)
    if requirements is not None:
        return requirements
    assert pin.package is not None
    failures: list[str] = []
    for url in pin.urls:
        direct = f"{pin.package.name} @ {url.split('#')[0]}#sha256={pin.sha256}"
        code, last, items = pip_report([direct], platform=platform, python=python, index_url=index_url,
                                       extra=("--no-deps",))
        if code == 0 and len(items) == 1:
            return without_extras(items[0]["metadata"].get("requires_dist") or [])
        failures.append(f"{url}: {' | '.join(last) or f'pip exited {code}'}")
    raise UserError(f"pin '{pin.name}': could not read the wheel's Requires-Dist ({'; '.join(failures)}); check the "
                    "network/proxy, or re-pin it with `python3 -m tools.pins.pypi add-pypi` if the lock is wrong")


def requirement_project(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if not match:
        raise UserError(f"requirement {requirement!r}: cannot read a project name from it")
    return normalize(match.group(1))


def apply_overrides(requirements: Sequence[str], overrides: Sequence[str], owner: str) -> list[str]:
    """`requirements` with each overridden project's entry replaced by its override."""
    by_project = {requirement_project(o): o for o in overrides}
    result = [by_project.get(requirement_project(r), r) for r in requirements]
    unused = set(by_project) - {requirement_project(r) for r in requirements}
    if unused:
        raise UserError(f"closure_overrides: {', '.join(sorted(unused))} is not a requirement of {owner}; "
                        "remove the override")
    return result


def compatible_platforms(platform: str) -> list[str]:
    """`platform` and every older manylinux tag it runs, newest first: pip (23.x) takes an
    explicit --platform literally, so a 2_34 target would otherwise miss 2_28/2014 wheels."""
    match = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not match:
        return [platform]
    newest, arch = int(match.group(1)), match.group(2)
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(newest, 4, -1)]
    legacy = [f"{alias}_{arch}" for alias, (_, minor) in _LEGACY_MANYLINUX.items() if minor <= newest]
    return tags + sorted(legacy, reverse=True)


def closure_requirements(lock: lockfile.Lock, stack_name: str, timeout: float, *, platform: str = DEFAULT_PLATFORM,
                         python: str = DEFAULT_PYTHON, index_url: str = PYPI_SIMPLE) -> tuple[list[str], list[str]]:
    """(requirements for pip, pins added as-is). Without overrides pip resolves sglang itself;
    with them, pip resolves sglang's own Requires-Dist (overrides applied) and the sglang pin
    joins the closure unchanged, since pip has no way to override a dependency's exact pin."""
    stack = lock.stack(stack_name)
    requirements = stack_requirements(lock, stack_name)
    if not stack.closure_overrides:
        return requirements, []
    sglang = lock.pins[stack.roles["sglang"]]
    assert isinstance(sglang, FilePin)
    pinned = pinned_wheel_requirements(sglang, platform=platform, python=python, index_url=index_url, timeout=timeout)
    own = apply_overrides(pinned, stack.closure_overrides, sglang.name)
    return [*own, *requirements[1:]], [sglang.name]


def pip_report(requirements: Sequence[str], *, platform: str, python: str, index_url: str,
               extra: Sequence[str] = ()) -> tuple[int, list[str], list[dict[str, Any]]]:
    """(pip's exit code, its last 3 stderr lines, its `install --report` entries) for
    `requirements` on the target. PEP 658 metadata spares the wheel downloads where the index
    serves it; where it does not, pip streams each wheel through a temp dir (--no-cache-dir:
    nothing multi-GB is kept)."""
    with tempfile.TemporaryDirectory(prefix="kimi-k3-closure-") as tmp:
        report = Path(tmp) / "report.json"
        platforms = [arg for tag in compatible_platforms(platform) for arg in ("--platform", tag)]
        cmd = [sys.executable, "-m", "pip", "install", "--isolated", "--no-cache-dir", "--dry-run",
               "--ignore-installed", "--quiet", "--report", str(report), "--only-binary=:all:", *platforms,
               "--python-version", python, "--implementation", "cp", "--target", str(Path(tmp) / "target"),
               "--index-url", index_url, *extra, *requirements]
        # --isolated ignores PIP_* variables and user config; PIP_CONFIG_FILE=/dev/null also drops
        # the global/site config files where this host keeps its find-links and constraints.
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
        env["PIP_CONFIG_FILE"] = os.devnull
        result = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        last = [ln for ln in result.stderr.splitlines() if ln.strip()][-3:]
        if result.returncode != 0:
            return result.returncode, last, []
        items: list[dict[str, Any]] = json.loads(report.read_text())["install"]
        return 0, last, items


def pip_resolve(requirements: Sequence[str], *, platform: str, python: str, index_url: str) -> list[dict[str, Any]]:
    """pip's `install --report` entries for the closure of `requirements`."""
    code, last, items = pip_report(requirements, platform=platform, python=python, index_url=index_url)
    if code != 0:
        shown = " ".join(requirements) if len(requirements) <= 4 else f"{len(requirements)} requirements"
        raise UserError(f"pip could not resolve {shown} for {platform}/cp{python}: {' | '.join(last)}; "
                        "add a closure_overrides entry to the stack for a pin the index cannot serve")
    return items


def report_entry_pin(item: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(pin name, lock JSON) for one entry of pip's installation report."""
    meta = item["metadata"]
    info = item["download_info"]
    url = info["url"]
    hashes = info.get("archive_info", {}).get("hashes", {})
    if "sha256" not in hashes:
        raise UserError(f"pip report: {url} has no sha256; the index must publish hashes")
    filename = urllib.parse.unquote(url.rsplit("/", 1)[-1].split("#")[0])
    name = pin_name_for(meta["name"], meta["version"])
    return name, {"kind": "file", "package": {"name": normalize(meta["name"]), "version": meta["version"]},
                  "filename": filename, "urls": [url], "sha256": hashes["sha256"]}


def add_sizes(pins: dict[str, dict[str, Any]], index_url: str, timeout: float) -> None:
    """Fill `size` from the simple index (pip's report lacks it; a size turns a truncated
    download into a clear error before hashing)."""
    missing = [pin for pin in pins.values() if "size" not in pin]
    projects = sorted({pin["package"]["name"] for pin in missing})
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        pages = dict(zip(projects, pool.map(lambda p: fetch_simple_json(index_url, p, timeout), projects)))
    for pin in missing:
        page_url, page = pages[pin["package"]["name"]]
        for entry in page.get("files", []):
            if entry.get("filename") == pin["filename"]:
                if entry.get("hashes", {}).get("sha256") != pin["sha256"]:
                    raise UserError(f"{page_url}: {pin['filename']} sha256 differs from pip's report; re-run lock-closure")
                if isinstance(entry.get("size"), int):
                    pin["size"] = entry["size"]
        if "size" not in pin:  # the lock requires it (the cap on every download)
            raise UserError(f"{page_url}: lists no size for {pin['filename']}; cannot pin it (use an index that "
                            "lists file sizes, PEP 700)")


def merge_pin(raw_pins: dict[str, Any], name: str, pin: dict[str, Any], lock_path: Path) -> None:
    existing = raw_pins.get(name)
    if existing is None:
        raw_pins[name] = pin
    elif existing.get("sha256") != pin["sha256"]:
        raise UserError(f"{lock_path}: pin '{name}' already pins {existing.get('filename')} ({existing.get('sha256')}), "
                        f"but the closure resolved {pin['filename']} ({pin['sha256']}); remove or rename the old pin")
    elif "size" not in existing and "size" in pin:
        existing["size"] = pin["size"]


def lock_closure(lock_path: Path | str, stack_name: str, *, platform: str = DEFAULT_PLATFORM,
                 python: str = DEFAULT_PYTHON, index_url: str = PYPI_SIMPLE, timeout: float = 60.0,
                 with_sizes: bool = True) -> dict[str, Any]:
    """Resolve a stack's closure and write its wheel pins into the lock; returns a summary."""
    lock_path = Path(lock_path)
    lock = lockfile.load(lock_path)
    requirements, direct_pins = closure_requirements(lock, stack_name, timeout, platform=platform, python=python,
                                                     index_url=index_url)
    start = time.monotonic()
    items = pip_resolve(requirements, platform=platform, python=python, index_url=index_url)
    resolve_s = time.monotonic() - start
    pins = dict(report_entry_pin(item) for item in items)
    for name in direct_pins:
        pins[name] = lockfile.read_raw(lock_path)["pins"][name]
    if with_sizes:
        add_sizes(pins, index_url, timeout)
    raw = lockfile.read_raw(lock_path)
    raw_pins = raw.setdefault("pins", {})
    for name, pin in pins.items():
        merge_pin(raw_pins, name, pin, lock_path)
    stack = raw["stacks"][stack_name]
    stack["wheels"] = sorted(pins)
    torch = [n for n in pins if raw_pins[n]["package"]["name"] == "torch"]
    if torch:
        stack["torch"] = torch[0]
    lockfile.write(lock_path, raw)
    companions = sorted(n for n in pins if raw_pins[n]["package"]["name"] in FLASHINFER_COMPANIONS)
    return {"stack": stack_name, "requirements": len(requirements), "wheels": len(pins),
            "bytes": sum(raw_pins[n].get("size", 0) for n in pins), "resolve_s": round(resolve_s, 1),
            "flashinfer_companions": companions}


# ---------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m tools.pins.pypi", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--lock", default=str(lockfile.DEFAULT_LOCK))
    common.add_argument("--platform", default=DEFAULT_PLATFORM)
    common.add_argument("--python", default=DEFAULT_PYTHON)
    common.add_argument("--index-url", default=os.environ.get("KIMI_K3_INDEX_URL", PYPI_SIMPLE))
    common.add_argument("--timeout", type=float, default=60.0)
    p = sub.add_parser("add-pypi", parents=[common])
    p.add_argument("requirement", metavar="NAME==VERSION")
    p.add_argument("--pin-name")
    p = sub.add_parser("lock-closure", parents=[common])
    p.add_argument("--stack", action="append", required=True)
    p.add_argument("--no-sizes", action="store_true", help="skip the per-project index queries for sizes (only for a closure whose pins are all in the lock "
                   "already: a new pin needs its size)")
    args = parser.parse_args(argv)
    if args.command == "add-pypi":
        print(add_pypi_pin(args.lock, args.requirement, platform=args.platform, python=args.python,
                           pin_name=args.pin_name, index_url=args.index_url, timeout=args.timeout))
        return 0
    for stack in args.stack:
        summary = lock_closure(args.lock, stack, platform=args.platform, python=args.python,
                               index_url=args.index_url, timeout=args.timeout, with_sizes=not args.no_sizes)
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
