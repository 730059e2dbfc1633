"""CPU tests of tools/patch_gate/version_coherence.py: FlashInfer package sets that must be refused."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

from tests.cpu.conftest import pins_lock, stack_pin, stack_version
from tools.patch_gate import version_coherence as vc
from tools.common.errors import UserError, run_cli
LOCK = REPO / "third_party" / "pins.lock.json"
# Version strings of the coherence rules below are fixtures (the rules hold for any version); the
# lock's own stacks are checked in test_lock_stacks_are_coherent.
PATCHED = "1.4.2+kimik3.01382e17"


def dists(*specs: str) -> list[vc.Dist]:
    return [vc.dist_from_spec(spec) for spec in specs]


@pytest.mark.parametrize("specs", [
    ("flashinfer-python==1.4.2",),
    ("flashinfer-python==1.4.2", "flashinfer-cubin==1.4.2", "flashinfer-jit-cache==1.4.2+cu130"),
    (f"flashinfer-python=={PATCHED}", "flashinfer-cubin==1.4.2"),
    (f"flashinfer-python=={PATCHED}", f"flashinfer-jit-cache=={PATCHED}"),
    ("flashinfer_python==1.5.0", "Flashinfer.Cubin==1.5.0", "torch==2.13.0"),
])
def test_coherent_sets(specs: tuple[str, ...]) -> None:
    assert vc.coherence_problems(dists(*specs)) == []


@pytest.mark.parametrize("specs, needle", [
    (("flashinfer-python==1.4.2", "flashinfer-cubin==1.3.9"), "flashinfer-cubin 1.3.9 does not equal flashinfer-python 1.4.2"),
    (("flashinfer-python==1.4.2", "flashinfer-jit-cache==1.4.1+cu130"), "does not start with flashinfer-python 1.4.2"),
    ((f"flashinfer-python=={PATCHED}", "flashinfer-jit-cache==1.4.2+cu130"), "would run unpatched kernels"),
    ((f"flashinfer-python=={PATCHED}", "flashinfer-cubin==1.4.1"), "flashinfer-cubin 1.4.1 does not equal"),
    (("flashinfer-cubin==1.4.2",), "without flashinfer-python"),
    (("flashinfer-python==1.4.2", "flashinfer-python==1.5.0"), "appears as 1.4.2"),
])
def test_incoherent_sets(specs: tuple[str, ...], needle: str) -> None:
    problems = vc.coherence_problems(dists(*specs))
    assert any(needle in p for p in problems), problems


def test_cli_with_wheel_names_and_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    ok = ["--wheel", f"flashinfer_python-{PATCHED}-py3-none-any.whl", "--wheel", "/x/flashinfer_cubin-1.4.2-py3-none-any.whl"]
    assert run_cli(vc.main, ok) == 0
    assert "(patched)" in capsys.readouterr().out
    bad = ok + ["--wheel", "flashinfer_jit_cache-1.4.2+cu130-cp39-abi3-manylinux_2_28_x86_64.whl"]
    assert run_cli(vc.main, bad) == 1
    assert "unpatched kernels" in capsys.readouterr().err
    assert run_cli(vc.main, ["--wheel", "not-a-wheel.tar.gz"]) == 2
    assert run_cli(vc.main, []) == 2


def write_dist_info(site: Path, name: str, version: str) -> None:
    dist_info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\nbody\n")


def test_site_packages(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    site = tmp_path / "site-packages"
    write_dist_info(site, "flashinfer-python", PATCHED)
    write_dist_info(site, "numpy", "2.1.0")
    assert run_cli(vc.main, ["--site-packages", str(site)]) == 0
    write_dist_info(site, "flashinfer-jit-cache", "1.4.2+cu130")
    assert run_cli(vc.main, ["--site-packages", str(site)]) == 1
    assert "flashinfer-jit-cache 1.4.2+cu130 next to patched flashinfer-python" in capsys.readouterr().err
    with pytest.raises(UserError, match="not a directory"):
        vc.dists_from_site_packages(tmp_path / "absent")


@pytest.mark.parametrize("stack", sorted(pins_lock()["stacks"]))
def test_lock_stacks_are_coherent(stack: str, capsys: pytest.CaptureFixture[str]) -> None:
    found = vc.dists_from_lock_stack(LOCK, stack)
    pin, version = stack_pin(stack, "flashinfer"), stack_version(stack, "flashinfer")
    assert vc.Dist("flashinfer-python", version, f"lock pin {pin}") in found
    assert run_cli(vc.main, ["--lock", str(LOCK), "--stack", stack]) == 0
    assert run_cli(vc.main, ["--lock", str(LOCK), "--stack", "nope"]) == 2



def test_a_malformed_lock_is_refused_by_the_lock_loader(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--lock goes through tools.pins.lock's validation, not a raw JSON read."""
    doc = json.loads(LOCK.read_text())
    pin = stack_pin("default", "flashinfer")
    doc["pins"][pin]["sha256"] = "abc"
    bad = tmp_path / "pins.lock.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(UserError, match=re.escape(pin) + r".*sha256"):
        vc.dists_from_lock_stack(bad, "default")
    assert run_cli(vc.main, ["--lock", str(bad), "--stack", "default"]) == 2
    assert str(bad) in capsys.readouterr().err

if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
