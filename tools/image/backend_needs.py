"""What a launch profile's settings need from the image: image/backend_needs.json (--needs), its
entries by checkpoint architecture and by the value SGLang resolves a setting to, each feature
one the image probe knows (tools/image/profile_probe.py FEATURES)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from tools.common.errors import UserError
from tools.common.jsondata import TEXT, Enum, ListOf, MapOf, Object, json_path, load_json_file
from tools.image import profile_probe
from tools.image.launch_profiles import Profile

# image/backend_needs.json: an entry per checkpoint architecture, and per ServerArgs field and
# the value SGLang resolves it to (the file's description says what each field is).
NEEDS_ENTRY = Object({"why": TEXT}, optional={
    "modules": MapOf(Object({}, optional={"runners": ListOf(TEXT)})),
    "features": ListOf(TEXT),
})
BACKEND_NEEDS = Object({
    "schema_version": Enum(1),
    "arch": TEXT,
    "settings": MapOf(MapOf(NEEDS_ENTRY)),
}, optional={"description": TEXT, "architectures": MapOf(NEEDS_ENTRY)})


@dataclass(frozen=True)
class Need:
    """What one profile setting (or its checkpoint architecture) needs from the image."""

    because: str  # e.g. "--moe-runner-backend flashinfer_mxfp4", "checkpoint KimiK3ForConditionalGeneration"
    modules: Mapping[str, tuple[str, ...]]  # module -> CUTLASS MoE runners it must have compiled in
    features: tuple[str, ...]


def load_needs(path: Path) -> dict[str, Any]:
    """image/backend_needs.json (--needs), checked: BACKEND_NEEDS's types, and every feature one
    the image probe knows."""
    data = load_json_file(path, "--needs", BACKEND_NEEDS)
    entries = [(["architectures", a], e) for a, e in data.get("architectures", {}).items()]
    entries += [(["settings", s, v], e) for s, table in data["settings"].items() for v, e in table.items()]
    for keys, entry in entries:
        for i, feature in enumerate(entry.get("features", [])):
            if feature not in profile_probe.FEATURES:
                raise UserError(f"--needs {path}: {json_path([*keys, 'features', i])}: feature {feature!r} has no "
                                f"probe; known: {', '.join(sorted(profile_probe.FEATURES))} "
                                "(tools/image/profile_probe.py FEATURES)")
    return data


def _need(because: str, entry: Mapping[str, Any]) -> Need:
    modules = {m: tuple(spec.get("runners", ())) for m, spec in entry.get("modules", {}).items()}
    return Need(because, modules, tuple(entry.get("features", ())))


def needs_of(profile: Profile, values: Mapping[str, Any], flags: Mapping[str, str],
             table: Mapping[str, Any]) -> list[Need]:
    """The needs of a checked profile: its checkpoint architecture's and those of each setting
    whose resolved value the table lists."""
    out = [_need(f"checkpoint {arch}", table["architectures"][arch])
           for arch in profile.architectures if arch in table.get("architectures", {})]
    for setting, by_value in table["settings"].items():
        value = values.get(setting)
        if value is not None and str(value) in by_value:
            out.append(_need(f"{flags.get(setting, setting)} {value}", by_value[str(value)]))
    return out


def features_needed(table: Mapping[str, Any]) -> list[str]:
    entries = [*table.get("architectures", {}).values(), *(e for t in table["settings"].values() for e in t.values())]
    return sorted({f for e in entries for f in e.get("features", ())})
