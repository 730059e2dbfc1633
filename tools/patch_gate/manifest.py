"""The gate's manifest: what the series did to the wheel (patches, states, changed files with
sha256 before and after), its drift against the committed <stack>.manifest.json, and the
install that rewrites the committed one (`bazel run //<folder>:update_manifest`).

The manifest bytes are tools.common.jsonfmt.review_json (sorted keys, 2-space indent, trailing
newline): committed manifests diff only where their content changed.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tools.common.errors import UserError
from tools.common.files import workspace_path, write_bytes_atomic
from tools.common.jsondata import INTEGER, TEXT, Enum, ListOf, Nullable, Object, load_json_file, parse_json
from tools.common.jsonfmt import review_json
from tools.patch_gate.result import GateResult

MANIFEST_SCHEMA_VERSION = 1
# What build_manifest writes: the committed <stack>.manifest.json and the gate's manifest.json.
MANIFEST = Object({
    "schema_version": Enum(MANIFEST_SCHEMA_VERSION),
    "series": TEXT,
    "layout": Object({"file": TEXT, "sha256": TEXT}),
    "target": Object({"pin": Nullable(TEXT), "sha256": Nullable(TEXT), "dist": Nullable(TEXT),
                      "version": Nullable(TEXT)}),
    "patches": ListOf(Object({
        "entry": TEXT, "sha256": TEXT, "state": TEXT,
        "files": ListOf(Object({"source": TEXT, "wheel": TEXT, "hunks": INTEGER,
                                "offsets": ListOf(Object({"hunk": INTEGER, "lines": INTEGER}))})),
        "excluded": ListOf(Object({"source": TEXT, "why": TEXT})),
    })),
    # null: the file is not there before (added) or after (deleted) the series.
    "changed_files": ListOf(Object({"path": TEXT, "sha256_before": Nullable(TEXT), "sha256_after": Nullable(TEXT),
                                    "changed_by": ListOf(TEXT)})),
    "untouched_files_verified": INTEGER,
    "record_files_with_hash": INTEGER,
})
BUILT_FIX = "pass the patch gate's manifest.json"


def build_manifest(result: GateResult) -> dict[str, Any]:
    inputs = result.inputs
    return {
        "schema_version": MANIFEST_SCHEMA_VERSION,
        "series": inputs.series.name,
        "layout": {"file": inputs.layout.name, "sha256": inputs.layout.sha256},
        "target": {
            "pin": inputs.target_pin,
            "sha256": result.target_sha256 or None,
            "dist": result.dist.name if result.dist else None,
            "version": result.dist.version if result.dist else None,
        },
        "patches": [
            {
                "entry": r.patch.source.entry.label,
                "sha256": r.patch.source.sha256,
                "state": r.state,
                "files": [
                    {"source": f.source, "wheel": f.wheel, "hunks": len(f.hunks),
                     "offsets": [{"hunk": h, "lines": o} for h, o in sorted(r.offsets.get(f.wheel, {}).items())]}
                    for f in r.patch.files
                ],
                "excluded": [{"source": e.source, "why": e.reason} for e in r.patch.excluded],
            }
            for r in result.results
        ],
        "changed_files": [
            {"path": path, "sha256_before": b, "sha256_after": a, "changed_by": by}
            for path, (b, a, by) in sorted(result.changed.items())
        ],
        "untouched_files_verified": result.untouched_verified,
        "record_files_with_hash": result.record_files,
    }


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    """Manifest as `key.path -> scalar`, lists keyed by their identifying field so diffs name things."""
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}" if prefix else key, out)
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        for position, item in enumerate(value):
            ident = next((item[k] for k in ("path", "entry", "wheel", "source", "hunk") if k in item), position)
            _flatten(item, f"{prefix}[{ident}]", out)
    else:
        out[prefix] = value


def manifest_drift(expected: dict[str, Any], built: dict[str, Any]) -> list[str]:
    """One line per difference, naming the file / patch / field that drifted."""
    flat_expected: dict[str, Any] = {}
    flat_built: dict[str, Any] = {}
    _flatten(expected, "", flat_expected)
    _flatten(built, "", flat_built)
    lines = []
    for key in sorted(set(flat_expected) | set(flat_built)):
        if key not in flat_built:
            lines.append(f"{key}: expected {flat_expected[key]!r}, not in the built manifest")
        elif key not in flat_expected:
            lines.append(f"{key}: built {flat_built[key]!r}, not in the expected manifest")
        elif flat_expected[key] != flat_built[key]:
            lines.append(f"{key}: expected {flat_expected[key]!r}, built {flat_built[key]!r}")
    return lines


def write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    write_bytes_atomic(path, review_json(manifest))


def read_manifest(path: Path, what: str = "--expected-manifest") -> dict[str, Any]:
    """The expected (committed) manifest; unreadable or not a manifest is bad input naming `what`
    (how the user gave it) and the fix."""
    return load_json_file(path, what, MANIFEST, f"{fix_command(path)} writes it")


def fix_command(expected_path: Path) -> str:
    """The command that rewrites an expected manifest: the Bazel target for the committed ones."""
    stack = expected_path.name.removesuffix(".manifest.json")
    package = expected_path.parent.name
    if expected_path.name.endswith(".manifest.json") and package in ("flashinfer_patches", "sglang_patches"):
        config = "" if stack == "default" else f" --config={stack}"
        return f"`tools/bazel run //{package}:update_manifest{config}`"
    return (f"`python3 -m tools.patch_gate update-manifest <the same --series/--target/--layout/--pin-file/--lock/"
            f"--target-pin> --expected-manifest {expected_path}`")


def print_drift(expected_path: Path, drift: list[str]) -> None:
    """The drift report: the manifest, every differing field (file paths named), and the fix."""
    print(f"manifest drift against {expected_path} ({len(drift)} differences):", file=sys.stderr)
    for line in drift:
        print(f"  {line}", file=sys.stderr)
    print(f"fix the inputs, or if the change is intended run {fix_command(expected_path)} and review the diff of "
          f"{expected_path}", file=sys.stderr)


def read_built(path: Path) -> dict[str, Any]:
    """The manifest the gate wrote (`--built`)."""
    return load_json_file(path, "--built", MANIFEST, BUILT_FIX)


def check_manifest(built_path: Path, expected_path: Path) -> list[str]:
    """The drift of a built manifest against the expected one (the Bazel validation of the gate's tree)."""
    built = read_built(built_path)
    return manifest_drift(read_manifest(expected_path), built)


def install_manifest(built_path: Path, expected_path: Path) -> tuple[Path, list[str] | None]:
    """Write a built manifest over the committed expected one (`bazel run //...:update_manifest`).

    Returns the path written and the fields that changed (None: there was no readable manifest).
    """
    built = read_built(built_path)
    target = workspace_path(expected_path)
    try:
        old = parse_json(target.read_text(encoding="utf-8"), str(target)) if target.is_file() else None
    except (OSError, UnicodeDecodeError, UserError):
        old = None  # an unreadable manifest is what this command repairs
    write_manifest(target, built)
    return target, manifest_drift(old, built) if isinstance(old, dict) else None
