"""//tests/cpu/pins:third_stack_analysis: a third stack is data, shown on the workspace itself.

A copy of this workspace (its git-tracked and untracked-not-ignored files, as they are) gets a
stack `third` in third_party/pins.lock.json (the pypi stack's pins), a third.series and
third.manifest.json in each patch folder (the pypi ones) and a plan for it
(kernel_cache/plan_120f_kimi-k3.third.bzl); no Starlark file is touched. A nested Bazel (its own
output root, --batch: no server stays) then analyses, with --//third_party:stack=third, what the
BUILD files select per stack: the kernel-cache plan, the FlashInfer and SGLang layers and the
SBOM's stack. The nested Bazel is the machine's `bazel` (the sealed root's Bazel 7); it fetches
only the pins those targets name, from the artifact cache the outer build filled. The Starlark
generators themselves are unit-tested in :stack_facts_test.

KIMI_THIRD_STACK_WORKSPACE (--test_env) copies another checkout instead, e.g. one of main to see
it fail there.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cpu.conftest import env_path


def _workspace() -> Path:
    override = os.environ.get("KIMI_THIRD_STACK_WORKSPACE")
    return Path(override) if override else Path(os.path.realpath(env_path("KIMI_MODULE_BAZEL"))).parent


def _copy(workspace: Path, dest: Path) -> None:
    files = subprocess.run(["git", "-C", str(workspace), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           capture_output=True, check=True).stdout.split(b"\0")
    for rel in filter(None, (f.decode() for f in files)):
        src = workspace / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def _add_third_stack(ws: Path) -> None:
    lock_path = ws / "third_party" / "pins.lock.json"
    lock = json.loads(lock_path.read_text())
    lock["stacks"]["third"] = {**lock["stacks"]["pypi"], "description": "A third stack (test fixture): pypi's pins."}
    lock_path.write_text(json.dumps(lock, indent=1, sort_keys=True) + "\n")
    for folder in ("flashinfer_patches", "sglang_patches"):
        shutil.copy(ws / folder / "pypi.series", ws / folder / "third.series")
        manifest = json.loads((ws / folder / "pypi.manifest.json").read_text())
        manifest["series"] = "third.series"
        (ws / folder / "third.manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    shutil.copy(ws / "kernel_cache" / "plan_120f_kimi-k3.pypi.bzl", ws / "kernel_cache" / "plan_120f_kimi-k3.third.bzl")


def _bazel(ws: Path, root: Path, *args: str) -> str:
    cache = env_path("KIMI_CACHE_ROOT_FILE").read_text().strip()
    python = getattr(sys, "_base_executable", sys.executable)
    argv = ["bazel", f"--output_user_root={root}", "--batch", *args, "--//third_party:stack=third",
            f"--repo_env=KIMI_K3_PYTHON={python}", f"--repo_env=KIMI_K3_CACHE={cache}"]
    started = time.monotonic()
    proc = subprocess.run(argv, cwd=ws, capture_output=True, text=True,
                          env={**os.environ, "KIMI_K3_PYTHON": python, "KIMI_K3_CACHE": cache})
    print(f"{' '.join(args[:2])}: exit {proc.returncode} in {time.monotonic() - started:.0f} s", file=sys.stderr)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR")]
    assert proc.returncode == 0, "\n".join(errors[:5]) or proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def third(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("third_stack")
    ws = base / "ws"
    _copy(_workspace(), ws)
    _add_third_stack(ws)
    return ws, base / "output_root"


def test_the_third_stack_s_kernel_cache_plan_is_selected(third: tuple[Path, Path]) -> None:
    out = _bazel(*third, "cquery", "//kernel_cache:selected_plan", "--output=files")
    assert out.split() == ["kernel_cache/plan_120f_kimi-k3.third.bzl"], out


def _actions(aquery_text: str) -> dict[tuple[str, str], str]:
    """(target, mnemonic) -> the action's text, from `aquery --output=text`."""
    actions = {}
    for block in ("\n" + aquery_text).split("\naction ")[1:]:
        target = re.search(r"^  Target: (\S+)$", block, re.M)
        mnemonic = re.search(r"^  Mnemonic: (\S+)$", block, re.M)
        if target and mnemonic:
            actions[(target.group(1), mnemonic.group(1))] = block
    return actions


def test_the_image_layers_and_sbom_follow_the_third_stack(third: tuple[Path, Path]) -> None:
    out = _bazel(*third, "aquery", "//image:layer_flashinfer + //image:layer_sglang + //image:sbom", "--output=text")
    actions = _actions(out)
    flashinfer = actions[("//image:layer_flashinfer", "OciLayerInstall")]  # the wheels are installed apart
    sglang = actions[("//image:layer_sglang", "OciLayerInstall")]
    (sbom,) = [text for (target, _), text in actions.items() if target == "//image:sbom"]
    # FlashInfer: third's series applies nothing, so the pinned wheel goes in as is (as on pypi).
    assert re.search(r"--wheel \\\n\s+\S+/flashinfer_python-\S+\.whl", flashinfer) and "--wheel-dir" not in flashinfer, flashinfer
    # SGLang: third's series patches it, so the repacked wheel of the gate's tree goes in.
    assert "--wheel-dir" in sglang, sglang
    assert re.search(r"--stack \\\n\s+third\b", sbom), sbom


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
