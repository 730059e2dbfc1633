"""Git-format patch text: split into file sections, paths and modes checked, hunks counted.

Only git-format patches are accepted, and a hunk body must match its header's line counts: a cut
or hand-edited patch is bad input (exit 2), never reported as a conflict.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from tools.common.errors import UserError
from tools.patch_gate.wheel import check_member_path

# File modes a wheel can hold; symlinks (120000) and submodule pointers (160000) cannot be
# shipped in a wheel, and a symlink could later redirect writes outside the tree.
_ALLOWED_MODES = {"100644", "100755"}


@dataclass(frozen=True)
class Hunk:
    number: int
    old_start: int
    new_start: int
    header: str


@dataclass
class FileSection:
    """One `diff --git` section: its raw lines, the paths it names (None = /dev/null) and hunks."""

    lines: list[str]
    old_path: str | None
    new_path: str | None
    hunks: list[Hunk]

    @property
    def path(self) -> str:
        return self.new_path or self.old_path or ""


HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def split_patch(text: str, origin: str) -> tuple[list[str], list[FileSection]]:
    """Split git-format patch text into its preamble and file sections.

    Only git-format patches are accepted: a body line always starts with ' ', '+', '-' or '\\',
    so a line starting with 'diff --git ' is unambiguously a section header. Hunks are checked
    against their headers' line counts (a cut patch is bad input, not a conflict), and a plain
    `---`/`+++` pair outside a section header is refused: git would apply it as one more file.
    """
    lines = text.split("\n")
    starts = [i for i, line in enumerate(lines) if line.startswith("diff --git ")]
    if not starts:
        raise UserError(f"{origin}: no `diff --git` header; regenerate the patch with `git diff` or `git format-patch`")
    _refuse_plain_sections(lines, 0, starts[0], origin)
    ends = starts[1:] + [len(lines) - 1 if text.endswith("\n") else len(lines)]
    sections = [parse_section(lines[a:b], origin, first_line=a + 1) for a, b in zip(starts, ends)]
    return lines[: starts[0]], sections


def _refuse_plain_sections(lines: list[str], begin: int, end: int, origin: str) -> None:
    """Refuse a `--- `/`+++ ` pair in lines[begin:end] (text git would read as a traditional diff)."""
    for i in range(begin, min(end, len(lines) - 1)):
        if lines[i].startswith("--- ") and lines[i + 1].startswith("+++ "):
            raise UserError(f"{origin}: line {i + 1}: a `---`/`+++` file section without a `diff --git` header "
                            "(git would apply it, the gate would not report it); regenerate the patch with `git diff`")


def _strip_prefix(name: str, prefix: str, origin: str) -> str:
    if name.startswith('"'):
        raise UserError(f"{origin}: quoted path {name}; rename the file to plain ASCII without spaces")
    if not name.startswith(prefix):
        raise UserError(f"{origin}: path {name!r} lacks the {prefix!r} prefix (absolute or -p0 patch); regenerate it with `git diff`")
    return name[len(prefix):]


def parse_section(lines: list[str], origin: str, first_line: int = 1) -> FileSection:
    """Read the paths, modes and hunks of one file section (lines[0] is patch line `first_line`)."""
    old_path: str | None = None
    new_path: str | None = None
    saw_minus = saw_plus = False
    renamed: dict[str, str] = {}
    hunks: list[Hunk] = []
    in_header = True
    binary = False
    # Lines still owed by the open hunk (old side, new side), from its header's counts.
    owed_old = owed_new = 0
    for offset, line in enumerate(lines[1:], start=1):
        number = first_line + offset
        if owed_old or owed_new:
            # An empty line is a context line whose trailing space was stripped; git accepts it.
            kind = line[:1] or " "
            if kind not in " +-\\":
                _corrupt(origin, number, hunks[-1], lines[0], "a line that is not ' ', '+', '-' or '\\'")
            owed_old -= kind in " -"
            owed_new -= kind in " +"
            if owed_old < 0 or owed_new < 0:
                _corrupt(origin, number, hunks[-1], lines[0], "more lines than its header counts")
            continue
        if in_header and (line.startswith("@@ ") or line.startswith("GIT binary patch")):
            in_header = False
            binary = line.startswith("GIT binary patch")
        if not in_header:
            if line.startswith("@@") and not binary:
                match = HUNK_RE.match(line)
                if not match:
                    raise UserError(f"{origin}: corrupt patch at line {number}: {line[:60]!r} is not a hunk header; regenerate the patch")
                hunks.append(Hunk(len(hunks) + 1, int(match.group(1)), int(match.group(3)), line))
                owed_old = 1 if match.group(2) is None else int(match.group(2))
                owed_new = 1 if match.group(4) is None else int(match.group(4))
            elif line.startswith("--- ") and offset + 1 < len(lines) and lines[offset + 1].startswith("+++ "):
                raise UserError(f"{origin}: line {number}: a `---`/`+++` file section after the hunks of "
                                f"{lines[0][11:]} without its own `diff --git` header (git would apply it, the gate "
                                "would not report it); regenerate the patch with `git diff`")
            continue
        for key in ("new file mode ", "deleted file mode ", "old mode ", "new mode "):
            if line.startswith(key) and line[len(key):].strip() not in _ALLOWED_MODES:
                raise UserError(f"{origin}: {lines[0][11:]} sets mode {line[len(key):].strip()} (symlink or submodule); wheels hold regular files only")
        if line.startswith("index ") and len(line.split()) == 3 and line.split()[2] not in _ALLOWED_MODES:
            raise UserError(f"{origin}: {lines[0][11:]} has mode {line.split()[2]} (symlink or submodule); wheels hold regular files only")
        if line.startswith("--- "):
            saw_minus = True
            name = line[4:].rstrip("\t")
            old_path = None if name == "/dev/null" else _strip_prefix(name, "a/", origin)
        elif line.startswith("+++ "):
            saw_plus = True
            name = line[4:].rstrip("\t")
            new_path = None if name == "/dev/null" else _strip_prefix(name, "b/", origin)
        else:
            for key in ("rename from ", "rename to ", "copy from ", "copy to "):
                if line.startswith(key):
                    renamed[key.split()[1]] = line[len(key):]
    if owed_old or owed_new:
        _corrupt(origin, first_line + len(lines) - 1, hunks[-1], lines[0],
                 f"the patch ends {owed_old or owed_new} lines short of its header's count")
    if binary and lines[-1] != "":
        # git ends each binary hunk with an empty line; without it git skips the file (exit 0 when
        # another file applies), so the gate would report a change it never made.
        raise UserError(f"{origin}: corrupt patch at line {first_line + len(lines) - 1}: the binary hunk of "
                        f"{lines[0][11:]} lacks the empty line that ends it (trailing blank lines stripped?); "
                        "regenerate it with `git diff --binary`")
    if not (saw_minus and saw_plus):
        old_path, new_path = _paths_from_git_header(lines[0], renamed, origin)
        if any(l.startswith("new file mode ") for l in lines):
            old_path = None
        if any(l.startswith("deleted file mode ") for l in lines):
            new_path = None
    for path in (old_path, new_path):
        if path is not None:
            if re.search(r"\s", path):
                raise UserError(f"{origin}: path {path!r} contains whitespace; rename the file")
            check_member_path(path, origin)
    return FileSection(lines=lines, old_path=old_path, new_path=new_path, hunks=hunks)


def _corrupt(origin: str, number: int, hunk: Hunk, header: str, what: str) -> None:
    """A hunk whose body does not match its header's line counts: a cut or hand-edited patch."""
    raise UserError(f"{origin}: corrupt patch at line {number}: hunk #{hunk.number} of {header[11:]} has {what} "
                    "(the patch was cut or hand-edited); regenerate it with `git diff`")


def _paths_from_git_header(header: str, renamed: dict[str, str], origin: str) -> tuple[str, str]:
    """Paths of a section without ---/+++ lines (binary, mode-only, pure rename)."""
    if "from" in renamed and "to" in renamed:
        return renamed["from"], renamed["to"]
    rest = header[len("diff --git "):]
    half = (len(rest) - 1) // 2
    old, new = rest[:half], rest[half + 1:]
    if rest[half] != " " or old[2:] != new[2:]:
        raise UserError(f"{origin}: cannot read the paths of {header!r}; regenerate the patch with `git diff`")
    return _strip_prefix(old, "a/", origin), _strip_prefix(new, "b/", origin)
