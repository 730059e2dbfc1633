#!/usr/bin/python3
"""Image entrypoint: refuse a Mooncake configuration that cannot transfer expandable-segment
memory, then exec SGLang's server.

With `expandable_segments:True` in PYTORCH_CUDA_ALLOC_CONF (or its alias PYTORCH_ALLOC_CONF),
PyTorch allocates GPU memory as CUDA virtual memory (cuMemCreate + cuMemMap, in chunks), and the
KV cache SGLang hands to Mooncake for PD transfer is such memory. Whether Mooncake can register it
depends on the transport its TransferEngine installs and on its version (image/README.md "The
Mooncake guard" has the facts and where they come from):
- TCP (MC_FORCE_TCP, or `--disaggregation-transfer-backend mooncake_tcp`): works;
- intra-node NVLink (MC_INTRANODE_NVLINK): Mooncake refuses the buffer (no cudaIpc handle);
- EFA (MOONCAKE_PROTOCOL=efa): SGLang itself refuses it when its KV manager starts;
- RDMA: registration through nvidia-peermem (ibv_reg_mr) is not covered by the fix of
  kvcache-ai/Mooncake#2511; dma-buf registration (WITH_NVIDIA_PEERMEM=0) fails before Mooncake
  0.3.14 and works from 0.3.14 on (#3538).
A server that cannot register its KV cache starts healthy and fails at the first KV transfer;
this guard refuses it at start, with the fact and the fix. HiCache's Mooncake store registers
the host KV pool (host memory, which expandable segments do not touch): not judged here.

The arguments are judged as SGLang parses them: inside the image with SGLang's own launch parser
(`prepare_server_args`: argparse with abbreviations, `--config FILE.yaml` merged before the
command line), imported only when expandable segments are on and an argument could name a PD
option. Without SGLang (the build host), an abbreviation of a judged option counts as that
option (SGLang reads it so, or refuses it as ambiguous), one that could be several is refused,
and so is a `--config` file, which only SGLang's parser reads.

FlashKDA (`--linear-attn-prefill-backend flashkda`, the image variant --//image:kda_prefill=flashkda):
the entrypoint warns, and starts the server anyway, when SGLang will prefill KDA layers with it
(what FLASHKDA_KNOWN_ISSUES says; kernel_cache/FLASHKDA.md). The arguments are read as
for the Mooncake guard: with SGLang's parser when an argument could name the option.

DeepGEMM: the entrypoint warns, and starts anyway, when SGLang will start DeepGEMM's JIT runtime
(SGLANG_ENABLE_JIT_DEEPGEMM not off) and no nvcc is there for it to find (deepgemm_warning).

Launch profiles (image/profiles/, shipped in /usr/share/kimi-k3/profiles): `--profile NAME` starts
the profile's SGLang arguments with its environment, placeholders (`${MODEL_PATH}`, ...) taken
from the container's environment, through the same guard; `--print-profile NAME` prints that
command instead. tools/image/profiles.py checks each shipped profile with these same functions
(`validate`, in the action that builds the image's entrypoint layer, and against the image), so
what an operator starts is what was checked.

First-use caches: the image ships SGLang's JIT modules built ahead of time, read-only, in
/usr/share/kimi-k3/sglang-jit (SGLang's cache layout); before it starts SGLang the entrypoint
links them into the writable $SGLANG_JIT_CACHE_DIR (default $SGLANG_CACHE_DIR/jit, SGLang's own
~/.cache/sglang/jit when neither is set), where SGLang's load_jit finds them and publishes
whatever else it builds. Likewise Triton kernels of SGLang's serving calls, in
/usr/share/kimi-k3/triton (Triton's cache entries without their group files): the entrypoint writes
each entry's group file into the writable $TRITON_CACHE_DIR (default $SGLANG_CACHE_DIR/triton,
where SGLang points Triton), naming the shipped files, so Triton takes them as hits.

Stdlib only at start: it runs as the image's PID 1 before anything else is imported.
"""
from __future__ import annotations

import os
import re
import sys
from typing import Mapping, Sequence

ISSUE = "kvcache-ai/Mooncake#2511"
FIX = "#3538"
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
# image/constants.bzl PROFILES_DIR (tests/cpu/image checks that the two agree).
PROFILES_DIR = "/usr/share/kimi-k3/profiles"
# image/constants.bzl SGLANG_JIT_DIR: SGLang's JIT modules built ahead of time, read-only, in
# SGLang's cache layout, with their manifest (tools/jit_cache/sglang_aot.py MANIFEST).
SGLANG_JIT_DIR = "/usr/share/kimi-k3/sglang-jit"
SGLANG_JIT_MANIFEST = "kimi-k3-sglang-jit.json"
TRITON_DIR = "/usr/share/kimi-k3/triton"
TRITON_MANIFEST = "kimi-k3-triton.json"
# image/constants.bzl FIRST_USE_SITE: the first-use compile recorder's site directory
# (tools/jit_cache/first_use_site: a sitecustomize.py that loads ../first_use_hooks.py).
FIRST_USE_SITE = "/usr/share/kimi-k3/first-use/site"
RECORD_FLAG, VERIFY_FLAG = "--record-first-use", "--verify-first-use"
PROFILE_NAME = re.compile(r"[a-z0-9][a-z0-9.-]*")
PLACEHOLDER = re.compile(r"\$\{([A-Z][A-Z0-9_]*)\}")

# The Mooncake distributions a stack may install (third_party/pins.lock.json role `mooncake`).
MOONCAKE_DISTRIBUTIONS = ("mooncake-transfer-engine-cuda13", "mooncake-transfer-engine",
                          "mooncake-transfer-engine-non-cuda")
# The first release with #3538 (dma-buf registration of CUDA virtual memory).
DMABUF_FIX_RELEASE = (0, 3, 14)
# SGLang's flags the guard judges -> their ServerArgs field and default (one option string each
# in SGLang 0.5.21 and 0.5.23).
JUDGED = {"--disaggregation-mode": ("disaggregation_mode", "null"),
          "--disaggregation-transfer-backend": ("disaggregation_transfer_backend", "mooncake"),
          "--disaggregation-ib-device": ("disaggregation_ib_device", None)}
MOONCAKE_BACKENDS = ("mooncake", "mooncake_tcp")
# Mooncake's boolean environment values (mooncake-common bool_parser), lower-cased.
TRUE_WORDS = ("1", "true", "yes", "on", "enable")
FALSE_WORDS = ("0", "false", "no", "off", "disable")


# FlashKDA: SGLang's options that choose the KDA prefill kernel -> their ServerArgs field and
# default (SGLang 0.5.21 and 0.5.23: the prefill backend, else the base linear-attention backend).
KDA_JUDGED = {"--linear-attn-prefill-backend": ("linear_attn_prefill_backend", None),
              "--linear-attn-backend": ("linear_attn_backend", "triton")}
# What is known against FlashKDA as the KDA prefill backend, from the operators' manual: why the
# entrypoint warns (it does not refuse: the backend works at low concurrency, and choosing it is
# the operator's call).
FLASHKDA_KNOWN_ISSUES = ("it fails under 4 and under 8 concurrent requests (the operators' manual), and it is no faster "
                  "than SGLang's Triton KDA (16K-token prefill: 2693 vs 2695 tok/s); SGLang 0.5.23 gives it only "
                  "prefills of 64 to 2048 tokens (longer ones run on Triton), and there its extend returns "
                  "(output, None), which forward_extend takes as the output unless it tracks SSM state "
                  "(measured on an H100: kernel_cache/FLASHKDA.md)")
FLASHKDA_DISTRIBUTION = "flash_kda"


class GuardError(Exception):
    """Arguments the guard cannot judge: one line naming the argument and the fix."""


def expandable_segments_on(env: Mapping[str, str]) -> str | None:
    """The variable that turns expandable segments on, or None (entries are key:value, comma-separated)."""
    for var in ALLOC_CONF_VARS:
        for item in env.get(var, "").split(","):
            key, _, value = item.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() == "true":
                return var
    return None


def _may_name_judged(arg: str, judged: Mapping[str, tuple[str, str | None]] = JUDGED) -> bool:
    """Whether SGLang's parser could read `arg` as one of `judged` (argparse takes any unique
    prefix of a long option, with or without `=VALUE`)."""
    name = arg.partition("=")[0]
    return len(name) > 2 and name.startswith("--") and any(o.startswith(name) for o in judged)


def settings_from_sglang(args: Sequence[str], judged: Mapping[str, tuple[str, str | None]] = JUDGED
                         ) -> dict[str, str | None] | None:
    """The `judged` fields as SGLang's launch parser reads `args` (its plugins loaded, a --config
    file merged), or None when SGLang cannot be imported here."""
    try:
        from sglang.srt.server_args import prepare_server_args
    except Exception:
        return None
    import argparse

    def error(self: argparse.ArgumentParser, message: str) -> None:
        raise GuardError(f"SGLang's parser rejects the arguments: {message}")

    saved = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = error  # type: ignore[method-assign]
    try:
        try:
            from sglang.srt.plugins import load_plugins
        except ImportError:
            pass
        else:
            load_plugins()  # as sglang.launch_server does first: plugins may add arguments
        server_args = prepare_server_args(list(args))
    except GuardError:
        raise
    except SystemExit as e:
        raise GuardError(f"SGLang's parser exited ({e.code}) on these arguments") from None
    except Exception as e:
        text = " ".join(str(e).split()) or type(e).__name__
        if "--config" in args:
            i = args.index("--config")
            config = args[i + 1] if i + 1 < len(args) else "(no file)"
            raise GuardError(f"--config {config}: SGLang's parser fails with it ({type(e).__name__}: {text}); "
                             "fix the file, its path or the arguments (SGLang would refuse them too)") from None
        raise GuardError(f"SGLang's parser rejects the arguments ({type(e).__name__}: {text})") from None
    finally:
        argparse.ArgumentParser.error = saved  # type: ignore[method-assign]
    return {field: getattr(server_args, field, default) for field, default in judged.values()}


def settings_without_sglang(args: Sequence[str], judged: Mapping[str, tuple[str, str | None]] = JUDGED
                            ) -> dict[str, str | None]:
    """The `judged` fields from `args` by argparse's rules for these options alone: an exact or
    unique-prefix match (also `--opt=VALUE`), the last one wins, nothing after `--`. A prefix of
    several judged options is refused (SGLang refuses it as ambiguous), and so is `--config`:
    only SGLang's parser (and PyYAML) reads the file."""
    if "--config" in args:
        i = args.index("--config")
        config = args[i + 1] if i + 1 < len(args) else "(no file)"
        raise GuardError(f"--config {config}: the guard reads a config file only with the image's SGLang, "
                         "which cannot be imported here; pass the options on the command line")
    values: dict[str, str | None] = {field: default for field, default in judged.values()}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            break
        if _may_name_judged(arg, judged):
            name, eq, value = arg.partition("=")
            matches = [name] if name in judged else [o for o in judged if o.startswith(name)]
            if len(matches) > 1:
                raise GuardError(f"{name} could be any of {', '.join(matches)} (SGLang refuses an ambiguous "
                                 "abbreviation); spell the option in full")
            if not eq:
                if i + 1 >= len(args):
                    raise GuardError(f"{name} expects a value; give it one")
                i += 1
                value = args[i]
            values[judged[matches[0]][0]] = value
        i += 1
    return values


def judged_settings(args: Sequence[str]) -> dict[str, str | None]:
    """What SGLang will run with for the JUDGED fields."""
    if "--config" not in args and not any(_may_name_judged(a) for a in args):
        return {field: default for field, default in JUDGED.values()}
    settings = settings_from_sglang(args)
    return settings if settings is not None else settings_without_sglang(args)


def installed_mooncake() -> str | None:
    """The version of the Mooncake distribution installed here, or None."""
    try:
        from importlib import metadata
    except ImportError:  # a stripped interpreter: no distribution can be read
        return None
    for name in MOONCAKE_DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def has_dmabuf_fix(version: str | None) -> bool:
    """Whether Mooncake `version` has #3538 (a pre-release of the fix release counts as before it)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)*)((?:a|b|rc|\.?dev)\d*)?(\.post\d+)?(\+.*)?", (version or "").strip())
    if not match:
        return False
    release = tuple(int(n) for n in match.group(1).split("."))
    return release > DMABUF_FIX_RELEASE or (release == DMABUF_FIX_RELEASE and not match.group(2))


def _env_word(env: Mapping[str, str], var: str) -> str | None:
    value = env.get(var)
    return None if value is None else value.strip().lower()


def mooncake_refusal(settings: Mapping[str, str | None], env: Mapping[str, str], version: str | None
                     ) -> tuple[str, str, str] | None:
    """(how Mooncake transfers, the fact, the fix) when Mooncake cannot transfer expandable-segment
    memory in this configuration, else None. Mooncake's TransferEngine picks its transport when it
    starts: MC_FORCE_TCP first, then MC_INTRANODE_NVLINK, then RDMA on the RDMA devices it finds
    (--disaggregation-ib-device narrows them), TCP when there are none."""
    mode = str(settings["disaggregation_mode"] or "null")
    backend = str(settings["disaggregation_transfer_backend"] or "")
    if mode not in ("prefill", "decode") or backend not in MOONCAKE_BACKENDS:
        return None
    named = "of unknown version (none installed here)" if version is None else version
    how = f"--disaggregation-mode {mode}, transfer backend {backend}, Mooncake {named}"
    if _env_word(env, "MOONCAKE_PROTOCOL") == "efa":
        return (f"{how}, EFA (MOONCAKE_PROTOCOL=efa)",
                "SGLang refuses EFA with expandable segments when its KV manager starts (the libfabric EFA provider "
                "cannot transfer CUDA virtual-memory allocations)", "")
    # mooncake_tcp: SGLang sets MC_FORCE_TCP=1 unless the environment already sets it.
    force_tcp = _env_word(env, "MC_FORCE_TCP") if "MC_FORCE_TCP" in env else ("1" if backend == "mooncake_tcp" else None)
    if force_tcp in TRUE_WORDS:
        return None
    if "MC_INTRANODE_NVLINK" in env:
        return (f"{how}, intra-node NVLink (MC_INTRANODE_NVLINK is set)",
                "Mooncake's intra-node NVLink transport refuses to register virtual-memory (cuMemCreate) buffers: "
                "they have no cudaIpc handle (measured with Mooncake 0.3.14)", "unset MC_INTRANODE_NVLINK or ")
    devices = settings.get("disaggregation_ib_device")
    rdma = f"RDMA on {'--disaggregation-ib-device ' + devices if devices else 'the RDMA devices of the node'}"
    if not has_dmabuf_fix(version):
        return (f"{how}, {rdma}",
                "before 0.3.14, Mooncake's dma-buf registration exports only the one virtual-memory chunk that holds "
                f"the buffer's start, so registering the buffer fails ({ISSUE}, fixed by {FIX} in 0.3.14), and its "
                "nvidia-peermem registration (ibv_reg_mr) is not covered by that fix",
                "use Mooncake 0.3.14 or later with WITH_NVIDIA_PEERMEM=0, set MC_FORCE_TCP=1, or ")
    if _env_word(env, "WITH_NVIDIA_PEERMEM") not in FALSE_WORDS:
        return (f"{how}, {rdma}, WITH_NVIDIA_PEERMEM not 0",
                "Mooncake may then register GPU memory through nvidia-peermem (ibv_reg_mr), which the fix of "
                f"{ISSUE} ({FIX}, in Mooncake 0.3.14) does not cover",
                "set WITH_NVIDIA_PEERMEM=0 (dma-buf registration, fixed in 0.3.14) or MC_FORCE_TCP=1, or ")
    return None


def refusal(args: Sequence[str], env: Mapping[str, str], mooncake_version: str | None = None) -> str | None:
    """The error line if this configuration must not start, else None. `mooncake_version`: the
    Mooncake release to judge for (default: the one installed here)."""
    var = expandable_segments_on(env)
    if not var:
        return None
    try:
        settings = judged_settings(args)
    except GuardError as e:
        return f"error: {var} sets expandable_segments:True, and the guard cannot judge the arguments: {e}"
    version = mooncake_version if mooncake_version is not None else installed_mooncake()
    found = mooncake_refusal(settings, env, version)
    if found is None:
        return None
    how, fact, fix = found
    return (f"error: {var} sets expandable_segments:True while SGLang transfers the KV cache with Mooncake "
            f"({how}): {fact}; {fix}remove expandable_segments:True from {var}")


def prefills_with_flashkda(args: Sequence[str]) -> bool:
    """Whether SGLang will prefill KDA layers with FlashKDA. Arguments that cannot be read are
    left to SGLang, which judges them itself: this only decides a warning."""
    if "--config" not in args and not any("flashkda" in a for a in args):
        return False  # SGLang's choices are exact words: no `flashkda`, no FlashKDA
    try:
        settings = settings_from_sglang(args, KDA_JUDGED)
        if settings is None:
            settings = settings_without_sglang(args, KDA_JUDGED)
    except GuardError:
        return False
    return (settings["linear_attn_prefill_backend"] or settings["linear_attn_backend"]) == "flashkda"


def flashkda_installed() -> bool:
    try:
        from importlib import metadata
        metadata.version(FLASHKDA_DISTRIBUTION)
        return True
    except Exception:  # not installed, or no metadata to read: SGLang's import will tell
        return False


def flashkda_warning(args: Sequence[str], installed: bool | None = None) -> str | None:
    """The warning line when SGLang will prefill KDA with FlashKDA, else None. Never a refusal."""
    if not prefills_with_flashkda(args):
        return None
    have = flashkda_installed() if installed is None else installed
    missing = "" if have else ("; and this image has no flash_kda, so SGLang will fail to load it: use the image "
                               "built with --//image:kda_prefill=flashkda")
    return (f"warning: the KDA prefill backend is FlashKDA (--linear-attn-prefill-backend flashkda): {FLASHKDA_KNOWN_ISSUES}; "
            f"prefer --linear-attn-prefill-backend triton, which is as fast{missing}; starting anyway")


# SGLang turns DeepGEMM's JIT on by default on SM90 and SM100, and on SM120 where the installed
# DeepGEMM has the SM120 APIs (this image's sgl-deep-gemm does); the model runner then calls
# deep_gemm.set_pdl, whose JIT runtime asserts an executable nvcc under CUDA_HOME (else found on
# PATH, else /usr/local/cuda). The image's CUDA home (/usr/local/cuda: the CUDA wheels' headers
# and libraries, tools/common/cuda_home.py) has no bin/, nothing is on PATH, and no host compiler
# could finish a compile: seen on an H100, where the server died there
# (docs/measurements/2026-12-06.md).
DEEPGEMM_JIT_VAR = "SGLANG_ENABLE_JIT_DEEPGEMM"


def deepgemm_warning(env: Mapping[str, str], default_cuda: str = "/usr/local/cuda") -> str | None:
    """The warning line when SGLang will start DeepGEMM's JIT runtime with no nvcc to find, else
    None. Never a refusal: a GPU older than SM90 never starts it."""
    if env.get(DEEPGEMM_JIT_VAR, "1").strip().lower() not in ("1", "true", "yes", "y", "on"):
        return None
    home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    if home is None:
        import shutil
        if shutil.which("nvcc", path=env.get("PATH", os.defpath)):
            return None
        home = default_cuda
    if os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
        return None
    return (f"warning: SGLang starts DeepGEMM's JIT runtime on SM90, SM100 and SM120 (with this image's DeepGEMM), "
            f"which asserts an executable nvcc (under CUDA_HOME, on PATH or in {default_cuda}), and this container "
            f"has none: set {DEEPGEMM_JIT_VAR}=0, or mount a CUDA toolkit and set CUDA_HOME; starting anyway")


class ProfileError(Exception):
    """A profile that cannot be started: one line naming the profile and the fix."""


def load_profile(name: str, profiles_dir: str = PROFILES_DIR) -> dict:
    import json

    if not PROFILE_NAME.fullmatch(name):
        raise ProfileError(f"profile {name!r}: not a profile name (lower-case letters, digits, '-', '.')")
    try:
        with open(os.path.join(profiles_dir, name + ".json")) as f:
            return json.load(f)
    except FileNotFoundError:
        shipped = sorted(n[:-5] for n in os.listdir(profiles_dir) if n.endswith(".json")) \
            if os.path.isdir(profiles_dir) else []
        raise ProfileError(f"profile {name!r}: not in {profiles_dir}; this image has: "
                           f"{', '.join(shipped) or 'none'}") from None
    except (OSError, ValueError) as e:
        raise ProfileError(f"profile {name!r}: unreadable ({e}); rebuild the image") from None


def substitute(text: str, values: Mapping[str, str], name: str, placeholders: Mapping[str, Mapping[str, str]]) -> str:
    """`text` with each ${KEY} replaced by values[KEY]; KEY must be a declared placeholder."""
    def value_of(match: re.Match[str]) -> str:
        key = match.group(1)
        spec = placeholders.get(key)
        if spec is None:
            raise ProfileError(f"profile {name}: ${{{key}}} is not one of its placeholders; declare it or remove it")
        value = values.get(key, "")
        if not value:
            raise ProfileError(f"profile {name}: placeholder {key} is not set ({spec.get('description', '')}); "
                               f"set it in the container's environment, e.g. {key}={spec.get('example', '')}")
        return value
    return PLACEHOLDER.sub(value_of, text)


def resolve_profile(name: str, values: Mapping[str, str], profiles_dir: str = PROFILES_DIR) -> tuple[list[str], dict[str, str]]:
    """The SGLang arguments and the environment of profile `name`, placeholders from `values`."""
    profile = load_profile(name, profiles_dir)
    fix = "rebuild the image from profiles that pass `python3 -m tools.image.profiles validate`"
    if not isinstance(profile, dict):
        raise ProfileError(f"profile {name}: not a JSON object; {fix}")
    args, env, placeholders = profile.get("args"), profile.get("env", {}), profile.get("placeholders", {})
    if not isinstance(args, list) or not args or not all(isinstance(a, str) for a in args):
        raise ProfileError(f"profile {name}: 'args' is not a list of strings (the SGLang arguments); {fix}")
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise ProfileError(f"profile {name}: 'env' is not an object of strings; {fix}")
    if not isinstance(placeholders, dict) or not all(isinstance(v, dict) for v in placeholders.values()):
        raise ProfileError(f"profile {name}: 'placeholders' is not an object of objects; {fix}")
    args = [substitute(a, values, name, placeholders) for a in args]
    env = {k: substitute(v, values, name, placeholders) for k, v in env.items()}
    return args, env


def profile_command(args: Sequence[str], env: Mapping[str, str]) -> str:
    """The shell command that starts what `--profile` starts."""
    import shlex

    return shlex.join(["env", *(f"{k}={v}" for k, v in sorted(env.items())), "kimi-k3-entrypoint", *args])


class CacheError(Exception):
    """A first-use cache the entrypoint cannot set up: one line naming the variable and the fix."""


def _cache_dir(env: Mapping[str, str], variable: str, under_sglang: str) -> str:
    """$variable, else $SGLANG_CACHE_DIR/<under_sglang> (SGLang's own defaults, under
    ~/.cache/sglang when neither is set)."""
    if env.get(variable):
        return os.path.expanduser(env[variable])
    return os.path.join(os.path.expanduser(env.get("SGLANG_CACHE_DIR") or "~/.cache/sglang"), under_sglang)


def _make_dirs(path: str, made: list[str]) -> None:
    """os.makedirs(path), recording each directory it creates in `made` (for _undo)."""
    missing = []
    while path and not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for d in reversed(missing):
        os.mkdir(d)
        made.append(d)


def _undo(made: list[str]) -> None:
    """Remove what a failed set-up made (links, files, directories), newest first."""
    for path in reversed(made):
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                os.rmdir(path)
            else:
                os.unlink(path)
        except OSError:
            pass


def sglang_jit_cache_dir(env: Mapping[str, str]) -> str:
    """Where SGLang's load_jit looks up and publishes builds: $SGLANG_JIT_CACHE_DIR, else
    $SGLANG_CACHE_DIR/jit (SGLang's own default, ~/.cache/sglang/jit, when neither is set)."""
    return _cache_dir(env, "SGLANG_JIT_CACHE_DIR", "jit")


def link_sglang_jit_cache(env: dict[str, str], shipped: str = SGLANG_JIT_DIR) -> int:
    """Link every leaf the image ships (read-only) into the writable SGLang JIT cache and set
    SGLANG_JIT_CACHE_DIR to it; returns how many links it made.

    A writable overlay made of links: load_jit takes a shipped leaf as a hit (it re-hashes the
    leaf's recorded dependencies, so a link is as good as the leaf), and anything new (another
    module, other args) is built and published beside it in the writable directories. A root
    SGLang could only read would fail at the first miss, when load_jit takes its build lock.
    Existing entries are kept (an earlier start's links, the operator's own builds), except a
    link into `shipped` whose leaf is gone (an earlier image's, on a volume): SGLang stats every
    leaf of a build directory before it looks, and one dangling link makes the whole directory a
    miss. On failure the links and directories this call made are removed, so nothing
    half-linked is left."""
    manifest_path = os.path.join(shipped, SGLANG_JIT_MANIFEST)
    if not os.path.exists(manifest_path):
        return 0  # an image without prebuilt SGLang JIT modules: SGLang's defaults stand
    import json

    try:
        with open(manifest_path) as f:
            leaves = [str(m["leaf"]) for m in json.load(f)["modules"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CacheError(f"{manifest_path}: unreadable ({type(e).__name__}: {e}); rebuild the image") from None
    for leaf in leaves:
        if os.path.isabs(leaf) or ".." in leaf.split("/"):
            raise CacheError(f"{manifest_path}: leaf {leaf!r} is not a path inside {shipped}; rebuild the image")
    root = sglang_jit_cache_dir(env)
    made: list[str] = []  # links and directories, in the order made
    try:
        for leaf in leaves:
            dest = os.path.join(root, leaf)
            _make_dirs(os.path.dirname(dest), made)
            for entry in os.scandir(os.path.dirname(dest)):
                if entry.is_symlink() and os.readlink(entry.path).startswith(shipped + "/") \
                        and not os.path.exists(entry.path):
                    os.unlink(entry.path)
            if not os.path.lexists(dest):
                os.symlink(os.path.join(shipped, leaf), dest)
                made.append(dest)
    except OSError as e:
        _undo(made)
        raise CacheError(f"SGLANG_JIT_CACHE_DIR={root}: cannot link the image's prebuilt SGLang JIT modules "
                         f"into it ({e.strerror or e}: {e.filename or root}); point SGLANG_JIT_CACHE_DIR (or "
                         "SGLANG_CACHE_DIR) at a writable directory") from None
    env["SGLANG_JIT_CACHE_DIR"] = root
    return sum(os.path.islink(p) for p in made)


def triton_cache_dir(env: Mapping[str, str]) -> str:
    """Where Triton looks up and writes its cache: $TRITON_CACHE_DIR, else $SGLANG_CACHE_DIR/triton
    (what SGLang sets it to at import, ~/.cache/sglang/triton when neither is set)."""
    return _cache_dir(env, "TRITON_CACHE_DIR", "triton")


def bind_triton_cache(env: dict[str, str], shipped: str = TRITON_DIR) -> int:
    """Write, for every Triton cache entry the image ships (read-only), its group file
    `<key>/__grp__<kernel>.json` into the writable Triton cache, naming the shipped files, and a
    link `<key>/<file>` to each of Triton's own C modules the image ships (its driver module), and
    set TRITON_CACHE_DIR to it; returns how many it wrote (tools/jit_cache/triton_aot.py `bind`
    writes the same for a cache elsewhere).

    Triton finds an entry by its group file in `<cache>/<key>/` and reads the files the group
    names wherever they are, so the shipped files are hits and what Triton compiles besides goes
    into the writable directory. An entry the directory already has is kept (an earlier start's,
    or Triton's own). On failure the files and directories this call made are removed."""
    manifest_path = os.path.join(shipped, TRITON_MANIFEST)
    if not os.path.exists(manifest_path):
        return 0  # an image without prebuilt Triton kernels: Triton's defaults stand
    import json

    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        entries = {str(k): (str(e["kernel"]), [str(n) for n in e["files"]])
                   for k, e in manifest["entries"].items()}
        modules = [(str(m["key"]), str(m["file"]), {str(k): str(v) for k, v in m["env"].items()})
                   for m in manifest.get("modules", [])]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CacheError(f"{manifest_path}: unreadable ({type(e).__name__}: {e}); rebuild the image") from None
    for key, names in [*((k, [k, kernel, *files]) for k, (kernel, files) in entries.items()),
                       *((k, [k, f]) for k, f, _ in modules)]:
        for name in names:
            if not name or "/" in name or name in (".", ".."):
                raise CacheError(f"{manifest_path}: entry {key!r} names {name!r}, not a file of {shipped}; "
                                 "rebuild the image")
    # Triton's driver module is keyed on these (TRITON_LIBCUDA_PATH): another value makes Triton
    # build it at the first kernel launch, with a C compiler the image does not have.
    for _key, file, keyed in modules:
        for name, value in keyed.items():
            if env.get(name, value) != value:
                raise CacheError(f"{name}={env[name]}: the image's prebuilt Triton driver module ({file}) is "
                                 f"keyed on {name}={value}, and Triton would rebuild it at the first kernel "
                                 f"launch with a C compiler the image lacks; unset {name} (only Triton's link "
                                 "step reads it: libcuda.so.1 loads from wherever the container runtime put it)")
    root = triton_cache_dir(env)
    made: list[str] = []  # files and directories, in the order made
    try:
        for key, file, _keyed in modules:  # Triton looks its C modules up as <key>/<file>
            dest = os.path.join(root, key, file)
            if os.path.lexists(dest):
                continue
            _make_dirs(os.path.join(root, key), made)
            os.symlink(os.path.join(shipped, key, file), dest)
            made.append(dest)
        for key, (kernel, files) in sorted(entries.items()):
            key_dir = os.path.join(root, key)
            group = os.path.join(key_dir, f"__grp__{kernel}.json")
            if os.path.lexists(group):
                continue
            _make_dirs(key_dir, made)
            tmp = f"{group}.tmp.{os.getpid()}"
            made.append(tmp)
            with open(tmp, "w") as f:
                json.dump({"child_paths": {n: os.path.join(shipped, key, n) for n in files}}, f)
            os.replace(tmp, group)
            made[-1] = group
    except OSError as e:
        _undo(made)
        raise CacheError(f"TRITON_CACHE_DIR={root}: cannot write the image's prebuilt Triton kernels' group "
                         f"files into it ({e.strerror or e}: {e.filename or root}); point TRITON_CACHE_DIR (or "
                         "SGLANG_CACHE_DIR) at a writable directory") from None
    env["TRITON_CACHE_DIR"] = root
    for _key, _file, keyed in modules:
        for name, value in keyed.items():
            env.setdefault(name, value)
    return sum(not os.path.isdir(p) for p in made)


def first_use_env(argv: Sequence[str], env: Mapping[str, str],
                  site: str = FIRST_USE_SITE) -> tuple[list[str], dict[str, str]]:
    """Strip the leading `--record-first-use DIR` / `--verify-first-use` from argv; return the rest
    and the environment that turns the recorder on in every process SGLang starts (its site
    directory first on PYTHONPATH: each spawned interpreter imports its sitecustomize). DIR gets
    one record per process (merge them: `python3 -m tools.jit_cache.recording merge`); it must
    be empty or new, so records of two runs never mix. Verify mode fails the server on any
    compile or cache miss after it is ready, naming the kernel."""
    argv = list(argv)
    added: dict[str, str] = {}
    while argv[:1] in ([RECORD_FLAG], [VERIFY_FLAG]):
        flag = argv.pop(0)
        if flag == VERIFY_FLAG:
            added["KIMI_K3_FIRST_USE_VERIFY"] = "1"
            continue
        if not argv or argv[0].startswith("-"):
            raise ProfileError(f"{RECORD_FLAG} takes a directory for the records, e.g. {RECORD_FLAG} /records")
        records = argv.pop(0)
        if os.path.isdir(records) and os.listdir(records):
            raise ProfileError(f"{RECORD_FLAG} {records}: not empty; give a new or empty directory "
                               "(records of two runs are not merged)")
        added["KIMI_K3_FIRST_USE_RECORD"] = os.path.abspath(records)
    if added:
        if not os.path.isfile(os.path.join(site, "sitecustomize.py")):
            raise ProfileError(f"{site}: no first-use recorder in this image; build it with the layer_first_use layer")
        added["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH", "")) if p)
    return argv, added


def main(argv: Sequence[str]) -> int:
    try:
        argv, first_use = first_use_env(argv, os.environ)
    except ProfileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if "KIMI_K3_FIRST_USE_RECORD" in first_use:
        os.makedirs(first_use["KIMI_K3_FIRST_USE_RECORD"], exist_ok=True)
    os.environ.update(first_use)
    if argv[:1] in (["--profile"], ["--print-profile"]):
        if len(argv) != 2:
            print(f"error: {argv[0]} NAME takes no other arguments: a profile is started as it was checked; "
                  "change the profile (image/profiles/NAME.json) instead", file=sys.stderr)
            return 2
        try:
            args, env = resolve_profile(argv[1], os.environ)
        except ProfileError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if argv[0] == "--print-profile":
            print(profile_command(args, env))
            for warning in (flashkda_warning(args), deepgemm_warning({**os.environ, **env})):
                if warning:
                    print(warning, file=sys.stderr)
            message = refusal(args, {**os.environ, **env})
            if message:
                print(message, file=sys.stderr)
                return 2
            return 0
        os.environ.update(env)
        argv = args
    message = refusal(argv, os.environ)
    if message:
        print(message, file=sys.stderr)
        return 2
    try:
        env = dict(os.environ)
        link_sglang_jit_cache(env)
        bind_triton_cache(env)
    except CacheError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # Warnings only for a server that starts (a refusal stays its one line).
    for warning in (flashkda_warning(argv), deepgemm_warning(env)):
        if warning:
            print(warning, file=sys.stderr)
    os.environ.update(env)
    os.execvp("python3", ["python3", "-m", "sglang.launch_server", *argv])
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
