"""Every reader of a JSON data file, fed the four mistakes a hand-edited file makes: the wrong
top-level type, a wrong type inside, a key twice and truncated JSON. Each is one UserError line
that starts with the flag the user passed (or what the file is, where no one flag names it) and
the file, then names the JSON path (the line and column for truncated JSON). Before
tools/common/jsondata.py some of these ended in an AttributeError traceback or named a flag the
command does not have.

Each reader starts from the checked-in file it reads (which it must accept) and is handed a copy
with one mistake. The pins lock, the Debian lock's sets and a patch folder's wheel_layout.json
check their fields by hand, naming the pin, the set or the rule instead of a JSON path; their
cases below say what they name.
"""
from __future__ import annotations

import copy
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest

from tools.common.errors import UserError
from tools.common.jsondata import json_path
from tools.gpu_suite import bundle
from tools.image import backend_needs, launch_profiles, sbom
from tools.jit_cache import cli as jit_cache_cli
from tools.jit_cache import inventory, sglang_aot, triton_aot
from tools.kernel_cache import modules as kernel_cache_modules
from tools.kernel_cache import selection
from tools.patch_gate import manifest
from tools.patch_gate.remap import WheelLayout
from tools.pins import debian
from tools.pins import lock as pins_lock

REPO = Path(__file__).absolute().parents[3]
GPU_HOST = REPO / "tools" / "gpu_suite" / "gpu_host.json"
PROFILE = REPO / "image" / "profiles" / "kimi-k3-tp32ep32.json"
TOP_LEVEL_LIST = "$: expected an object, found a list"
Keys = list[str | int]


@dataclass(frozen=True)
class Reader:
    name: str
    what: str  # how the message starts, before the file: the flag passed, or what the file is
    valid: Path  # the checked-in file the reader reads
    read: Callable[[Path], Any]
    nested: tuple[Keys, Any, str]  # where a wrong value goes, the value, what the message then says
    twice: Keys  # an object whose first key is given twice
    top_level: str = TOP_LEVEL_LIST  # what `[]` as the whole file is called

    def prefix(self, path: Path) -> str:
        return f"{self.what} {path}: " if self.what else f"{path}: "


def inventory_cli(flag: str) -> Callable[[Path], Any]:
    """`python3 -m tools.jit_cache inventory` with `flag` naming the file, every other input the
    checked-in one and no tree: the inputs are read first, so the tree's refusal means every file
    was accepted."""
    inputs = {"--profiles": REPO / "image" / "profiles", "--reach": REPO / "jit_cache" / "reach.json",
              "--facts": REPO / "jit_cache" / "checkpoint_facts.json",
              "--backend-needs": REPO / "image" / "backend_needs.json",
              "--sglang-modules": REPO / "jit_cache" / "sglang_modules.json",
              "--triton-calls": REPO / "jit_cache" / "triton_calls.json",
              "--kernel-plan": REPO / "kernel_cache" / "plan_120f_kimi-k3.pypi.bzl",
              "--lock": REPO / "third_party" / "pins.lock.json"}

    def read(path: Path) -> None:
        args = ["inventory", "--stack", "pypi", "--tree", str(path.parent / "no-tree"), "--out", str(path) + ".out"]
        for name, default in inputs.items():
            args += [name, str(path if name == flag else default)]
        try:
            jit_cache_cli.main(args)
        except UserError as e:
            if not str(e).startswith("--tree "):
                raise
        assert not Path(str(path) + ".out").exists()
    return read


def inventory_check(path: Path) -> None:
    jit_cache_cli.main(["check", f"--built=pypi={path}", f"--inventory-dir={path.parent / 'none'}"])


READERS = [
    Reader("backend needs (profiles --needs)", "--needs", REPO / "image" / "backend_needs.json", backend_needs.load_needs,
           (["settings", "moe_runner_backend", "flashinfer_mxfp4", "modules"], [],
            "$.settings.moe_runner_backend.flashinfer_mxfp4.modules: expected an object, found a list"),
           ["settings", "sampling_backend"]),
    Reader("launch profile (profiles)", "profile", PROFILE, lambda p: launch_profiles.load_profile_files([p]),
           (["checkpoint", "config", "architectures"], "KimiK3ForConditionalGeneration",
            '$.checkpoint.config.architectures: expected a non-empty list, found the string '
            '"KimiK3ForConditionalGeneration"'),
           ["env"]),
    Reader("launch profile (inventory --profiles)", "launch profile", PROFILE,
           lambda p: inventory.load_profiles(p.parent),
           (["args"], "--tp-size 8", '$.args: expected a list, found the string "--tp-size 8"'),
           ["checkpoint", "config"]),
    Reader("inventory --triton-calls", "--triton-calls", REPO / "jit_cache" / "triton_calls.json",
           inventory_cli("--triton-calls"),
           (["stacks", "pypi", 0, "args"], [], "$.stacks.pypi[0].args: expected an object, found a list"),
           ["stacks"]),
    Reader("inventory --sglang-modules", "--sglang-modules", REPO / "jit_cache" / "sglang_modules.json",
           inventory_cli("--sglang-modules"),
           (["stacks", "pypi", 0, "args"], {}, "$.stacks.pypi[0].args: expected a list, found an object"),
           ["stacks", "pypi", 0]),
    Reader("inventory --reach", "--reach", REPO / "jit_cache" / "reach.json", inventory_cli("--reach"),
           (["pruning", "cuda_predicates"], "_is_cuda", '$.pruning.cuda_predicates: expected a list, found the string '
                                                         '"_is_cuda"'),
           ["registries"]),
    Reader("inventory --facts", "--facts", REPO / "jit_cache" / "checkpoint_facts.json", inventory_cli("--facts"),
           (["architectures", "KimiK3ForConditionalGeneration", "facts"], [],
            "$.architectures.KimiK3ForConditionalGeneration.facts: expected an object, found a list"),
           ["architectures"]),
    Reader("inventory --backend-needs", "--backend-needs", REPO / "image" / "backend_needs.json",
           inventory_cli("--backend-needs"),
           (["architectures"], [], "$.architectures: expected an object, found a list"), ["settings"]),
    Reader("inventory check --built", "--built", REPO / "jit_cache" / "inventory.pypi.json", inventory_check,
           (["unreached"], {}, "$.unreached: expected a list, found an object"), ["sites"]),
    Reader("triton calls (build-triton --calls)", "--calls", REPO / "jit_cache" / "triton_calls.json",
           lambda p: triton_aot.load_calls(p, "pypi"),
           (["stacks", "pypi"], {}, "$.stacks.pypi: expected a list, found an object"), ["stacks", "pypi", 0]),
    Reader("SGLang JIT modules (build-sglang --modules)", "--modules", REPO / "jit_cache" / "sglang_modules.json",
           lambda p: sglang_aot.load_modules(p, "pypi"),
           (["stacks", "pypi", 0, "why"], 1, "$.stacks.pypi[0].why: expected a non-empty string, found the number 1"),
           ["stacks"]),
    Reader("SGLang JIT runtime (--runtime)", "--runtime", GPU_HOST, sglang_aot.load_runtime,
           (["sglang_jit_runtime", "distributions"], [],
            "$.sglang_jit_runtime.distributions: expected an object, found a list"),
           ["sglang_jit_runtime"]),
    Reader("Triton runtime (--runtime)", "--runtime", GPU_HOST, triton_aot.load_runtime,
           (["triton_runtime", "device", "capability"], {},
            "$.triton_runtime.device.capability: expected a list, found an object"),
           ["triton_runtime", "device", "device_properties"]),
    Reader("GPU host spec (bundle)", "GPU host spec", GPU_HOST, bundle.load_host_spec,
           (["from_host"], {"torch": "2.11"}, "$.from_host: expected a list, found an object"),
           ["triton_runtime", "device"]),
    Reader("kernel-cache modules (--modules)", "--modules", REPO / "kernel_cache" / "modules.json",
           kernel_cache_modules.load_modules,
           (["modules", 0, "archs"], "12.0f", '$.modules[0].archs: expected a list, found the string "12.0f"'),
           ["modules", 0]),
    Reader("kernel selections (--selections)", "--selections", REPO / "kernel_cache" / "selections.json",
           selection.load_selections,
           (["selections", "kimi-k3", "modules"], [], "$.selections.kimi-k3.modules: expected an object, found a list"),
           ["selections", "kimi-k3"]),
    Reader("patch gate --expected-manifest", "--expected-manifest", REPO / "sglang_patches" / "pypi.manifest.json",
           manifest.read_manifest,
           (["patches", 0, "files"], {}, "$.patches[0].files: expected a list, found an object"), ["target"]),
    Reader("patch gate --built", "--built", REPO / "sglang_patches" / "pypi.manifest.json", manifest.read_built,
           (["changed_files", 0, "changed_by"], "0001", '$.changed_files[0].changed_by: expected a list, found the '
                                                          'string "0001"'),
           ["layout"]),
    Reader("SBOM --gate-manifest", "--gate-manifest", REPO / "sglang_patches" / "pypi.manifest.json",
           sbom.read_gate_manifest,
           (["patches", 0, "state"], None, "$.patches[0].state: expected a non-empty string, found null"), ["target"]),
    # Fields checked by hand (remap.py): the messages name the rule, by kind and number.
    Reader("patch gate --layout", "--layout", REPO / "sglang_patches" / "wheel_layout.json", WheelLayout.load,
           (["map"], {}, "`map` is an object; make it a list"), ["map", 0],
           top_level="holds a list, not an object"),
    # Each set's fields are checked by hand (debian.py parse_set), naming the set and package.
    Reader("Debian lock", "Debian lock", REPO / "third_party" / "debian.lock.json", debian.load_sets,
           (["sets"], [], "$.sets: expected an object, found a list"), ["sets"]),
    # The lock's own validation (lock.py): messages name the field, the pin or the stack.
    Reader("pins lock", "", REPO / "third_party" / "pins.lock.json", pins_lock.load,
           (["stacks"], [], "stacks must be a JSON object, got list"), ["pins"],
           top_level="top level must be a JSON object, got list"),
]
IDS = [r.name for r in READERS]


def value_at(doc: Any, keys: Keys) -> Any:
    for key in keys:
        doc = doc[key]
    return doc


def with_value(doc: Any, keys: Keys, value: Any) -> Any:
    doc = copy.deepcopy(doc)
    value_at(doc, keys[:-1])[keys[-1]] = value
    return doc


def with_key_twice(doc: Any, keys: Keys) -> tuple[str, str]:
    """The document's text with the first key of the object at `keys` given twice; and the key."""
    target = value_at(doc, keys)
    key = next(iter(target))
    marker = "KEY-TWICE-MARKER"
    twice = "{" + json.dumps({key: target[key]})[1:-1] + ", " + json.dumps(target)[1:]
    text = json.dumps(with_value(doc, keys, marker), indent=1).replace(json.dumps(marker), twice)
    assert text.count(marker) == 0
    return text, key


def refused(reader: Reader, path: Path, text: str) -> str:
    path.write_text(text)
    with pytest.raises(UserError) as e:
        reader.read(path)
    message = str(e.value)
    assert "\n" not in message, message
    assert message.startswith(reader.prefix(path)), message
    return message[len(reader.prefix(path)):]


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    # Alone in its directory (the inventory reads every profile there), named as a profile may be.
    (tmp_path / "in").mkdir()
    return tmp_path / "in" / "data.json"


@pytest.mark.parametrize("reader", READERS, ids=IDS)
def test_the_checked_in_file_is_accepted(reader: Reader, data_file: Path) -> None:
    data_file.write_bytes(reader.valid.read_bytes())
    reader.read(data_file)


@pytest.mark.parametrize("reader", READERS, ids=IDS)
def test_the_wrong_top_level_type(reader: Reader, data_file: Path) -> None:
    assert refused(reader, data_file, "[]").startswith(reader.top_level)


@pytest.mark.parametrize("reader", READERS, ids=IDS)
def test_a_wrong_type_inside(reader: Reader, data_file: Path) -> None:
    keys, value, expected = reader.nested
    doc = json.loads(reader.valid.read_text())
    assert refused(reader, data_file, json.dumps(with_value(doc, keys, value), indent=1)).startswith(expected)


@pytest.mark.parametrize("reader", READERS, ids=IDS)
def test_a_key_twice(reader: Reader, data_file: Path) -> None:
    text, key = with_key_twice(json.loads(reader.valid.read_text()), reader.twice)
    assert refused(reader, data_file, text).startswith(f"{json_path(reader.twice)}: key '{key}' appears twice in "
                                                       "one object (the object at line ")


@pytest.mark.parametrize("reader", READERS, ids=IDS)
def test_truncated_json(reader: Reader, data_file: Path) -> None:
    text = reader.valid.read_text()
    cut = text[:len(text) // 2]
    line = cut.count("\n") + 1
    assert refused(reader, data_file, cut).startswith(f"invalid JSON at line {line} column ")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
