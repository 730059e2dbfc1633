"""The gate: check and apply a series in a scratch copy, then put the tree in place in one step.

For patch N with 1..N-1 already applied, `git apply --check` forward and in reverse decides its
one state (applies / already upstream / excluded / conflicts). Only if no patch conflicts (and,
with an expected manifest, nothing drifted) is the full tree written, by one rename.
"""
from __future__ import annotations

import re
import shutil
import sys
import tempfile
import time
from pathlib import Path, PurePosixPath

from tools.common.errors import UserError
from tools.common.files import dir_replaced_atomically, replace_dir
from tools.common.hashing import sha256_file
from tools.patch_gate import wheel as wheel_repack
from tools.patch_gate.gitapply import GitApply, diagnose_conflict, parse_git_apply_output
from tools.patch_gate.manifest import build_manifest, manifest_drift, read_manifest
from tools.patch_gate.remap import RemappedPatch, remap_patch
from tools.patch_gate.result import (STATE_APPLIES, STATE_CONFLICTS, STATE_EXCLUDED, STATE_UPSTREAM,
                                     GateInputs, GateResult, PatchResult)

# The remapped patches' review folder is this tool's own output: a rerun may replace it.
REMAPPED_TOOL = "tools.patch_gate remapped patches"

def log(message: str) -> None:
    """Progress to stderr (stdout carries the table)."""
    print(f"patch_gate: {message}", file=sys.stderr, flush=True)


def refuse_symlinked_paths(tree: Path, patch: RemappedPatch) -> None:
    """Refuse a patch whose path goes through (or is) a symlink in the tree: writes could escape it."""
    for mapped in patch.files:
        for wheel_path in {p for p in (mapped.old_wheel, mapped.new_wheel) if p}:
            parts = PurePosixPath(wheel_path).parts
            for depth in range(1, len(parts) + 1):
                candidate = tree.joinpath(*parts[:depth])
                if candidate.is_symlink():
                    raise UserError(f"{patch.source.entry.label}: {wheel_path} goes through the symlink {'/'.join(parts[:depth])} in the target tree; patch the real path")


_UNREADABLE_RE = re.compile(r"^(?:error: )?((?:corrupt patch|corrupt binary patch|patch fragment without header|"
                            r"git diff header lacks|No valid patches|unrecognized input).*)$", re.M)


def classify_patch(tree: Path, patch_file: Path, patch: RemappedPatch, git: GitApply) -> tuple[str, dict[str, dict[int, int]], list[str]]:
    """Decide `applies` / `already upstream` / `conflicts` with git apply --check both ways."""
    forward_ok, forward_out = git.run(tree, patch_file, "--check", "-v")
    reverse_ok, reverse_out = git.run(tree, patch_file, "--check", "-v", "-R")
    # The parser refuses cut patches first; this catches whatever else git cannot parse, which is
    # bad input, not a conflict with the target. Read whatever the exit status: git skips a file
    # whose binary hunk it cannot decode and still exits 0 when another file of the patch applies.
    unreadable = _UNREADABLE_RE.search(forward_out) or _UNREADABLE_RE.search(reverse_out)
    if unreadable:
        raise UserError(f"{patch.source.entry.label}: git apply cannot read the remapped patch "
                        f"({unreadable.group(1)[:120]}); regenerate the patch with `git diff --binary`")
    if forward_ok and not reverse_ok:
        return STATE_APPLIES, _offsets(forward_out), []
    if reverse_ok and not forward_ok:
        return STATE_UPSTREAM, _offsets(reverse_out), []
    if forward_ok and reverse_ok:
        return STATE_CONFLICTS, {}, ["applies both forward and in reverse: cannot tell whether it is already upstream; regenerate it with more context (-U5)"]
    return STATE_CONFLICTS, {}, diagnose_conflict(tree, patch_file, patch, git)


def _offsets(output: str) -> dict[str, dict[int, int]]:
    return {path: {h: o for h, o in report.offsets.items() if o} for path, report in parse_git_apply_output(output).items()}


def _touched_paths(remapped: list[RemappedPatch]) -> set[str]:
    return {p for patch in remapped for f in patch.files for p in (f.old_wheel, f.new_wheel) if p}


def materialize_work_tree(target: Path, tree: Path, touched: set[str]) -> str:
    """The tree the series is checked and applied in; returns the wheel's sha256 ('' for a directory).

    Only the files the series names (and the dist-info) are put there: git apply reads nothing
    else, and the untouched files are verified straight from the wheel (or directory), which
    spares writing thousands of files for a check.
    """
    started = time.monotonic()
    if target.is_file():
        target_sha = sha256_file(target)
        tree.mkdir()
        count = wheel_repack.unpack_wheel(target, tree, only=lambda name: name in touched or ".dist-info/" in name)
        log(f"extracted {count} of the files of {target.name} ({target.stat().st_size / 1e6:.1f} MB) in {time.monotonic() - started:.1f} s")
        return target_sha
    if target.is_dir():
        dist = wheel_repack.find_dist_info(target)
        shutil.copytree(target / dist.dirname, tree / dist.dirname, symlinks=True)
        for rel in sorted(touched):
            src = target / rel
            if src.is_file():
                (tree / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, tree / rel)
        log(f"copied the dist-info and {len(touched)} named files of {target} in {time.monotonic() - started:.1f} s")
        return ""
    raise UserError(f"--target {target}: neither a wheel file nor an unpacked wheel directory; pass the pinned wheel")


def _hash_or_none(path: Path) -> str | None:
    return sha256_file(path) if path.is_file() else None


def run_gate(inputs: GateInputs, out_dir: Path | None, expected_manifest: Path | None = None) -> GateResult:
    """Check and apply the series in a scratch copy; on success move the full tree to out_dir.

    With `expected_manifest`, the built manifest is compared with it before out_dir is touched:
    on drift the previous output stays as it was (result.drift lists the differences).
    """
    expected = read_manifest(expected_manifest) if expected_manifest else None
    remapped = [remap_patch(source, inputs.layout) for source in inputs.sources]
    touched = _touched_paths(remapped)
    if inputs.target.is_dir():
        for patch in remapped:  # a wheel cannot hold symlinks (unpack refuses them); a directory can
            refuse_symlinked_paths(inputs.target, patch)
    scratch_parent = out_dir.resolve().parent if out_dir else None
    if scratch_parent:
        scratch_parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out_dir.name if out_dir else 'gate'}.scratch-", dir=scratch_parent))
    try:
        work = scratch / "work"
        target_sha = materialize_work_tree(inputs.target, work, touched)
        dist = wheel_repack.find_dist_info(work)
        record = wheel_repack.read_record(work, dist, f"wheel {inputs.target.name}" if target_sha else f"--target {inputs.target}")
        results, before, changed_by = _apply_series(work, scratch / "patches", remapped, inputs.git)
        result = GateResult(inputs=inputs, target_sha256=target_sha, dist=dist, results=results, changed={},
                            untouched_verified=0, record_files=sum(1 for e in record.values() if e.sha256))
        if not result.ok:
            return result
        _verify_touched_before(before, record)
        for path, sha_before in sorted(before.items()):
            sha_after = _hash_or_none(work / path)
            if sha_after != sha_before:
                result.changed[path] = (sha_before, sha_after, changed_by[path])
        started = time.monotonic()
        if target_sha:
            result.untouched_verified = wheel_repack.verify_archive_untouched(inputs.target, record, set(before))
        else:
            result.untouched_verified = wheel_repack.verify_untouched(inputs.target, record, set(before))
        log(f"verified {result.untouched_verified} untouched files against RECORD in {time.monotonic() - started:.1f} s")
        if expected is not None:
            result.expected_manifest = expected_manifest
            result.drift = manifest_drift(expected, build_manifest(result))
            if result.drift:
                return result
        if out_dir is not None:
            replace_dir(_full_tree(inputs.target, work, scratch, set(before)), out_dir, "--out-dir", tool=None)
        return result
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _full_tree(target: Path, work: Path, scratch: Path, touched: set[str]) -> Path:
    """The complete patched tree: the wheel unpacked (or the directory copied), the series' files laid over it."""
    started = time.monotonic()
    full = scratch / "full"
    if target.is_file():
        full.mkdir()
        count = wheel_repack.unpack_wheel(target, full)
    else:
        shutil.copytree(target, full, symlinks=True)
        count = len(wheel_repack.list_tree_files(full))
    for rel in sorted(touched):
        patched, dest = work / rel, full / rel
        if patched.is_file():
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(patched, dest)
        else:
            dest.unlink(missing_ok=True)
            # git apply drops directories a deletion empties; do the same here.
            for parent in dest.parents:
                if parent == full or any(parent.iterdir()):
                    break
                parent.rmdir()
    log(f"wrote {count} files and laid {len(touched)} patched files over them in {time.monotonic() - started:.1f} s")
    return full


def _apply_series(tree: Path, patch_dir: Path, remapped: list[RemappedPatch], git: GitApply
                  ) -> tuple[list[PatchResult], dict[str, str | None], dict[str, list[str]]]:
    """Check patch N against the tree with 1..N-1 applied, apply it if it applies."""
    patch_dir.mkdir()
    results: list[PatchResult] = []
    before: dict[str, str | None] = {}
    changed_by: dict[str, list[str]] = {}
    for index, patch in enumerate(remapped, start=1):
        label = patch.source.entry.label
        log(f"patch {index}/{len(remapped)} {label}: {len(patch.files)} files, {len(patch.excluded)} excluded")
        if not patch.files:
            results.append(PatchResult(index, patch, STATE_EXCLUDED, note="every file excluded: nothing to apply"))
            continue
        refuse_symlinked_paths(tree, patch)
        patch_file = patch_dir / f"{index:02d}.patch"
        patch_file.write_bytes(patch.text.encode("utf-8", errors="surrogateescape"))
        state, offsets, conflicts = classify_patch(tree, patch_file, patch, git)
        if state == STATE_APPLIES:
            for mapped in patch.files:
                for wheel_path in {p for p in (mapped.old_wheel, mapped.new_wheel) if p}:
                    before.setdefault(wheel_path, _hash_or_none(tree / wheel_path))
                    changed_by.setdefault(wheel_path, []).append(label)
            applied, output = git.run(tree, patch_file)
            if not applied:
                state, conflicts = STATE_CONFLICTS, [f"git apply failed after a clean check: {output.strip()}"]
        results.append(PatchResult(index, patch, state, offsets=offsets, conflicts=conflicts))
    return results, before, changed_by


def _verify_touched_before(before: dict[str, str | None], record: dict[str, wheel_repack.RecordEntry]) -> None:
    """The files the series touches must be the pinned upstream bytes before the first patch."""
    for path, sha in sorted(before.items()):
        entry = record.get(path)
        expected = entry.sha256 if entry else None
        if sha != expected:
            what = "absent" if sha is None else ("not in RECORD" if entry is None else "differs from its RECORD sha256")
            raise UserError(f"upstream drift: {path} {what} before patching; re-fetch the pinned wheel")


def _format_offsets(offsets: dict[int, int]) -> str:
    return ", ".join(f"#{h} {o:+d}" for h, o in sorted(offsets.items())) or "none"


def render_table(result: GateResult) -> str:
    """The gate's verdict, readable at a glance: one row per file of each patch."""
    inputs = result.inputs
    header = ("#", "patch", "state", "file (wheel path)", "hunks", "offsets")
    rows: list[tuple[str, ...]] = []
    details: list[str] = []
    for r in result.results:
        label = r.patch.source.entry.label
        first = True
        for f in r.patch.files:
            rows.append((str(r.index) if first else "", label if first else "", r.state if first else "",
                         f.wheel, str(len(f.hunks)), _format_offsets(r.offsets.get(f.wheel, {}))
                         if r.state != STATE_CONFLICTS else "-"))
            first = False
        for e in r.patch.excluded:
            rows.append((str(r.index) if first else "", label if first else "", r.state if first else "",
                         f"excluded: {e.source}", "-", "-"))
            first = False
        if first:
            rows.append((str(r.index), label, r.state, r.note or "(no files)", "-", "-"))
        details += [f"  {r.index} {label}: {line}" for line in r.conflicts]
        details += [f"  {r.index} {label}: excluded {e.source} ({e.reason})" for e in r.patch.excluded]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    fmt = lambda row: "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip()  # noqa: E731
    sha = result.target_sha256[:12] if result.target_sha256 else "(directory)"
    lines = [f"patch gate: {inputs.target.name} (sha256 {sha}), series {inputs.series.name} ({len(result.results)} patch{'' if len(result.results) == 1 else 'es'}), layout {inputs.layout.name}",
             fmt(header), fmt(tuple("-" * w for w in widths)), *map(fmt, rows)]
    conflicts = [d for d in details if ": excluded " not in d]
    if conflicts:
        lines += ["conflicts (file: hunk: state):", *conflicts]
    excluded = [d for d in details if ": excluded " in d]
    if excluded:
        lines += ["excluded (not in the wheel):", *excluded]
    if result.accepted:
        lines.append(f"result: series applied; {len(result.changed)} files changed, "
                     f"{result.untouched_verified} untouched files verified against RECORD")
    elif result.ok:
        lines.append(f"result: REFUSED; nothing was written (the built manifest differs from "
                     f"{result.expected_manifest} in {len(result.drift)} places, listed on stderr)")
    else:
        lines.append("result: REFUSED; nothing was written (conflicting patches above; later patches were "
                     "checked against a tree without them)")
    lines.append("offsets: lines a hunk moved from its header's line; fuzz: none (git apply requires every context line)")
    return "\n".join(lines) + "\n"


def write_remapped(out: Path, patches: list[RemappedPatch], what: str) -> None:
    """The remapped patches (what git apply saw), one file per series entry, for review."""
    with dir_replaced_atomically(out.resolve(), what, tool=REMAPPED_TOOL) as tmp:
        for index, patch in enumerate(patches, start=1):
            name = re.sub(r"[^A-Za-z0-9._-]+", "-", patch.source.entry.label)
            (tmp / f"{index:02d}-{name}.wheel.patch").write_bytes(patch.text.encode("utf-8", errors="surrogateescape"))
