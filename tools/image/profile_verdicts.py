"""The launch-profile check's verdicts: the request tools/image/profile_probe.py runs in the
image, its output parsed, and one verdict per profile: a probe failure (entrypoint, guard, SGLang's
parser, a resolution step, check_server_args), a need the image's kernel cache or probed features
lack, a prebuilt first-use site the image lacks, or what was checked."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from tools.common.errors import UserError
from tools.image import profile_probe
from tools.image.backend_needs import Need, features_needed, needs_of
from tools.image.image_caches import FirstUseCaches, KernelCache, build_key, capability_of
from tools.image.launch_profiles import Profile


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
                key = build_key(build["call"], build["args"])
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
                        f"prebuilt {site['kind']} site in the image; teach tools/image/profile_verdicts.py _check_prebuilt"
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

