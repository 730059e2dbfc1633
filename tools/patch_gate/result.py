"""What one gate run was given and what became of each patch: the data both the gate
(tools/patch_gate/gate.py, which fills it) and the manifest (manifest.py, which records it) read,
in one module below both."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tools.patch_gate import wheel as wheel_repack
from tools.patch_gate.gitapply import GitApply
from tools.patch_gate.remap import RemappedPatch, WheelLayout
from tools.patch_gate.series import PatchSource

STATE_APPLIES = "applies"
STATE_UPSTREAM = "already upstream"
STATE_CONFLICTS = "conflicts"
# Every file of the patch is outside the wheel (tests/, benchmarks/...): nothing was applied, and
# saying `applies` would claim (in the table, the manifest and the SBOM) that it was.
STATE_EXCLUDED = "excluded"



@dataclass
class PatchResult:
    """The one state a patch ends in, with the evidence shown in the table."""

    index: int
    patch: RemappedPatch
    state: str
    offsets: dict[str, dict[int, int]] = field(default_factory=dict)
    conflicts: list[str] = field(default_factory=list)
    note: str = ""


@dataclass
class GateInputs:
    series: Path
    target: Path
    layout: WheelLayout
    sources: list[PatchSource]
    target_pin: str | None
    git: GitApply


@dataclass
class GateResult:
    inputs: GateInputs
    target_sha256: str
    dist: wheel_repack.DistInfo | None
    results: list[PatchResult]
    changed: dict[str, tuple[str | None, str | None, list[str]]]
    untouched_verified: int
    record_files: int
    # Set when an expected manifest was given: where it is and each difference from the built one.
    expected_manifest: Path | None = None
    drift: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No patch conflicts (the series itself went through)."""
        return all(r.state != STATE_CONFLICTS for r in self.results)

    @property
    def accepted(self) -> bool:
        """No conflict and no drift: the only case in which anything is written."""
        return self.ok and not self.drift
