"""Check launch profiles with the image's own SGLang; runs inside the unpacked image.

tools/image/launch_profile_check.py (check_launch_profiles) copies this file into the image's rootfs and runs it
in a chroot with the
image's /usr/bin/python3, no GPU (CUDA_VISIBLE_DEVICES empty, no driver) and no network (its own
network namespace):

    python3 profile_probe.py REQUEST.json

REQUEST: {"entrypoint": image path of kimi-k3-entrypoint, "profiles_dir": image path of the
profiles, "profiles": [names], "checkpoints_dir": image path for the checkpoint stand-ins,
"gpu_capability": [major, minor], "settings": [ServerArgs field names to report],
"features": [names of FEATURES]}. It prints one line per feature and per profile: MARK, a JSON
object. Only the standard library and the image's packages are imported (never tools.*): the
host imports this module for FEATURES without importing SGLang.

Per profile, in a fork of one process that imported SGLang once (so profiles cannot leak state
into each other), what `kimi-k3-entrypoint --profile NAME` would run:
1. the image's entrypoint resolves the profile (placeholders from the profile's examples; the
   checkpoint placeholder names a stand-in directory, see 4) and its guard judges args + env
   (the arguments as SGLang's own parser reads them, the image's Mooncake version);
2. the profile's environment is applied, SGLang's plugins are loaded and `prepare_server_args`
   (SGLang's own launch parser) parses the arguments: an unknown or removed flag, a value of the
   wrong type or outside its choices fails here;
3. `ServerArgs.resolve_once()` runs SGLang's resolution pipeline in its own order, then
   `check_server_args()`, as the launcher does before loading the model. The target machine is
   described to SGLang through its own interfaces; none of its files is edited (in this
   process only, os.stat/os.listdir are wrapped to see node-hardware reads, and the SiTU
   feature probe answers the runner's FlashInfer gate, which asks torch.cuda, as the target's):
   - `override_platform(...)`: a CUDA GPU of the image's compute capability (SM120 for 12.0f);
   - a launcher-stage declaration `device="cuda"` (SGLang would probe torch for it);
   - every overridable step is wrapped with `register_resolution_hook`. A step is cut short and
     reported as skipped, with the reason, when it reads a checkpoint value the profile does not
     declare or queries the GPU (a call into torch.cuda or NVML: there is none here), or, unless
     SGLang rejected a value (ValueError, assertion), when it failed on node hardware it looked
     at (/sys, /dev/infiniband) or on a None that a skipped step resolves in a launch. What it
     decided before that stands, as SGLang decided it; the pipeline goes on with the next step;
   - a step SGLang does not let plugins override that needs the GPU or the checkpoint stops
     the pipeline there; the steps not reached are reported. check_server_args() runs in any
     case, on what was resolved.
4. The checkpoint: the profile declares the facts the check may assume (architectures,
   model_type). The checkpoint placeholder points at a directory whose config.json holds only
   them (for steps that read the config file, e.g. the architecture's environment defaults), and
   SGLang's model-config cache holds a stand-in that answers `hf_config.architectures` and
   `hf_config.model_type` and raises on any other value, so a step needing the real checkpoint
   is skipped, not run with invented numbers. No weights are ever read.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import importlib.util
import json
import os
import sys
import traceback
from typing import Any, Callable

MARK = "kimi-k3-profile-check"

# Frames in these files mean the failing call asked the GPU (driver, device, memory).
_GPU_FRAMES = ("/torch/cuda/", "/pynvml.py", "/pynvml/")
# The node's hardware as the kernel lists it (RDMA devices, PCI topology); a chroot on a build
# host has none of it.
_NODE_PATHS = ("/sys/", "/dev/infiniband")


class NodeReads:
    """Paths under _NODE_PATHS that the running step looked at (os.stat and os.listdir, which
    os.path.isdir/exists and directory listings go through)."""

    paths: list[str] = []

    @classmethod
    def install(cls) -> None:
        def tracking(fn: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(path: Any = ".", *args: Any, **kwargs: Any) -> Any:
                text = os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else ""
                if text.startswith(_NODE_PATHS):
                    cls.paths.append(text)
                return fn(path, *args, **kwargs)
            return wrapper
        os.stat = tracking(os.stat)  # type: ignore[assignment]
        os.listdir = tracking(os.listdir)  # type: ignore[assignment]


class CheckpointValueNeeded(Exception):
    """A step read a checkpoint value the profile does not declare."""


class _DeclaredValues:
    """Answers the declared names; any other read raises CheckpointValueNeeded."""

    def __init__(self, what: str, values: dict[str, Any]) -> None:
        object.__setattr__(self, "_what", what)
        object.__setattr__(self, "_values", values)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)  # copy/pickle protocol lookups: not a checkpoint read
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        raise CheckpointValueNeeded(f"{object.__getattribute__(self, '_what')}.{name}")


def checkpoint_stand_in(facts: dict[str, Any]) -> _DeclaredValues:
    """What SGLang's model-config cache holds: hf_config with the declared facts only."""
    return _DeclaredValues("model_config", {"hf_config": _DeclaredValues("model_config.hf_config", dict(facts))})


def skip_reason(exc: BaseException, node_reads: list[str] = (), skipped: list[list[str]] = ()) -> str | None:
    """Why a step cannot run here, or None for a real failure: it reads a checkpoint value, queries
    the GPU, failed on the node's hardware it looked at, or (after a step was skipped) trips over
    a None that a skipped step resolves in a real launch. SGLang rejects a value with a
    ValueError or an assertion naming it: those are never skipped for the last two reasons."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, CheckpointValueNeeded):
            return f"reads the checkpoint's {cause}"
        tb = cause.__traceback__
        while tb is not None:
            filename = tb.tb_frame.f_code.co_filename.replace("\\", "/")
            part = next((p for p in _GPU_FRAMES if p in filename), None)
            if part:
                where = part.strip("/").replace("/", ".").removesuffix(".py")
                return f"queries the GPU ({tb.tb_frame.f_code.co_name} in {where})"
            tb = tb.tb_next
        cause = cause.__cause__ or cause.__context__
    if isinstance(exc, (ValueError, AssertionError)):
        return None
    if node_reads:
        return f"reads the node's hardware ({', '.join(sorted(set(node_reads)))}), which a chroot has not"
    if skipped and isinstance(exc, TypeError) and "NoneType" in str(exc):
        return (f"uses a value that skipped steps resolve in a launch ({', '.join(sorted({s for s, _ in skipped}))}): "
                f"{one_line(exc)}")
    return None


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if not isinstance(exc, (ValueError, AssertionError)) else text


def pipeline_step(exc: BaseException) -> str:
    """The step of SGLang's resolution pipeline exc came from: the function its
    run_resolution_pipeline frame called (through run_post_process_pass), and the innermost
    resolution function when that is another one."""
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame.f_code.co_filename.replace("\\", "/"), tb.tb_frame.f_code.co_name))
        tb = tb.tb_next
    below = [i for i, (f, _) in enumerate(frames) if f.endswith("/arg_groups/pipeline.py")]
    called = [n for _, n in frames[below[-1] + 1:] if n not in ("run_post_process_pass", "run_hook")] if below else []
    step = called[0] if called else "?"
    inner = innermost_function(exc, "/sglang/srt/arg_groups/")
    return step if inner in (step, "?") else f"{step} ({inner})"


def innermost_function(exc: BaseException, under: str) -> str:
    """The innermost function of exc's traceback whose file is under `under` (a path part)."""
    name = "?"
    tb = exc.__traceback__
    while tb is not None:
        if under in tb.tb_frame.f_code.co_filename.replace("\\", "/"):
            name = tb.tb_frame.f_code.co_name
        tb = tb.tb_next
    return name


class StepLog:
    """What the wrappers saw during one resolution."""

    def __init__(self) -> None:
        self.ran: list[str] = []
        self.skipped: list[list[str]] = []
        self.failed_step: str | None = None


def install_step_wrappers(log_ref: list[StepLog]) -> list[str]:
    """Wrap every step SGLang lets plugins override; returns their names."""
    from sglang.srt.arg_groups import resolution_hooks

    names = sorted(getattr(resolution_hooks, "_OVERRIDABLE_HOOKS", ()))
    if not names or not hasattr(resolution_hooks, "register_resolution_hook"):
        raise RuntimeError("the image's SGLang has no resolution hooks (sglang.srt.arg_groups.resolution_hooks); "
                           "the profile check needs SGLang's resolution pipeline (0.5.21 or later)")

    def wrapper_for(name: str) -> Callable[[Any, Callable[[Any], None]], None]:
        def wrapper(server_args: Any, previous: Callable[[Any], None]) -> None:
            log = log_ref[0]
            NodeReads.paths = []
            try:
                previous(server_args)
            except BaseException as exc:
                reason = skip_reason(exc, NodeReads.paths, log.skipped)
                if reason is None:
                    log.failed_step = log.failed_step or name
                    raise
                log.skipped.append([name, reason])
                return
            finally:
                NodeReads.paths = []
            log.ran.append(name)
        return wrapper

    for name in names:
        resolution_hooks.register_resolution_hook(name)(wrapper_for(name))
    return names


def platform_facts(capability: tuple[int, int]) -> dict[str, Any]:
    """SGLang's platform facts for a CUDA GPU of `capability`, limited to the facts this SGLang
    knows (its probe names differ between releases)."""
    from sglang.srt import runtime_context

    major, minor = capability
    facts: dict[str, Any] = {
        "is_cuda": True, "is_hip": False, "is_npu": False, "is_xpu": False, "is_musa": False, "is_mps": False,
        "is_sm90": major == 9, "is_sm100": major == 10, "is_sm110": major == 11, "is_sm120": major == 12,
        "is_sm100_or_sm110": major in (10, 11), "is_blackwell": major in (10, 11, 12),
        "is_hopper_with_cuda_12_3": major == 9,
        "has_flashinfer": importlib.util.find_spec("flashinfer") is not None,
        "device_capability": (major, minor), "device_sm": major * 10 + minor,
    }
    known = set(getattr(runtime_context, "_PLATFORM_PROBES", {})) | set(getattr(runtime_context, "_PLATFORM_VALUES", {}))
    if not known:
        raise RuntimeError("the image's SGLang has no platform facts (sglang.srt.runtime_context); "
                           "the profile check needs SGLang 0.5.21 or later")
    return {k: v for k, v in facts.items() if k in known}


class ParseError(Exception):
    """argparse's error, as an exception instead of usage + exit 2."""


def _raise_parse_error(self: argparse.ArgumentParser, message: str) -> None:
    raise ParseError(message)


def option_strings(settings: list[str]) -> dict[str, str]:
    """The flag that sets each ServerArgs field (its dest), from SGLang's own parser."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    flags: dict[str, str] = {}
    for action in parser._actions:
        if action.dest in settings and action.option_strings and action.dest not in flags:
            flags[action.dest] = max(action.option_strings, key=len)
    return flags


def resolved_value(server_args: Any, name: str) -> Any:
    try:
        from sglang.srt.arg_groups.model_override_base import resolving_view
        value = getattr(resolving_view(server_args), name)
    except Exception:
        value = getattr(server_args, name, None)
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def load_entrypoint(path: str) -> Any:
    loader = importlib.machinery.SourceFileLoader("kimi_k3_entrypoint", path)
    spec = importlib.util.spec_from_loader("kimi_k3_entrypoint", loader)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    loader.exec_module(module)
    return module


def check_profile(request: dict[str, Any], name: str, entrypoint: Any, log_ref: list[StepLog],
                  overridable: list[str], flags: dict[str, str]) -> dict[str, Any]:
    result: dict[str, Any] = {"profile": name, "ok": False, "stage": "profile", "step": None, "error": None}
    profiles_dir = request["profiles_dir"]
    try:
        profile = entrypoint.load_profile(name, profiles_dir)
        checkpoint = profile["checkpoint"]
        stand_in = os.path.join(request["checkpoints_dir"], name)
        os.makedirs(stand_in, exist_ok=True)
        with open(os.path.join(stand_in, "config.json"), "w") as f:
            json.dump(checkpoint["config"], f, sort_keys=True)
        site = {key: spec["example"] for key, spec in profile.get("placeholders", {}).items()}
        site[checkpoint["placeholder"]] = stand_in
        args, env = entrypoint.resolve_profile(name, {**os.environ, **site}, profiles_dir)
    except Exception as exc:
        result["error"] = one_line(exc)
        return result
    result.update(args=args, env=env)

    result["stage"] = "guard"
    merged = {**os.environ, **env}
    refusal = entrypoint.refusal(args, merged)
    if refusal:
        result["error"] = refusal.removeprefix("error: ")
        return result
    os.environ.update(env)

    result["stage"] = "parse"
    from sglang.srt.server_args import prepare_server_args
    try:
        from sglang.srt.plugins import load_plugins
        load_plugins()
        argparse.ArgumentParser.error = _raise_parse_error  # type: ignore[method-assign]
        server_args = prepare_server_args(list(args))
    except ParseError as exc:
        result["error"] = str(exc)
        return result
    except SystemExit as exc:
        result["error"] = f"SGLang's parser exited ({exc.code})"
        return result
    except Exception as exc:
        result["error"] = one_line(exc)
        return result

    result["stage"] = "resolve"
    from sglang.srt.arg_groups.overrides import declare_resolution
    from sglang.srt.runtime_context import override_platform

    log = StepLog()
    log_ref[0] = log
    # The fixture form of SGLang's model-config cache: no path key, handed back as it is.
    vars(server_args)["_model_config"] = checkpoint_stand_in(checkpoint["config"])
    # A launcher-stage declaration, kept by the pipeline: SGLang would ask torch for the device.
    declare_resolution(server_args, "kimi-k3 profile check: the image's target device", device="cuda")
    stopped = None
    with override_platform(**platform_facts(tuple(request["gpu_capability"]))):
        try:
            server_args.resolve_once()
        except Exception as exc:
            reason = skip_reason(exc, NodeReads.paths, log.skipped)
            if reason is None:
                result["step"] = log.failed_step or innermost_function(exc, "/sglang/srt/")
                result["error"] = one_line(exc)
                return result
            stopped = [pipeline_step(exc), reason]
        # As the launcher does after resolution; after a stop, on what was resolved up to there.
        result["stage"] = "check"
        NodeReads.paths = []
        try:
            server_args.check_server_args()
        except Exception as exc:
            reason = skip_reason(exc, NodeReads.paths, [*log.skipped, *([stopped] if stopped else [])])
            if reason is None:
                result["error"] = one_line(exc)
                return result
            log.skipped.append(["check_server_args", reason])
        else:
            log.ran.append("check_server_args")
    result.update(
        ok=True, stage="done", ran=log.ran, skipped=log.skipped, stopped=stopped,
        not_reached=sorted(set(overridable) - set(log.ran) - {s for s, _ in log.skipped}) if stopped else [],
        values={k: resolved_value(server_args, k) for k in request["settings"]},
        flags=flags,
    )
    return result


# ---------------------------------------------------------------- image features

def situ_mxfp4_cutlass() -> str | None:
    """SiTU in the MXFP4 CUTLASS MoE: the image's SGLang runner has the project's SiTU path
    (sglang_patches 0001) and its probe accepts the image's FlashInfer (CUTLASS SiTU, #4460)."""
    runner = importlib.import_module("sglang.srt.layers.moe.moe_runner.flashinfer_cutlass")
    if hasattr(runner, "is_flashinfer_available"):
        # Its gate asks torch.cuda (no GPU here); on the target a CUDA GPU makes FlashInfer
        # available, as the platform facts say. This runs in a throwaway fork.
        runner.is_flashinfer_available = lambda: importlib.util.find_spec("flashinfer") is not None
    probe = getattr(runner, "require_flashinfer_cutlass_situ", None)
    if probe is None:
        return ("the image's SGLang MXFP4 CUTLASS runner has no SiTU path (no require_flashinfer_cutlass_situ "
                "in sglang/srt/layers/moe/moe_runner/flashinfer_cutlass.py: sglang_patches 0001 is not applied)")
    try:
        probe()
    except RuntimeError as exc:
        return f"the image's FlashInfer has no CUTLASS SiTU: {one_line(exc)}"
    return None


def flashkda_wheel() -> str | None:
    """FlashKDA for SGLang's flashkda KDA prefill backend: the flash_kda distribution is installed
    and imports, its extension flash_kda_C loading against the image's torch (no GPU needed to
    load it; SGLang's kernel wrapper imports it the same way at model load)."""
    from importlib import metadata
    try:
        version = metadata.version("flash_kda")
    except metadata.PackageNotFoundError:
        return ("the image has no flash_kda (FlashKDA): build the image variant with --//image:kda_prefill=flashkda, "
                "which installs //kernel_cache:flashkda_wheel_12_0a")
    try:
        module = importlib.import_module("flash_kda")
    except Exception as exc:  # an ImportError naming a symbol or library, or what flash_kda raises
        return f"flash_kda {version} is installed but does not import: {one_line(exc)}"
    if not callable(getattr(module, "fwd", None)):
        return f"flash_kda {version} imports but has no fwd(), which SGLang's FlashKDA wrapper calls"
    return None


# name -> probe returning None when the image has the feature, else why not (one line).
FEATURES: dict[str, Callable[[], str | None]] = {
    "situ-mxfp4-cutlass": situ_mxfp4_cutlass,
    "flashkda-wheel": flashkda_wheel,
}


def emit(record: dict[str, Any]) -> None:
    print(MARK, json.dumps(record, sort_keys=True), sep="\t", flush=True)


def run_forked(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """fn() in a child process; its result comes back through a pipe."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        try:
            out = fn()
        except BaseException as exc:
            out = {"ok": False, "stage": "probe", "step": None,
                   "error": f"profile check crashed: {one_line(exc)}", "trace": traceback.format_exc()[-2000:]}
        with os.fdopen(write_fd, "w") as w:
            w.write(json.dumps(out, default=str))
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as r:
        data = r.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        return {"ok": False, "stage": "probe", "step": None,
                "error": f"profile check process died (wait status {status})"}
    return json.loads(data)


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        request = json.load(f)
    entrypoint = load_entrypoint(request["entrypoint"])
    # SGLang imports torch & co. once here; each profile runs in a fork of this process.
    import importlib.metadata
    import sglang.srt.server_args  # noqa: F401

    emit({"sglang": importlib.metadata.version("sglang")})

    for feature in request["features"]:
        result = run_forked(lambda: {"why_not": FEATURES[feature]()})
        emit({"feature": feature, "why_not": result.get("why_not"), "error": result.get("error")})
    log_ref = [StepLog()]
    overridable = install_step_wrappers(log_ref)
    NodeReads.install()
    flags = option_strings(list(request["settings"]))
    for name in request["profiles"]:
        result = run_forked(lambda: check_profile(request, name, entrypoint, log_ref, overridable, flags))
        result["profile"] = name
        emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
