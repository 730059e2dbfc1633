"""`git apply` as the gate runs it (isolated from any enclosing repository), what its verbose
output says per file and hunk, and the per-hunk diagnosis of a conflicting patch."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tools.common.errors import UserError
from tools.patch_gate.patch import HUNK_RE, Hunk, split_patch
from tools.patch_gate.remap import RemappedPatch


@dataclass
class FileApplyReport:
    """What `git apply -v` said about one file: hunk offsets, rejected hunks, errors."""

    offsets: dict[int, int] = field(default_factory=dict)
    clean: set[int] = field(default_factory=set)
    rejected: set[int] = field(default_factory=set)
    failed_at_lines: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


_CURRENT_FILE_RES = (
    re.compile(r"^Checking patch (.+)\.\.\.$"),
    re.compile(r"^Applying patch (.+) with \d+ rejects?\.\.\.$"),
    re.compile(r"^Applied patch (.+) cleanly\.$"),
)
_OFFSET_RE = re.compile(r"^Hunk #(\d+) succeeded at (\d+)(?: \(offset (-?\d+) lines?\))?\.$")
_CLEAN_RE = re.compile(r"^Hunk #(\d+) applied cleanly\.$")
_REJECTED_RE = re.compile(r"^Rejected hunk #(\d+)\.$")
_FAILED_RE = re.compile(r"^error: patch failed: (.+):(\d+)$")
_ERROR_RE = re.compile(r"^error: (.+?): (.+)$")


def parse_git_apply_output(output: str) -> dict[str, FileApplyReport]:
    """Per-file results from `git apply -v` (LC_ALL=C) messages."""
    reports: dict[str, FileApplyReport] = {}
    current: str | None = None
    for line in output.split("\n"):
        for pattern in _CURRENT_FILE_RES:
            match = pattern.match(line)
            if match:
                current = match.group(1)
                reports.setdefault(current, FileApplyReport())
        if current is None:
            continue
        report = reports[current]
        if m := _OFFSET_RE.match(line):
            report.offsets[int(m.group(1))] = int(m.group(3) or 0)
        elif m := _CLEAN_RE.match(line):
            report.clean.add(int(m.group(1)))
        elif m := _REJECTED_RE.match(line):
            report.rejected.add(int(m.group(1)))
        elif m := _FAILED_RE.match(line):
            reports.setdefault(m.group(1), FileApplyReport()).failed_at_lines.append(int(m.group(2)))
        elif (m := _ERROR_RE.match(line)) and m.group(2) not in ("patch does not apply",) and not line.startswith("error: while searching"):
            reports.setdefault(m.group(1), FileApplyReport()).errors.append(m.group(2))
    return reports


class GitApply:
    """`git apply` run in a plain directory, isolated from any enclosing repository and user config."""

    def __init__(self, git: str) -> None:
        resolved = shutil.which(git)
        if resolved is None:
            raise UserError(f"--git {git}: not found; install git or pass its path (the gate runs git apply)")
        self.git = resolved

    def run(self, tree: Path, patch_file: Path, *args: str) -> tuple[bool, str]:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LC_ALL": "C",
            # Without a ceiling, git apply run inside some enclosing work tree would apply
            # relative to that repository and silently skip paths outside the cwd.
            "GIT_CEILING_DIRECTORIES": str(tree.resolve().parent),
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": os.devnull,
            "HOME": str(tree.resolve().parent),
        }
        proc = subprocess.run([self.git, "apply", "-p1", "--whitespace=nowarn", *args, str(patch_file.resolve())],
                              cwd=tree, env=env, capture_output=True, text=True, errors="surrogateescape")
        return proc.returncode == 0, proc.stdout + proc.stderr


def hunk_states(tree: Path, patch_file: Path, patch: RemappedPatch, git: GitApply) -> dict[str, dict[int, str]]:
    """Per hunk: 'applies', 'already present' or 'conflicts' (file-level failures as 'error: ...').

    Runs `git apply --reject` forward and in reverse on throwaway copies of the touched files,
    since --check stops at the first failing hunk of a file.
    """
    directions: dict[bool, dict[str, FileApplyReport]] = {}
    for reverse in (False, True):
        with tempfile.TemporaryDirectory(prefix="gate-diagnose-") as scratch:
            copy = Path(scratch) / "tree"
            copy.mkdir()
            for mapped in patch.files:
                for wheel_path in {p for p in (mapped.old_wheel, mapped.new_wheel) if p}:
                    src = tree / wheel_path
                    if src.is_file() and not src.is_symlink():
                        dst = copy / wheel_path
                        dst.parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(src, dst)
            _, output = git.run(copy, patch_file, "--reject", "-v", *(["-R"] if reverse else []))
            directions[reverse] = parse_git_apply_output(output)
    states: dict[str, dict[int, str]] = {}
    for mapped in patch.files:
        forward = directions[False].get(mapped.wheel, FileApplyReport())
        backward = directions[True].get(mapped.wheel, FileApplyReport())
        per_hunk: dict[int, str] = {}
        for hunk in mapped.hunks or (Hunk(0, 0, 0, "(whole file)"),):
            if hunk.number and hunk.number in forward.clean | set(forward.offsets):
                per_hunk[hunk.number] = "applies"
            elif hunk.number and hunk.number in backward.clean | set(backward.offsets):
                per_hunk[hunk.number] = "already present"
            elif forward.errors:
                per_hunk[hunk.number] = "error: " + forward.errors[0]
            else:
                per_hunk[hunk.number] = "conflicts"
        states[mapped.wheel] = per_hunk
    return states


def hunk_bodies(patch: RemappedPatch) -> dict[str, dict[int, list[str]]]:
    """The body lines of every hunk, per wheel path (for the added-line evidence of a conflict)."""
    bodies: dict[str, dict[int, list[str]]] = {}
    _, sections = split_patch(patch.text, patch.source.entry.label)
    for section in sections:
        per_hunk: dict[int, list[str]] = {}
        number = 0
        for line in section.lines[1:]:
            if HUNK_RE.match(line):
                number += 1
                per_hunk[number] = []
            elif number:
                per_hunk[number].append(line)
        bodies[section.path] = per_hunk
    return bodies


def added_lines_evidence(target: Path, body: list[str]) -> str:
    """How much of a conflicting hunk's added code the target already has (whitespace-insensitive).

    Tells "upstream has this change with different surroundings" from "this change is missing".
    """
    added = [line[1:].strip() for line in body if line.startswith("+") and line[1:].strip()]
    removed = [line[1:].strip() for line in body if line.startswith("-") and line[1:].strip()]
    if not target.is_file():
        return "file absent"
    present = {line.strip() for line in target.read_text(encoding="utf-8", errors="surrogateescape").split("\n")}
    added_found = sum(1 for line in added if line in present)
    removed_found = sum(1 for line in removed if line in present)
    return f"{added_found}/{len(added)} added lines present, {removed_found}/{len(removed)} removed lines still present"


def _short_header(header: str, context: int = 40) -> str:
    """`@@ -a,b +c,d @@ ctx` with the function context cut, so table lines stay readable."""
    ranges, sep, rest = header.partition(" @@")
    rest = rest.strip()
    return f"{ranges}{sep} {rest[:context]}{'...' if len(rest) > context else ''}".rstrip()


def diagnose_conflict(tree: Path, patch_file: Path, patch: RemappedPatch, git: GitApply) -> list[str]:
    """Lines naming each file and hunk that keeps the patch from applying."""
    lines: list[str] = []
    states = hunk_states(tree, patch_file, patch, git)
    bodies = hunk_bodies(patch)
    for mapped in patch.files:
        per_hunk = states[mapped.wheel]
        if all(s == "applies" for s in per_hunk.values()):
            continue
        headers = {h.number: h.header for h in mapped.hunks}
        for number, state in per_hunk.items():
            if state == "applies":
                continue
            where = f"hunk #{number} {_short_header(headers.get(number, ''))}".rstrip() if number else "whole file"
            evidence = ""
            if state == "conflicts":
                evidence = f" ({added_lines_evidence(tree / mapped.wheel, bodies[mapped.wheel].get(number, []))})"
            lines.append(f"{mapped.wheel}: {where}: {state}{evidence}")
    return lines or ["git apply refused the patch but no hunk failed on its own: hunks depend on each other; check the patch"]
