"""CPU tests of tools/patch_gate/version_coherence.py: FlashInfer package sets that must be refused."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

from tools.patch_gate import version_coherence as vc
from tools.common.errors import UserError, run_cli
LOCK = REPO / "third_party" / "pins.lock.json"
PATCHED = "0.6.18+kimik3.01382e17"


def dists(*specs: str) -> list[vc.Dist]:
    return [vc.dist_from_spec(spec) for spec in specs]


@pytest.mark.parametrize("specs", [
    ("flashinfer-python==0.6.18",),
    ("flashinfer-python==0.6.18", "flashinfer-cubin==0.6.18", "flashinfer-jit-cache==0.6.18+cu130"),
    (f"flashinfer-python=={PATCHED}", "flashinfer-cubin==0.6.18"),
    (f"flashinfer-python=={PATCHED}", f"flashinfer-jit-cache=={PATCHED}"),
    ("flashinfer_python==0.7.2", "Flashinfer.Cubin==0.7.2", "torch==2.13.0"),
])
def test_coherent_sets(specs: tuple[str, ...]) -> None:
    assert vc.coherence_problems(dists(*specs)) == []


@pytest.mark.parametrize("specs, needle", [
    (("flashinfer-python==0.6.18", "flashinfer-cubin==0.6.13"), "flashinfer-cubin 0.6.13 does not equal flashinfer-python 0.6.18"),
    (("flashinfer-python==0.6.18", "flashinfer-jit-cache==0.6.17+cu130"), "does not start with flashinfer-python 0.6.18"),
    ((f"flashinfer-python=={PATCHED}", "flashinfer-jit-cache==0.6.18+cu130"), "would run unpatched kernels"),
    ((f"flashinfer-python=={PATCHED}", "flashinfer-cubin==0.6.17"), "flashinfer-cubin 0.6.17 does not equal"),
    (("flashinfer-cubin==0.6.18",), "without flashinfer-python"),
    (("flashinfer-python==0.6.18", "flashinfer-python==0.7.2"), "appears as 0.6.18"),
])
def test_incoherent_sets(specs: tuple[str, ...], needle: str) -> None:
    problems = vc.coherence_problems(dists(*specs))
    assert any(needle in p for p in problems), problems


def test_cli_with_wheel_names_and_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    ok = ["--wheel", f"flashinfer_python-{PATCHED}-py3-none-any.whl", "--wheel", "/x/flashinfer_cubin-0.6.18-py3-none-any.whl"]
    assert run_cli(vc.main, ok) == 0
    assert "(patched)" in capsys.readouterr().out
    bad = ok + ["--wheel", "flashinfer_jit_cache-0.6.18+cu130-cp39-abi3-manylinux_2_28_x86_64.whl"]
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
    write_dist_info(site, "flashinfer-jit-cache", "0.6.18+cu130")
    assert run_cli(vc.main, ["--site-packages", str(site)]) == 1
    assert "flashinfer-jit-cache 0.6.18+cu130 next to patched flashinfer-python" in capsys.readouterr().err
    with pytest.raises(UserError, match="not a directory"):
        vc.dists_from_site_packages(tmp_path / "absent")


@pytest.mark.parametrize("stack, version", [("default", "0.6.18"), ("pypi", "0.7.2")])
def test_lock_stacks_are_coherent(stack: str, version: str, capsys: pytest.CaptureFixture[str]) -> None:
    found = vc.dists_from_lock_stack(LOCK, stack)
    assert vc.Dist("flashinfer-python", version, f"lock pin flashinfer-python-{version}") in found
    assert run_cli(vc.main, ["--lock", str(LOCK), "--stack", stack]) == 0
    assert run_cli(vc.main, ["--lock", str(LOCK), "--stack", "nope"]) == 2



def test_a_malformed_lock_is_refused_by_the_lock_loader(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--lock goes through tools.pins.lock's validation, not a raw JSON read."""
    doc = json.loads(LOCK.read_text())
    doc["pins"]["flashinfer-python-0.6.18"]["sha256"] = "abc"
    bad = tmp_path / "pins.lock.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(UserError, match=r"flashinfer-python-0\.6\.18.*sha256"):
        vc.dists_from_lock_stack(bad, "default")
    assert run_cli(vc.main, ["--lock", str(bad), "--stack", "default"]) == 2
    assert str(bad) in capsys.readouterr().err

if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
