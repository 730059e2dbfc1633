"""Launch profiles (image/profiles/NAME.json) and their check against an image.

Usage:
    python3 -m tools.image.profiles validate [--profiles-dir image/profiles] [--needs image/backend_needs.json]
            [--selections kernel_cache/selections.json] [--lock third_party/pins.lock.json]
        Every profile without an image: the schema (no key twice in one object, no flag twice in
        `args`), placeholders declared and used, the checkpoint facts, a kernel selection of
        kernel_cache/selections.json; the needs table's features are ones the probe knows; and the
        image entrypoint's own guard (image/entrypoint.py `refusal`) on the profile's args and env
        with the examples, for the Mooncake release of every stack of the lock. The action that
        builds the image's entrypoint layer runs the same checks (tools/image/entrypoint_layer.py).
    python3 -m tools.image.profiles show NAME [--profiles-dir image/profiles]
        The command `kimi-k3-entrypoint --print-profile NAME` prints, with the placeholders'
        example values (the image's own entrypoint code resolves it).

The check itself runs through the smoke test (`python3 -m tools.image.smoke --layout L --profile
kimi-k3`, or `--launch-profile NAME`): tools/image/profile_probe.py runs inside the unpacked image
with the image's python3 and SGLang (how, and which SGLang steps it skips: its docstring and the
README "Launch profiles"); this module builds its request and judges its results:
- a probe failure (entrypoint, guard, SGLang's parser, a resolution step, check_server_args) is
  one line naming the profile, the stage and SGLang's message (which names the argument);
- the profile's needs: its kernel selection must be the image kernel cache's (or `full`); every
  FlashInfer module that image/backend_needs.json lists for the profile's checkpoint
  architecture and for the values SGLang resolved (e.g. moe_runner_backend=flashinfer_mxfp4) must
  be in the cache, with the CUTLASS MoE runners it names compiled in; every feature it lists
  (e.g. SiTU in the MXFP4 CUTLASS MoE) must pass its probe in the image.
The kernel cache is the image's (flashinfer/data/aot/kernel_cache.json and its modules' .so
files), or, for an image assembled without its kernel-cache layer (the CPU suite's), the checked-in
plan the cache would be built from (--kernel-cache-plan).
- the first-use inventory (jit_cache/inventory.<stack>.json, --inventory): every site it marks
  `prebuilt` that the profile reaches must be in the image: a FlashInfer module in the kernel
  cache above, an SGLang JIT build (call and args) in the image's
  /usr/share/kimi-k3/sglang-jit/kimi-k3-sglang-jit.json with its .so present at the recorded
  sha256. A prebuilt site of a kind the check cannot look up fails too (it would pass unchecked).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from tools.common.errors import UserError, run_cli
from tools.common.jsondata import TEXT, Enum, ListOf, MapOf, Object, json_path, load_json_file
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
# image/constants.bzl SGLANG_JIT_DIR, and the manifest the SGLang JIT build writes there
# (tools/jit_cache/sglang_aot.py MANIFEST).
SGLANG_JIT_IMAGE_PATH = "/usr/share/kimi-k3/sglang-jit"
SGLANG_JIT_MANIFEST = "kimi-k3-sglang-jit.json"
# image/constants.bzl TRITON_DIR (the Triton layer's cache, tools/jit_cache/triton_aot.py MANIFEST).
TRITON_IMAGE_PATH = "/usr/share/kimi-k3/triton"
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
})
PROFILE_FIX = "see README 'Launch profiles' for the format"
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
PLACEHOLDER_NAME = re.compile(r"[A-Z][A-Z0-9_]*")
PLACEHOLDER_USE = re.compile(r"\$\{([^}]*)\}")
AOT_DIR = "flashinfer/data/aot"
CACHE_JSON = "kernel_cache.json"


# ---------------------------------------------------------------- profiles

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


# ---------------------------------------------------------------- what settings need

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


# ---------------------------------------------------------------- the image's kernel cache

@dataclass(frozen=True)
class KernelCache:
    """What a kernel cache holds: arch, selection ("full" when none is recorded), and per module
    the CUTLASS MoE runners its selection compiled in (None: the whole module)."""

    source: str
    arch: str
    selection: str
    modules: Mapping[str, tuple[str, ...] | None]

    def describe(self) -> str:
        return f"selection {self.selection}, arch {self.arch}, {len(self.modules)} modules, from {self.source}"


def _runners(entry: Mapping[str, Any]) -> tuple[str, ...] | None:
    selection = entry.get("kernel_selection")
    return tuple(selection["runners"]) if isinstance(selection, dict) else None


def kernel_cache_of_image(rootfs_site_packages: Path) -> KernelCache:
    """The image's cache from its kernel_cache.json; a module whose .so is absent is not in it."""
    aot = rootfs_site_packages / AOT_DIR
    path = aot / CACHE_JSON
    try:
        data = json.loads(path.read_text())
        modules = {name: (entry, aot / entry["path"]) for name, entry in data["modules"].items()}
        arch = str(data["arch_list"])
    except FileNotFoundError:
        raise UserError(f"the image has no {AOT_DIR}/{CACHE_JSON}: it carries no kernel cache; for an image "
                        "assembled without its kernel-cache layer pass --kernel-cache-plan PLAN") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"the image's {AOT_DIR}/{CACHE_JSON} is unreadable ({type(e).__name__}: {e}); "
                        "rebuild the kernel cache") from None
    return KernelCache(f"the image's {AOT_DIR}/{CACHE_JSON}", arch, str(data.get("selection", "full")),
                       {name: _runners(entry) for name, (entry, so) in modules.items() if so.is_file()})


def kernel_cache_of_plan(plan_path: Path) -> KernelCache:
    """The cache a checked-in plan builds (the image under test carries no kernel-cache layer)."""
    from tools.kernel_cache.plan import read_plan

    plan = read_plan(plan_path)
    return KernelCache(f"plan {plan_path.name} (the image under test has no kernel-cache layer)", str(plan["arch"]),
                       str(plan.get("selection", "full")), {m["name"]: _runners(m) for m in plan["modules"]})


def _build_key(call: str, args: Any) -> str:
    """One SGLang JIT build as the inventory and the image's manifest both name it."""
    return f"{call} {json.dumps(args, sort_keys=True)}"


@dataclass(frozen=True)
class FirstUseCaches:
    """The SGLang JIT builds an image ships (tools/jit_cache build-sglang's manifest): build
    (_build_key) -> None when its .so is there at the recorded sha256, else why not."""

    source: str
    arch: str | None
    sglang_jit: Mapping[str, str | None]
    # The Triton kernels the image's Triton layer is built from, by (file, function): the calls
    # that run them (jit_cache/triton_calls.json, whose kernels the build checks); None: not given.
    triton: Mapping[tuple[str, str], list[dict[str, Any]]] | None = None

    def describe(self) -> str:
        present = sum(v is None for v in self.sglang_jit.values())
        return f"{present} SGLang JIT builds for arch {self.arch} in {self.source}"


def first_use_caches_of_image(rootfs_jit_dir: Path) -> FirstUseCaches:
    """The image's prebuilt SGLang JIT builds, from its manifest; none when it ships no manifest."""
    from tools.common.hashing import sha256_file

    where = f"{SGLANG_JIT_IMAGE_PATH}/{SGLANG_JIT_MANIFEST}"
    try:
        data = json.loads((rootfs_jit_dir / SGLANG_JIT_MANIFEST).read_text())
        entries = [(str(m["call"]), m["args"], str(m["leaf"]), str(m["module"]), str(m["so_sha256"]))
                   for m in data["modules"]]
        arch = str(data["arch"])
    except FileNotFoundError:
        return FirstUseCaches(f"the image (no {where})", None, {})
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"the image's {where} is unreadable ({type(e).__name__}: {e}); rebuild the image") from None
    builds: dict[str, str | None] = {}
    for call, args, leaf, module, digest in entries:
        so = rootfs_jit_dir / leaf / f"{module}.so"
        if not so.is_file():
            builds[_build_key(call, args)] = f"its {leaf}/{module}.so is missing"
        elif sha256_file(so) != digest:
            builds[_build_key(call, args)] = f"its {leaf}/{module}.so is not the sha256 the manifest records"
        else:
            builds[_build_key(call, args)] = None
    return FirstUseCaches(f"the image's {where}", arch, builds)


def triton_plan(calls_file: Path, stack: str) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """(file, function) -> [{"call", "args"}] of the stack's Triton calls (jit_cache/triton_calls.json)."""
    from tools.jit_cache.triton_aot import kernel_sites, load_calls

    return kernel_sites(load_calls(calls_file, stack, "--triton-calls"))


def capability_of(arch: str) -> tuple[int, int]:
    """(12, 0) for "12.0f": the GPU the kernel cache (and so the image) is built for."""
    match = re.fullmatch(r"(\d+)\.(\d+)[af]?", arch.split(";")[0].strip())
    if not match:
        raise UserError(f"kernel cache arch {arch!r}: not a CUDA arch like 12.0f; rebuild the kernel cache")
    return int(match.group(1)), int(match.group(2))


# ---------------------------------------------------------------- verdicts

@dataclass
class Verdict:
    profile: str
    ok: bool
    line: str
    details: list[str] = field(default_factory=list)


def _check_prebuilt(profile: Profile, inventory: Mapping[str, Any], cache: KernelCache,
                    caches: FirstUseCaches) -> tuple[list[str], int]:
    """(problems, sites checked): each site the inventory marks prebuilt that `profile` reaches
    (every prebuilt site for a profile the inventory does not list) must be in the image."""
    listed = profile.name in inventory.get("profiles", {})
    where = f"jit_cache/inventory.{inventory.get('stack')}.json"
    fix = (f"rebuild the image (its first-use layers: //image:layer_sglang_jit, //image:layer_triton, //image:layer_kernel_cache), or regenerate "
           f"{where} (tools/bazel run //jit_cache:update_inventory) if the site is no longer built ahead")
    problems, checked = [], 0
    for site_id, site in sorted(inventory["sites"].items()):
        if site["status"] != "prebuilt" or (listed and profile.name not in site["profiles"]):
            continue
        checked += 1
        builds = site.get("specializations", {}).get("prebuilt")
        if not builds:
            problems.append(f"{site_id}: {where} marks it prebuilt without what the image holds for it; regenerate "
                            f"{where} (tools/bazel run //jit_cache:update_inventory)")
            continue
        if site["kind"] == "flashinfer":
            for module in sorted({b["module"] for b in builds} - set(cache.modules)):
                problems.append(f"reaches {site_id}, which {where} marks prebuilt, and the image's kernel cache "
                                f"({cache.describe()}) lacks its module {module}; {fix}")
            continue
        if site["kind"] == "sglang-jit":
            if caches.arch is not None and caches.arch != cache.arch:
                problems.append(f"the image's SGLang JIT builds are for arch {caches.arch}, its kernel cache for "
                                f"{cache.arch}; {fix}")
                continue
            for build in builds:
                key = _build_key(build["call"], build["args"])
                why = caches.sglang_jit.get(key, f"no entry for it in {caches.source}")
                if why:
                    problems.append(f"reaches {site_id}, which {where} marks prebuilt ({key}), and the image lacks "
                                    f"it: {why}; {fix}")
            continue
        if site["kind"] == "triton" and caches.triton is not None:
            for build in builds:
                if "module" in build:  # Triton's driver module: every Triton layer build makes it
                    continue
                if {"call": build["call"], "args": build["args"]} not in caches.triton.get((site["file"], site["name"]), []):
                    problems.append(f"reaches {site_id}, which {where} marks prebuilt ({build['call']} "
                                    f"{json.dumps(build['args'], sort_keys=True)}), and the calls the image's Triton "
                                    f"layer is built from (jit_cache/triton_calls.json) do not run it; {fix}")
            continue
        problems.append(f"reaches {site_id}, which {where} marks prebuilt, but this check cannot look up a "
                        f"prebuilt {site['kind']} site in the image; teach tools/image/profiles.py _check_prebuilt"
                        + (" (for Triton: give it jit_cache/triton_calls.json)" if site["kind"] == "triton" else ""))
    return problems, checked


def _check_needs(profile: Profile, needs: Sequence[Need], cache: KernelCache,
                 features: Mapping[str, str | None]) -> list[str]:
    problems = []
    if cache.selection not in (profile.kernel_selection, "full"):
        problems.append(f"needs kernel selection {profile.kernel_selection}, the image's kernel cache is "
                        f"{cache.describe()}; build the image with --//kernel_cache:selection={profile.kernel_selection}")
    for need in needs:
        for module, runners in need.modules.items():
            if module not in cache.modules:
                problems.append(f"{need.because} needs FlashInfer module {module}, which the image's kernel cache "
                                f"({cache.describe()}) lacks; add it to kernel_cache/modules.json "
                                "(kernel_cache/README.md 'How to extend it') and rebuild the cache")
                continue
            compiled = cache.modules[module]
            missing = [r for r in runners if compiled is not None and r not in compiled]
            if missing:
                problems.append(f"{need.because} needs {module} with {', '.join(missing)}, which kernel selection "
                                f"{cache.selection} leaves out; add it to kernel_cache/selections.json or build "
                                f"with --//kernel_cache:selection={profile.kernel_selection}")
        for feature in need.features:
            why_not = features.get(feature, f"feature {feature} was not probed")
            if why_not:
                problems.append(f"{need.because} needs {feature}: {why_not}")
    return problems


def judge(profiles: Sequence[Profile], results: Mapping[str, Mapping[str, Any]], features: Mapping[str, str | None],
          cache: KernelCache, table: Mapping[str, Any], sglang: str, inventory: Mapping[str, Any] | None = None,
          caches: FirstUseCaches | None = None) -> list[Verdict]:
    """One verdict per profile: its first problem as one line, or what was checked (with an
    inventory, its prebuilt sites against the kernel cache and `caches` too)."""
    # The image's SGLang is the patch gate's repack: <upstream>+kimik3.<digest>.
    if inventory is not None and str(inventory.get("sglang_version")) != sglang.split("+")[0]:
        raise UserError(f"the inventory of stack {inventory.get('stack')} is for SGLang {inventory.get('sglang_version')}, "
                        f"the image has SGLang {sglang}; pass the image's stack's jit_cache/inventory.<stack>.json")
    stages = {"profile": "the image's entrypoint cannot resolve it",
              "guard": "the image's entrypoint guard refuses it",
              "parse": f"SGLang {sglang} rejects its arguments",
              "resolve": f"SGLang {sglang} resolution rejects it",
              "check": f"SGLang {sglang} check_server_args rejects it",
              "probe": "the check itself failed"}
    verdicts = []
    for profile in profiles:
        r = results.get(profile.name)
        head = f"profile {profile.name} ({profile.path.name})"
        if r is None:
            verdicts.append(Verdict(profile.name, False, f"{head}: the probe returned no result; see its output above"))
            continue
        if not r.get("ok"):
            step = f" in step {r['step']}" if r.get("step") else ""
            verdicts.append(Verdict(profile.name, False, f"{head}: {stages.get(r.get('stage'), r.get('stage'))}{step}: "
                                                         f"{r.get('error')}"))
            continue
        needs = needs_of(profile, r.get("values", {}), r.get("flags", {}), table)
        problems = _check_needs(profile, needs, cache, features)
        prebuilt = ""
        if inventory is not None:
            more, checked = _check_prebuilt(profile, inventory, cache, caches or FirstUseCaches("no image", None, {}))
            problems += more
            unlisted = "" if profile.name in inventory.get("profiles", {}) else \
                " (every prebuilt site: the inventory does not list this profile)"
            prebuilt = f"; {checked} prebuilt first-use sites present{unlisted}"
        if problems:
            verdicts.append(Verdict(profile.name, False, f"{head}: {problems[0]}", problems[1:]))
            continue
        modules = sorted({m for n in needs for m in n.modules})
        feats = sorted({f for n in needs for f in n.features})
        skipped = r.get("skipped", [])
        ran = [s for s in r.get("ran", []) if s != "check_server_args"]
        checked = " and check_server_args" if "check_server_args" in r.get("ran", []) else ""
        details = [f"skipped {step}: {why}" for step, why in skipped]
        if r.get("stopped"):
            details.append(f"stopped at {r['stopped'][0]} ({r['stopped'][1]}); not reached: {', '.join(r['not_reached'])}")
        verdicts.append(Verdict(profile.name, True,
                                f"{head}: SGLang {sglang} parsed {len(r.get('args', []))} arguments, ran "
                                f"{len(ran)} resolution steps{checked}, skipped {len(skipped)}"
                                f"{', stopped early' if r.get('stopped') else ''}; guard accepts; kernel cache has "
                                f"{', '.join(modules) or 'nothing needed'}{'; ' + ', '.join(feats) if feats else ''}"
                                f"{prebuilt}",
                                details))
    return verdicts


def probe_request(profiles: Sequence[Profile], table: Mapping[str, Any], cache: KernelCache, entrypoint: str,
                  profiles_dir: str, checkpoints_dir: str) -> dict[str, Any]:
    if table.get("arch") != cache.arch:
        raise UserError(f"image/backend_needs.json is for arch {table.get('arch')!r}, the image's kernel cache for "
                        f"{cache.arch!r}; check the image its needs table was written for")
    return {"entrypoint": entrypoint, "profiles_dir": profiles_dir, "profiles": [p.name for p in profiles],
            "checkpoints_dir": checkpoints_dir, "gpu_capability": list(capability_of(cache.arch)),
            "settings": sorted(table["settings"]), "features": features_needed(table)}


def parse_probe_output(stdout: str) -> tuple[dict[str, dict[str, Any]], dict[str, str | None], str]:
    """Probe lines -> (results by profile, feature -> why not (None: present), SGLang version)."""
    results, features, sglang = {}, {}, "?"
    for line in stdout.splitlines():
        mark, _, payload = line.partition("\t")
        if mark != profile_probe.MARK:
            continue
        record = json.loads(payload)
        if "sglang" in record:
            sglang = str(record["sglang"])
        elif "feature" in record:
            features[record["feature"]] = record.get("why_not") or (
                f"its probe failed: {record['error']}" if record.get("error") else None)
        else:
            results[record["profile"]] = record
    return results, features, sglang


# ---------------------------------------------------------------- CLI (no image)

def load_entrypoint(path: Path = DEFAULT_ENTRYPOINT) -> Any:
    """image/entrypoint.py as a module: the one implementation of profile resolution."""
    return profile_probe.load_entrypoint(str(path))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate", help="schema of every profile and of the needs table")
    v.add_argument("--profiles-dir", type=Path, default=DEFAULT_PROFILES_DIR)
    v.add_argument("--needs", type=Path, default=DEFAULT_NEEDS)
    v.add_argument("--selections", type=Path, default=DEFAULT_SELECTIONS)
    v.add_argument("--lock", type=Path, default=DEFAULT_LOCK)
    s = sub.add_parser("show", help="the command --print-profile prints, with the example values")
    s.add_argument("name")
    s.add_argument("--profiles-dir", type=Path, default=DEFAULT_PROFILES_DIR)
    args = p.parse_args(argv)
    profiles = load_profiles(args.profiles_dir)
    if args.command == "validate":
        load_needs(args.needs)
        check_profiles(profiles, args.selections, args.lock)
        for name in profiles:
            print(f"ok   {name}")
        return 0
    (profile,) = select_profiles(profiles, [args.name], "profile")
    entrypoint = load_entrypoint()
    examples = {k: spec["example"] for k, spec in profile.data.get("placeholders", {}).items()}
    try:
        cmd_args, env = entrypoint.resolve_profile(profile.name, examples, str(args.profiles_dir))
    except entrypoint.ProfileError as e:
        raise UserError(str(e)) from None
    print(entrypoint.profile_command(cmd_args, env))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
