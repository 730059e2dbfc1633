"""The docs instruct; docs/measurements/ measures (issue #26).

- README.md, and every stage's README.md, is at most 250 lines.
- No instruction doc (every git-tracked or untracked-not-ignored `*.md` of the checkout outside
  docs/measurements/, docs/GPU_RUN.md included) holds a dated measurement: a date, the word
  "measured", a `sha256:` digest, a truncated hex digest (`1a2b3c4d…`) or a CPU-seconds /
  elapsed / wall time. A pointer to the measurements (`docs/measurements/2026-12-01.md`, or a
  line naming `docs/measurements/` that says "measured") is allowed: the path is removed before
  the line is judged, and "measured" may stand on such a line.
- docs/DESIGN.md's table of the image stage names each of its files, and no other.
- Every command README.md gives names what exists: each Bazel label's package has a BUILD file
  (and, where the target is spelled out, the name is a string in that BUILD file or in a .bzl of
  the checkout, as macros make targets), and each `python3 -m tools....` module is a file
  (`tools/x/y.py`, or `tools/x/y/__main__.py` for a package).

It reads the checkout itself (found through //:MODULE.bazel's real path, or
KIMI_DOCS_WORKSPACE to judge another checkout), so it is not sandboxed and never cached.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cpu.conftest import env_path

README_MAX_LINES = 250
# Docs whose text is not instructions: the measurements themselves.
MEASUREMENTS = "docs/measurements/"

# A pointer to the measurements, removed from a line before it is judged.
_POINTER = re.compile(r"docs/measurements/[\w.-]*")
_DATED = {
    "a date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
    "a sha256 digest": re.compile(r"sha256:[0-9a-f]{8,}"),
    "a truncated digest": re.compile(r"\b[0-9a-f]{8,}(?:…|\.\.\.)"),
    "a measured time": re.compile(r"\b\d+(?:\.\d+)?\s?(?:CPU-s\b|s elapsed\b|s wall\b|s of Bazel time\b)"),
}
_MEASURED = re.compile(r"\bmeasured\b", re.I)

# A Bazel label not inside a URL (`https://host/...`): `//pkg`, `//pkg/...`, `//pkg:name`.
_LABEL = re.compile(r"(?<![\w:/])//([\w./-]*?)(?:/\.\.\.|:([\w.+-]+))?(?=[\s`'\"=),;\]]|$)")
# A module after `-m`; a trailing `.<module>` or `.X|Y` is a pattern, not a module.
_MODULE = re.compile(r"python3(?:\.\d+)? -m (tools(?:\.\w+)*)(?![\w.]*[<|])")


def _workspace() -> Path:
    override = os.environ.get("KIMI_DOCS_WORKSPACE")
    return Path(override) if override else Path(os.path.realpath(env_path("KIMI_MODULE_BAZEL"))).parent


def _docs(ws: Path) -> list[str]:
    out = subprocess.run(["git", "-C", str(ws), "ls-files", "-z", "--cached", "--others", "--exclude-standard",
                          "--", "*.md"], capture_output=True, check=True).stdout.split(b"\0")
    return sorted(rel for rel in (f.decode() for f in out if f)
                  if not rel.startswith(MEASUREMENTS) and (ws / rel).is_file())


def dated_measurements(text: str) -> list[str]:
    """`line N: <what> (<match>)` for every dated measurement in `text`."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        points = bool(_POINTER.search(line)) or MEASUREMENTS.rstrip("/") in line
        judged = _POINTER.sub("", line)
        for what, pattern in _DATED.items():
            found += [f"line {number}: {what} ({m.group(0)})" for m in pattern.finditer(judged)]
        if not points:
            found += [f"line {number}: the word {m.group(0)!r}" for m in _MEASURED.finditer(judged)]
    return found


def _build_file(ws: Path, package: str) -> Path | None:
    for name in ("BUILD.bazel", "BUILD"):
        if (ws / package / name).is_file():
            return ws / package / name
    return None


# A string literal a name is built from: `name = "profiles_check" + suffix`.
_PREFIX = re.compile(r'"([\w.+-]+)"\s*\+')


def _named_somewhere(ws: Path, build: Path, name: str) -> bool:
    """The name is a string of the package's BUILD file, or begins with one that a `+` extends
    there, or is a string of a .bzl (a macro's target: `name = "check"` in a defs.bzl)."""
    text = build.read_text()
    quoted = f'"{name}"'
    if quoted in text or any(name.startswith(p) for p in _PREFIX.findall(text)):
        return True
    return any(quoted in p.read_text() for p in [*ws.glob("tools/**/*.bzl"), *build.parent.glob("*.bzl")])


def missing_names(ws: Path, text: str) -> list[str]:
    """What the commands of `text` name that the checkout does not have."""
    missing = []
    for m in _LABEL.finditer(text):
        package, name = re.sub(r"/?\.\.\.$", "", m.group(1)).rstrip("/"), m.group(2)
        build = _build_file(ws, package)
        if build is None:
            missing.append(f"//{package}: no BUILD.bazel in {package or 'the root'}/")
        elif name and not _named_somewhere(ws, build, name):
            missing.append(f"//{package}:{name}: no target of that name in {build.relative_to(ws)} or a .bzl")
    for module in sorted(set(_MODULE.findall(text))):
        rel = Path(*module.split("."))
        if not ((ws / rel).with_suffix(".py").is_file() or (ws / rel / "__main__.py").is_file()):
            missing.append(f"python3 -m {module}: neither {rel}.py nor {rel}/__main__.py exists")
    return sorted(set(missing))


def test_readmes_are_at_most_250_lines() -> None:
    ws = _workspace()
    readmes = [rel for rel in _docs(ws) if rel.rsplit("/", 1)[-1] == "README.md"]
    assert "README.md" in readmes, readmes
    long = {rel: n for rel in readmes if (n := (ws / rel).read_text().count("\n")) > README_MAX_LINES}
    assert not long, (f"more than {README_MAX_LINES} lines: {long}; move depth to the stage's README (or a "
                      "second doc beside it) and measurements to docs/measurements/")


def test_docs_hold_no_dated_measurement() -> None:
    ws = _workspace()
    docs = _docs(ws)
    assert "README.md" in docs, docs
    problems = [f"{rel} {p}" for rel in docs for p in dated_measurements((ws / rel).read_text())]
    assert not problems, ("dated measurements belong in docs/measurements/YYYY-MM-DD.md:\n"
                          + "\n".join(problems))


def test_design_names_every_file_of_the_image_stage() -> None:
    """docs/DESIGN.md's table of the image stage by job names each tools/image/*.py, and only those."""
    ws = _workspace()
    text = (ws / "docs" / "DESIGN.md").read_text()
    table = text[text.index("The image stage, the largest, has one file per job"):]
    table = table[:table.index("\n\n", table.index("| job |"))]
    named = set(re.findall(r"`(\w+\.py)`", table))
    files = {p.name for p in (ws / "tools" / "image").glob("*.py")} - {"__init__.py"}
    assert named == files, f"not in the table: {sorted(files - named)}; no such file: {sorted(named - files)}"


def test_readme_commands_name_what_exists() -> None:
    ws = _workspace()
    missing = missing_names(ws, (ws / "README.md").read_text())
    assert not missing, "README.md names what this checkout lacks:\n" + "\n".join(missing)


@pytest.mark.parametrize("line, expected", [
    ("Measured (2026-12-01): 149 s to build", ["a date", "the word"]),
    ("manifest `sha256:5aa905ce191e…`", ["a sha256 digest", "a truncated digest"]),
    ("Bazel elapsed 901.6 s elapsed, 1644 CPU-s", ["a measured time"]),
    ("Measured times: `docs/measurements/`.", []),
    ("the H200 run: `docs/measurements/2026-12-02.md`", []),
    ("`python3 -m tools.bench --record docs/measurements/DATE.md`", []),
])
def test_dated_measurement_patterns(line: str, expected: list[str]) -> None:
    found = dated_measurements(line)
    kinds = {"the word" if f.split(": ", 1)[1].startswith("the word") else f.split(": ", 1)[1].rsplit(" (", 1)[0]
             for f in found}
    assert kinds == set(expected), found


def test_missing_names_on_a_fixture(tmp_path: Path) -> None:
    (tmp_path / "image").mkdir()
    (tmp_path / "image" / "BUILD.bazel").write_text('oci_push(name = "push")\n[t(name = "check" + s) for s in S]\n')
    (tmp_path / "tools" / "fetch").mkdir(parents=True)
    (tmp_path / "tools" / "fetch" / "__main__.py").write_text("")
    (tmp_path / "tools" / "common").mkdir()
    (tmp_path / "tools" / "common" / "cache.py").write_text("")
    text = ("tools/bazel run //image:push //image:pull //nowhere:x //image/... //image:check_pypi\n"
            "python3 -m tools.fetch verify; python3 -m tools.common.cache; python3 -m tools.bench\n"
            "python3 -m tools.image.<module>; build:remote-cache --remote_cache=https://cache.example/k3\n")
    assert missing_names(tmp_path, text) == [
        "//image:pull: no target of that name in image/BUILD.bazel or a .bzl",
        "//nowhere: no BUILD.bazel in nowhere/",
        "python3 -m tools.bench: neither tools/bench.py nor tools/bench/__main__.py exists",
    ]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
