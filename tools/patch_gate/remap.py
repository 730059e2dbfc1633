"""The wheel-layout remap: upstream source paths rewritten to where the wheel holds the files.

wheel_layout.json declares the rules (map: source prefix -> wheel prefix; exclude: not in the
wheel, with why); the longest matching rule wins and a path no rule covers is an error.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tools.common.errors import UserError
from tools.common.hashing import sha256_bytes
from tools.common.jsondata import parse_json
from tools.patch_gate.patch import Hunk, split_patch
from tools.patch_gate.series import PatchSource
from tools.patch_gate.wheel import check_member_path

LAYOUT_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class LayoutRule:
    """A source-path prefix (ending in '/') or exact file and where it lives in the wheel (None: excluded)."""

    source: str
    wheel: str | None
    reason: str

    def matches(self, path: str) -> bool:
        return path.startswith(self.source) if self.source.endswith("/") else path == self.source

    def apply(self, path: str) -> str:
        assert self.wheel is not None
        return self.wheel + path[len(self.source):]


_LAYOUT_KEYS = {"schema_version", "description", "map", "exclude"}
_JSON_KINDS = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}
# Per kind of rule: its fields, and whether each is required.
_RULE_FIELDS = {"map": {"source": True, "wheel": True, "why": False}, "exclude": {"source": True, "why": True}}


def _parse_rule(item: object, kind: str, number: int, where: str) -> LayoutRule:
    """One `map` or `exclude` item; a wrong shape is named with its place and the fix."""
    fields = _RULE_FIELDS[kind]
    shape = ", ".join(f'"{key}": "..."' for key in fields)
    if not isinstance(item, dict):
        raise UserError(f"{where}: {kind} item {number} is {_JSON_KINDS[type(item)]}, not an object; write it as {{{shape}}}")
    label = f"{kind} item {number}" + (f" ({item['source']!r})" if isinstance(item.get("source"), str) else "")
    unknown = sorted(set(item) - set(fields))
    if unknown:
        raise UserError(f"{where}: {label} has the unknown key {unknown[0]!r}; its keys are {', '.join(fields)}")
    for key, required in fields.items():
        if key not in item:
            if not required:
                continue
            hint = "say why it is not in the wheel" if key == "why" else f"write it as {{{shape}}}"
            raise UserError(f"{where}: {label} has no `{key}`; {hint}")
        value = item[key]
        if not isinstance(value, str):
            raise UserError(f"{where}: {label}: `{key}` is {_JSON_KINDS[type(value)]}; make it a string")
        if required and not value.strip():
            raise UserError(f"{where}: {label}: `{key}` is empty; "
                            f"{'say why it is not in the wheel' if key == 'why' else 'fill it in'}")
    return LayoutRule(source=item["source"], wheel=item.get("wheel") if kind == "map" else None, reason=item.get("why", ""))


@dataclass(frozen=True)
class WheelLayout:
    """Declared source->wheel path rules; the longest matching rule wins."""

    name: str
    sha256: str
    rules: tuple[LayoutRule, ...]

    @classmethod
    def load(cls, path: Path) -> WheelLayout:
        where = f"--layout {path}"
        try:
            data = path.read_bytes()
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"{where}: unreadable ({e}); pass a wheel_layout.json") from e
        # The fields are checked by hand below: each message names the rule by its number and the fix.
        doc = parse_json(text, where)
        if not isinstance(doc, dict):
            raise UserError(f"{where}: holds {_JSON_KINDS[type(doc)]}, not an object "
                            f'{{"schema_version": {LAYOUT_SCHEMA_VERSION}, "map": [...], "exclude": [...]}}; fix the file')
        if type(doc.get("schema_version")) is not int or doc["schema_version"] != LAYOUT_SCHEMA_VERSION:
            raise UserError(f"{where}: schema_version must be {LAYOUT_SCHEMA_VERSION}")
        unknown = sorted(set(doc) - _LAYOUT_KEYS)
        if unknown:
            raise UserError(f"{where}: unknown key {unknown[0]!r}; the keys are {', '.join(sorted(_LAYOUT_KEYS))}")
        rules: list[LayoutRule] = []
        for kind in ("map", "exclude"):
            items = doc.get(kind, [])
            if not isinstance(items, list):
                raise UserError(f"{where}: `{kind}` is {_JSON_KINDS[type(items)]}; make it a list of rule objects")
            rules += [_parse_rule(item, kind, number, where) for number, item in enumerate(items, start=1)]
        sources = [r.source for r in rules]
        for rule in rules:
            if sources.count(rule.source) > 1:
                raise UserError(f"{where}: source {rule.source!r} has two rules; keep one")
            if rule.wheel is not None and rule.source.endswith("/") != rule.wheel.endswith("/"):
                raise UserError(f"{where}: rule {rule.source!r} -> {rule.wheel!r} mixes a directory and a file; end both with '/' or neither")
        return cls(name=path.name, sha256=sha256_bytes(data), rules=tuple(rules))

    def rule_for(self, source_path: str, origin: str) -> LayoutRule:
        matching = [r for r in self.rules if r.matches(source_path)]
        if not matching:
            raise UserError(f"{origin}: {source_path} matches no rule of {self.name}; add a map or exclude rule for it")
        return max(matching, key=lambda r: len(r.source))


@dataclass(frozen=True)
class MappedFile:
    """A file section after the layout remap."""

    source: str
    wheel: str
    old_wheel: str | None
    new_wheel: str | None
    hunks: tuple[Hunk, ...]


@dataclass(frozen=True)
class ExcludedFile:
    source: str
    reason: str


@dataclass(frozen=True)
class RemappedPatch:
    """A patch rewritten to wheel paths: `text` is what git apply sees and what reviewers read."""

    source: PatchSource
    text: str
    files: tuple[MappedFile, ...]
    excluded: tuple[ExcludedFile, ...]


def _rewrite_header(lines: list[str], old_wheel: str | None, new_wheel: str | None) -> list[str]:
    """Section lines with every path-bearing header line pointing at the wheel paths."""
    a_name = old_wheel or new_wheel
    b_name = new_wheel or old_wheel
    out = [f"diff --git a/{a_name} b/{b_name}"]
    in_header = True
    for line in lines[1:]:
        if in_header and (line.startswith("@@ ") or line.startswith("GIT binary patch")):
            in_header = False
        if in_header:
            if line.startswith("--- ") and old_wheel is not None:
                line = f"--- a/{old_wheel}"
            elif line.startswith("+++ ") and new_wheel is not None:
                line = f"+++ b/{new_wheel}"
            elif line.startswith(("rename from ", "copy from ")):
                line = f"{line.split(' from ')[0]} from {old_wheel}"
            elif line.startswith(("rename to ", "copy to ")):
                line = f"{line.split(' to ')[0]} to {new_wheel}"
        out.append(line)
    return out


def remap_patch(source: PatchSource, layout: WheelLayout) -> RemappedPatch:
    """Rewrite a source-layout patch to the wheel layout.

    Why rewrite the text instead of `git apply --directory/--include`: --directory prepends one
    root to every path, while one upstream patch spans several rules (flashinfer/ stays,
    csrc/ moves under flashinfer/data/); that would need one partial apply per rule, splitting a
    patch's single state and hiding exclusions. The rewritten patch is saved for review.
    """
    origin = source.entry.label
    text = source.data.decode("utf-8", errors="surrogateescape")
    preamble, sections = split_patch(text, origin)
    kept: list[str] = list(preamble)
    files: list[MappedFile] = []
    excluded: list[ExcludedFile] = []
    for section in sections:
        rules = {p: layout.rule_for(p, origin) for p in (section.old_path, section.new_path) if p is not None}
        if all(r.wheel is None for r in rules.values()):
            reason = "; ".join(sorted({f"{r.source}: {r.reason}" for r in rules.values()}))
            excluded.append(ExcludedFile(source=section.path, reason=reason))
            continue
        if any(r.wheel is None for r in rules.values()):
            raise UserError(f"{origin}: {section.path} moves between an excluded and a shipped path; split the patch")
        old_wheel = rules[section.old_path].apply(section.old_path) if section.old_path else None
        new_wheel = rules[section.new_path].apply(section.new_path) if section.new_path else None
        for wheel_path in (old_wheel, new_wheel):
            if wheel_path is not None:
                check_member_path(wheel_path, f"{origin} (remapped by {layout.name})")
                if wheel_path.split("/", 1)[0].endswith(".dist-info"):
                    raise UserError(f"{origin}: {section.path} maps into {wheel_path}; patches may not edit wheel metadata, fix {layout.name}")
        kept += _rewrite_header(section.lines, old_wheel, new_wheel)
        files.append(MappedFile(source=section.path, wheel=new_wheel or old_wheel or "", old_wheel=old_wheel,
                                new_wheel=new_wheel, hunks=tuple(section.hunks)))
    # The lines are the source's own, so joining them gives its bytes back. A patch that ends in
    # "\n" ends with an empty last element that split_patch leaves out of the last section, so the
    # newline is added back here, once: a binary hunk ends with an empty line, and dropping that
    # line makes git skip the file (or, for a lone binary section, find no patch at all).
    remapped = "\n".join(kept) + "\n"
    return RemappedPatch(source=source, text=remapped, files=tuple(files), excluded=tuple(excluded))
