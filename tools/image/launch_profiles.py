"""Launch profiles (image/profiles/NAME.json): their format, loaded and validated (no key twice,
no flag twice, placeholders declared and used, the checkpoint facts), and checked beyond their
own file: a known kernel selection, and the image entrypoint's guard accepting them for every
pinned Mooncake; the defaults of the check's inputs and the image paths of the entrypoint and
the profiles."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from tools.common.errors import UserError
from tools.common.jsondata import TEXT, Enum, ListOf, MapOf, Object, load_json_file
from tools.image import profile_probe

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PROFILES_DIR = REPO_ROOT / "image" / "profiles"
DEFAULT_NEEDS = REPO_ROOT / "image" / "backend_needs.json"
DEFAULT_ENTRYPOINT = REPO_ROOT / "image" / "entrypoint.py"
DEFAULT_SELECTIONS = REPO_ROOT / "kernel_cache" / "selections.json"
DEFAULT_LOCK = REPO_ROOT / "third_party" / "pins.lock.json"
# Image paths, as image/constants.bzl sets them (ENTRYPOINT, PROFILES_DIR; tests/cpu/image checks).
ENTRYPOINT_IMAGE_PATH = "/usr/local/bin/kimi-k3-entrypoint"
PROFILES_IMAGE_PATH = "/usr/share/kimi-k3/profiles"
SCHEMA_VERSION = 1
# A launch profile's fields and their types (what each is for: README "Launch profiles");
# validate_profile checks what a type cannot say.
LAUNCH_PROFILE = Object({
    "schema_version": Enum(SCHEMA_VERSION),
    "description": TEXT,
    # The only checkpoint facts the check may assume: the architecture and model type.
    "checkpoint": Object({"placeholder": TEXT,
                          "config": Object({"architectures": ListOf(TEXT, non_empty=True), "model_type": TEXT})}),
    "needs": Object({"kernel_selection": TEXT}),  # a selection of kernel_cache/selections.json
    "args": ListOf(TEXT, non_empty=True),  # SGLang's arguments
}, optional={
    "placeholders": MapOf(Object({"description": TEXT, "example": TEXT})),
    "env": MapOf(TEXT),
    # What operators must know before choosing this profile (known failures, measured speed), in
    # the file they read; the entrypoint's warnings say the same at start.
    "notes": ListOf(TEXT),
})
PROFILE_FIX = "see README 'Launch profiles' for the format"
PLACEHOLDER_NAME = re.compile(r"[A-Z][A-Z0-9_]*")
PLACEHOLDER_USE = re.compile(r"\$\{([^}]*)\}")


@dataclass(frozen=True)
class Profile:
    name: str
    path: Path
    data: Mapping[str, Any]

    @property
    def architectures(self) -> list[str]:
        return list(self.data["checkpoint"]["config"]["architectures"])

    @property
    def kernel_selection(self) -> str:
        return str(self.data["needs"]["kernel_selection"])


def validate_profile(name: str, path: Path, data: Mapping[str, Any]) -> Profile:
    """The profile from `data` (LAUNCH_PROFILE's types already checked), or a UserError naming
    the file, the field and the fix: what a type cannot say."""
    where = f"profile {path}"
    args, env, placeholders = data["args"], data.get("env", {}), data.get("placeholders", {})
    flags = [a.partition("=")[0] for a in args if a.startswith("--")]
    twice = sorted({f for f in flags if flags.count(f) > 1})
    if twice:
        raise UserError(f"{where} args: {', '.join(twice)} given twice (SGLang keeps the last one silently); "
                        "keep one")
    for var in env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", var):
            raise UserError(f"{where} env: {var!r} is not an environment variable name; {PROFILE_FIX}")
    for key in placeholders:
        if not PLACEHOLDER_NAME.fullmatch(key):
            raise UserError(f"{where} placeholders: {key!r} is not UPPER_CASE; name site values like MODEL_PATH")
    used = {m.group(1) for text in [*args, *env.values()] for m in PLACEHOLDER_USE.finditer(text)}
    undeclared, unused = sorted(used - set(placeholders)), sorted(set(placeholders) - used)
    if undeclared or unused:
        raise UserError(f"{where}: placeholders used but not declared {undeclared}, declared but not used {unused}; "
                        "declare each ${NAME} the args or env use under placeholders, and only those")
    checkpoint = data["checkpoint"]
    if checkpoint["placeholder"] not in placeholders:
        raise UserError(f"{where} checkpoint placeholder {checkpoint['placeholder']!r}: not one of the placeholders; "
                        "name the placeholder of the checkpoint directory (e.g. MODEL_PATH)")
    return Profile(name, path, data)


def load_profile_files(paths: Sequence[Path]) -> dict[str, Profile]:
    """The profiles NAME.json at `paths`, validated."""
    profiles = {}
    for path in paths:
        name = path.name[:-len(".json")] if path.name.endswith(".json") else ""
        if not re.fullmatch(r"[a-z0-9][a-z0-9.-]*", name):
            raise UserError(f"profile {path}: name the file NAME.json with NAME of lower-case letters, digits, '-', '.'")
        if name in profiles:
            raise UserError(f"profile {path}: a second profile {name} ({profiles[name].path}); keep one")
        profiles[name] = validate_profile(name, path, load_json_file(path, "profile", LAUNCH_PROFILE, PROFILE_FIX))
    return profiles


def load_profiles(profiles_dir: Path) -> dict[str, Profile]:
    """Every NAME.json of profiles_dir, validated."""
    if not profiles_dir.is_dir():
        raise UserError(f"--profiles-dir {profiles_dir}: not a directory; pass image/profiles or a copy of it")
    profiles = load_profile_files(sorted(profiles_dir.glob("*.json")))
    if not profiles:
        raise UserError(f"--profiles-dir {profiles_dir}: no NAME.json profiles in it")
    return profiles


def pinned_mooncake(lock_path: Path) -> dict[str, list[str]]:
    """Mooncake version -> the stacks of the lock that pin it (their `mooncake` role)."""
    from tools.pins.lock import load

    lock = load(lock_path)
    versions: dict[str, list[str]] = {}
    for name, stack in sorted(lock.stacks.items()):
        pin_name = stack.roles.get("mooncake")
        if pin_name is None:
            raise UserError(f"{lock_path}: stack {name} pins no mooncake; the entrypoint guard judges profiles "
                            "for the stack's Mooncake release")
        package = getattr(lock.pin(pin_name), "package", None)
        if package is None:
            raise UserError(f"{lock_path}: pin {pin_name} (stack {name}'s mooncake) names no package version")
        versions.setdefault(package.version, []).append(name)
    return versions


def check_profiles(profiles: Mapping[str, Profile], selections_path: Path, lock_path: Path,
                   entrypoint_path: Path = DEFAULT_ENTRYPOINT) -> None:
    """What a profile needs beyond its own file: a known kernel selection, and the image
    entrypoint's guard accepting its args and env (with the examples) for every pinned Mooncake."""
    from tools.kernel_cache.selection import load_selections

    selections = load_selections(selections_path)["selections"]
    entrypoint = load_entrypoint(entrypoint_path)
    mooncake = pinned_mooncake(lock_path)
    for profile in profiles.values():
        if profile.kernel_selection not in selections:
            raise UserError(f"profile {profile.path} needs kernel_selection: {profile.kernel_selection!r} is not a "
                            f"selection of {selections_path} (known: {', '.join(sorted(selections))})")
        examples = {k: spec["example"] for k, spec in profile.data.get("placeholders", {}).items()}
        try:
            args, env = entrypoint.resolve_profile(profile.name, examples, str(profile.path.parent))
        except entrypoint.ProfileError as e:
            raise UserError(f"profile {profile.path}: the image's entrypoint cannot resolve it: {e}") from None
        for version, stacks in mooncake.items():
            refused = entrypoint.refusal(args, env, mooncake_version=version)
            if refused:
                raise UserError(f"profile {profile.path}: the image's entrypoint guard refuses it (Mooncake {version}, "
                                f"stack {', '.join(stacks)}): {refused.removeprefix('error: ')}")


def select_profiles(profiles: Mapping[str, Profile], names: Sequence[str], what: str = "--launch-profile") -> list[Profile]:
    """The profiles named (all when none is), or a UserError naming `what` was asked for."""
    unknown = [n for n in names if n not in profiles]
    if unknown:
        raise UserError(f"{what} {', '.join(unknown)}: no such profile; known: {', '.join(sorted(profiles))}")
    return [profiles[n] for n in (names or sorted(profiles))]


def load_entrypoint(path: Path = DEFAULT_ENTRYPOINT) -> Any:
    """image/entrypoint.py as a module: the one implementation of profile resolution."""
    return profile_probe.load_entrypoint(str(path))

