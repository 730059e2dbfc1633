"""tools/jit_cache on generated fixtures (no pinned wheel, no torch, nothing imported from a tree):
the scanner finds each kind of site, the reach follows lazy imports and prunes what the image
never runs, the check refuses an inventory that lacks a new kernel (naming its id, file and the
fix), and bad input is one line. Also: the checked-in data files are well formed."""
from __future__ import annotations

import ast
import dataclasses
import json
import sys
import textwrap
from pathlib import Path

import pytest

from tools.common.errors import UserError
from tools.common.jsondata import load_json_file
from tools.common.jsonfmt import review_json
from tools.jit_cache import cli
from tools.jit_cache.inventory import CHECKPOINT_FACT_SCHEMA, REACH, validate_inventory, validate_reach
from tools.jit_cache.sites import scan_module

REPO_ROOT = Path(__file__).absolute().parents[3]

TOY_KERNELS = '''
    from typing import TYPE_CHECKING
    import torch
    import triton
    import triton.language as tl
    from flashinfer.norm import rmsnorm
    from sglang.kernels.jit.utils import load_jit
    from sglang.utils import is_hip
    if TYPE_CHECKING:
        from sglang.kernels import typing_only
    _is_hip = is_hip()
    if _is_hip:
        from sglang.kernels import hip_only

    BLOCKS = [16, 32]

    @triton.autotune(
        configs=[triton.Config({"B": b}, num_warps=w) for b in BLOCKS for w in [2, 4, 8] if b * w < 200],
        key=["N"],
    )
    @triton.jit(do_not_specialize=["T"])
    def toy_kernel(x, N, T, B: tl.constexpr):
        pass

    @triton.jit
    def _plain(x):
        pass

    plain_kernel = triton.autotune(configs=[triton.Config({}), triton.Config({})], key=["M"])(_plain)

    def toy_module(dtype):
        return load_jit("toy_" + str(dtype), cuda_files=["toy/toy.cuh"],
                        cuda_wrappers=[("run", f"ToyKernel<{dtype}>::run")])

    @torch.compile(dynamic=True)
    def fused(x):
        return x
'''

REGISTRY = '''
    ATTENTION_BACKENDS = {}
    def register_attention_backend(name):
        def decorator(fn):
            ATTENTION_BACKENDS[name] = fn
            return fn
        return decorator

    @register_attention_backend("triton")
    def create_triton(runner):
        from sglang.kernels.triton_attn import Backend
        return Backend

    @register_attention_backend("fa3")
    def create_fa3(runner):
        from sglang.kernels.fa3_attn import Backend
        return Backend
'''

KERNEL = '''
    import triton
    class Backend:
        pass
    @triton.jit
    def attn_kernel(x):
        pass
'''

FIXTURE = {
    "sglang/__init__.py": "",
    "sglang/utils.py": "def is_hip():\n    return False\n",
    "sglang/launch_server.py": "from sglang.srt import server\n",
    "sglang/srt/__init__.py": "",
    "sglang/srt/server.py": ("def run(runner):\n"
                             "    from sglang.srt.attention_registry import ATTENTION_BACKENDS\n"
                             "    return ATTENTION_BACKENDS\n"),
    "sglang/srt/attention_registry.py": REGISTRY,
    "sglang/srt/models/__init__.py": "",
    "sglang/srt/models/toy.py": ("from sglang.kernels import toy_kernels\n"
                                 "class ToyForCausalLM:\n    pass\n"
                                 "EntryClass = [ToyForCausalLM]\n"),
    "sglang/srt/models/other.py": ("from sglang.kernels import other_kernels\n"
                                   "class OtherForCausalLM:\n    pass\n"
                                   "EntryClass = OtherForCausalLM\n"),
    "sglang/kernels/__init__.py": "",
    "sglang/kernels/jit/__init__.py": "",
    "sglang/kernels/jit/utils.py": "def load_jit(*args, **kwargs):\n    pass\n",
    "sglang/kernels/toy_kernels.py": TOY_KERNELS,
    "sglang/kernels/triton_attn.py": KERNEL,
    "sglang/kernels/fa3_attn.py": KERNEL,
    "sglang/kernels/hip_only.py": KERNEL,
    "sglang/kernels/typing_only.py": KERNEL,
    "sglang/kernels/other_kernels.py": KERNEL,
}

PROFILE = {
    "schema_version": 1,
    "checkpoint": {"placeholder": "MODEL_PATH", "config": {"architectures": ["ToyForCausalLM"]}},
    "args": ["--model-path", "${MODEL_PATH}", "--tp-size", "8", "--moe-runner-backend", "toy", "--trust-remote-code"],
}


def _reach() -> dict:
    reach = json.loads((REPO_ROOT / "jit_cache" / "reach.json").read_text())
    reach["architectures"] = {"ToyForCausalLM": {"resolved_settings": {
        "attention_backend": {"value": "triton", "why": "fixture"}}}}
    reach["setting_roots"] = {}
    reach["flashinfer_apis"] = {"flashinfer.norm.rmsnorm": "norm"}
    return reach


def write_fixture(root: Path, files: dict[str, str] = FIXTURE, profile: dict = PROFILE) -> dict[str, Path]:
    tree = root / "tree"
    for rel, text in files.items():
        path = tree / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    (root / "profiles").mkdir()
    (root / "profiles" / "toy.json").write_text(json.dumps(profile))
    (root / "reach.json").write_text(json.dumps(_reach()))
    (root / "facts.json").write_text(json.dumps({"schema_version": 1, "architectures": {}}))
    (root / "needs.json").write_text(json.dumps({"architectures": {"ToyForCausalLM": {"modules": {"norm": {}}}}}))
    (root / "plan.bzl").write_text('KERNEL_CACHE_PLAN = {"schema_version": 1, "modules": [{"name": "norm"}]}\n')
    # The stacks the fixture's inventories are for: the inventory refuses a stack the lock lacks.
    (root / "pins.lock.json").write_text(json.dumps({"schema_version": 1, "pins": {},
                                                     "stacks": {"toy": {}, "other": {}}}))
    return {"tree": tree, "profiles": root / "profiles", "reach": root / "reach.json", "facts": root / "facts.json",
            "needs": root / "needs.json", "plan": root / "plan.bzl", "lock": root / "pins.lock.json"}


def inventory_args(paths: dict[str, Path], out: Path, stack: str = "toy") -> list[str]:
    return ["inventory", "--stack", stack, "--tree", str(paths["tree"]), "--profiles", str(paths["profiles"]),
            "--reach", str(paths["reach"]), "--facts", str(paths["facts"]), "--backend-needs", str(paths["needs"]),
            "--kernel-plan", str(paths["plan"]), "--lock", str(paths["lock"]), "--out", str(out)]


@pytest.fixture
def built(tmp_path: Path) -> tuple[dict[str, Path], dict]:
    paths = write_fixture(tmp_path)
    out = tmp_path / "inventory.toy.json"
    assert cli.main(inventory_args(paths, out)) == 0
    return paths, json.loads(out.read_text())


def test_scanner_finds_each_kind() -> None:
    sites = {s.id: s for s in scan_module("k.py", ast.parse(textwrap.dedent(TOY_KERNELS)))}
    toy = sites["triton:k.py:toy_kernel"]
    # 2 blocks x 3 warps, minus 32 * 8 >= 200
    assert toy.details["autotune"] == {"configs": 5, "key": ["N"]}
    assert toy.details["do_not_specialize"] == ["T"]
    # autotune applied by call lands on the kernel it wraps
    assert sites["triton:k.py:_plain"].details["autotune"] == {"configs": 2, "key": ["M"]}
    jit = sites["sglang-jit:k.py:toy_module"].details
    assert jit["cuda_files"] == ["toy/toy.cuh"] and jit["cuda_wrappers"] == [["run", "ToyKernel"]]
    assert sites["inductor:k.py:fused"].details == {"use": "decorator", "dynamic": True}
    assert "flashinfer:k.py:flashinfer.norm.rmsnorm" in sites
    assert len(sites) == 5


def test_cute_dsl_compile_and_aot_cache() -> None:
    source = textwrap.dedent('''
        import cutlass.cute as cute
        from sglang.kernels.jit.cute_aot_cache import get_jit_cache
        CACHE = get_jit_cache("kda")
        def compiled(fn, *args):
            return cute.compile(fn, *args)
    ''')
    sites = {s.id: s.details for s in scan_module("c.py", ast.parse(source))}
    assert sites == {"cute-dsl:c.py:<module>": {"use": "aot-cache", "args": ["'kda'"]},
                     "cute-dsl:c.py:compiled": {"use": "compile", "compiles": "fn"}}


def test_one_memo_serves_closures_of_different_prunings() -> None:
    """The inventory shares one memo of each module's imports across its launch profiles: a
    closure through it equals one without it, for each pruning and each of lazy/startup, in any
    order (a memo keyed only by module would give the fa3 profile the triton one's imports)."""
    from tools.jit_cache import reach as reach_mod
    parsed = {rel: ast.parse(textwrap.dedent(text)) for rel, text in FIXTURE.items()}
    modules = {reach_mod.module_name(rel): rel for rel in FIXTURE}
    roots = ["sglang.launch_server", "sglang.srt.models.toy"]
    prunings = [reach_mod.Pruning(frozenset({"is_hip"}),
                                  registries={"register_attention_backend": frozenset({backend})})
                for backend in ("triton", "fa3")]
    alone = [reach_mod.closure(roots, modules, parsed.__getitem__, p, lazy) for p in prunings for lazy in (True, False)]
    assert "sglang.kernels.triton_attn" in alone[0] and "sglang.kernels.fa3_attn" not in alone[0]
    assert "sglang.kernels.fa3_attn" in alone[2] and "sglang.kernels.triton_attn" not in alone[2]
    assert "sglang.srt.attention_registry" not in alone[1]  # imported only inside a function
    memo: dict = {}
    shared = [reach_mod.closure(roots, modules, parsed.__getitem__, p, lazy, memo=memo)
              for p in prunings for lazy in (True, False)]
    assert shared == alone and memo
    # Each field of the pruning is part of the memo's key.
    base = reach_mod.Pruning(frozenset({"is_hip"}))
    variants = [reach_mod.Pruning(frozenset({"is_npu"})), reach_mod.Pruning(frozenset({"is_hip"}), frozenset({"is_cuda"})),
                reach_mod.Pruning(frozenset({"is_hip"}), other_platform_modules=("sglang.hip",)),
                reach_mod.Pruning(frozenset({"is_hip"}), registries={"r": frozenset({"x"})})]
    assert len({reach_mod._pruning_key(p) for p in [base, *variants]}) == 1 + len(variants)
    assert len(variants) == len(dataclasses.fields(reach_mod.Pruning))


def test_inventory_reach_and_status(built: tuple[dict[str, Path], dict]) -> None:
    _, inventory = built
    sites = inventory["sites"]
    # reached: the model's kernels and the selected registry entry's (a lazy import)
    assert sites["triton:sglang/kernels/toy_kernels.py:toy_kernel"]["profiles"] == ["toy"]
    assert sites["triton:sglang/kernels/triton_attn.py:attn_kernel"]["tier"] == "lazy"
    assert sites["triton:sglang/kernels/toy_kernels.py:toy_kernel"]["tier"] == "startup"
    # not reached: another backend's factory, another platform, TYPE_CHECKING, another model
    for file in ("fa3_attn", "hip_only", "typing_only", "other_kernels"):
        assert f"triton:sglang/kernels/{file}.py:attn_kernel" in inventory["unreached"]
    assert sites["flashinfer:sglang/kernels/toy_kernels.py:flashinfer.norm.rmsnorm"]["status"] == "prebuilt"
    assert sites["flashinfer:kernel_cache:norm"]["status"] == "prebuilt"
    # What the image holds for a prebuilt site: the kernel-cache module (for an API, the one
    # reach.json maps it to).
    assert sites["flashinfer:kernel_cache:norm"]["specializations"]["prebuilt"] == [{"module": "norm"}]
    assert sites["flashinfer:sglang/kernels/toy_kernels.py:flashinfer.norm.rmsnorm"]["specializations"]["prebuilt"] \
        == [{"module": "norm"}]
    toy = sites["triton:sglang/kernels/toy_kernels.py:toy_kernel"]
    assert toy["status"] == "gap" and "autotuned (5 configs" in toy["reason"]
    assert sites["sglang-jit:sglang/kernels/toy_kernels.py:toy_module"]["status"] == "gap"
    spec = inventory["profiles"]["toy"]["specializations"]
    assert spec["tp_size"] == {"value": 8, "from": "profile"}
    assert spec["attention_backend"]["from"] == "jit_cache/reach.json resolved_settings"
    assert spec["page_size"]["value"] is None
    validate_inventory(inventory, "fixture")


def test_every_gap_says_what_a_user_can_do(built: tuple[dict[str, Path], dict]) -> None:
    """A gap's reason names an action: the file that builds it ahead, the cache to keep, a warm-up."""
    _, inventory = built
    gaps = {i: s["reason"] for i, s in inventory["sites"].items() if s["status"] == "gap"}
    assert {s["kind"] for i, s in inventory["sites"].items() if i in gaps} >= {"triton", "sglang-jit", "inductor"}
    for site_id, reason in gaps.items():
        assert any(a in reason for a in ("; add ", "; keep ", "; map ", "; warm up ")), f"{site_id}: {reason}"


def test_a_module_built_ahead_is_prebuilt_with_its_builds(tmp_path: Path) -> None:
    """A load_jit site listed in sglang_modules.json is prebuilt (the image ships the build, which
    the launch-profile check verifies) and records each build's call and args as the image's
    manifest does; other sites and other stacks' entries stay gaps."""
    paths = write_fixture(tmp_path)
    modules = tmp_path / "sglang_modules.json"
    modules.write_text(json.dumps({"stacks": {"toy": [
        {"call": "sglang.kernels.toy_kernels:toy_module", "args": [{"dtype": "bfloat16"}], "why": "the toy model"}]}}))
    out = tmp_path / "inventory.json"
    assert cli.main(inventory_args(paths, out) + ["--sglang-modules", str(modules)]) == 0
    inventory = json.loads(out.read_text())
    site = inventory["sites"]["sglang-jit:sglang/kernels/toy_kernels.py:toy_module"]
    assert site["status"] == "prebuilt"
    assert 'built ahead of time for args [{"dtype": "bfloat16"}]' in site["reason"]
    assert "//image:layer_sglang_jit" in site["reason"]
    assert site["specializations"]["prebuilt"] == [
        {"call": "sglang.kernels.toy_kernels:toy_module", "args": [{"dtype": "bfloat16"}]}]
    assert inventory["counts"]["sglang-jit"]["prebuilt"] == 1
    validate_inventory(inventory, "fixture")
    out2 = tmp_path / "inventory2.json"
    assert cli.main(inventory_args(paths, out2, stack="other") + ["--sglang-modules", str(modules)]) == 0
    other = json.loads(out2.read_text())["sites"]["sglang-jit:sglang/kernels/toy_kernels.py:toy_module"]
    assert other["status"] == "gap" and "built ahead" not in other["reason"]
    assert "prebuilt" not in other["specializations"]


def test_check_refuses_a_new_kernel_naming_it(built: tuple[dict[str, Path], dict], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    paths, inventory = built
    checked_in = tmp_path / "checked_in"
    checked_in.mkdir()
    (checked_in / "inventory.toy.json").write_bytes(review_json(inventory))
    assert cli.main(["check", f"--built=toy={tmp_path / 'inventory.toy.json'}", f"--inventory-dir={checked_in}"]) == 0
    kernels = paths["tree"] / "sglang/kernels/triton_attn.py"
    kernels.write_text(kernels.read_text() + "\n@triton.jit\ndef extra_kernel(x):\n    pass\n")
    grown = tmp_path / "grown.json"
    assert cli.main(inventory_args(paths, grown)) == 0
    capsys.readouterr()
    assert cli.main(["check", f"--built=toy={grown}", f"--inventory-dir={checked_in}"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["jit_cache/inventory.toy.json: new site triton:sglang/kernels/triton_attn.py:extra_kernel "
                     "(sglang/kernels/triton_attn.py, gap) is not in the inventory; run "
                     "`tools/bazel run //jit_cache:update_inventory` and review `git diff jit_cache/`"]


def test_check_names_a_missing_and_a_stale_inventory(built: tuple[dict[str, Path], dict], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    checked_in = tmp_path / "checked_in"
    checked_in.mkdir()
    (checked_in / "inventory.gone.json").write_text("{}")
    assert cli.main(["check", f"--built=toy={tmp_path / 'inventory.toy.json'}", f"--inventory-dir={checked_in}"]) == 1
    err = capsys.readouterr().err
    assert "inventory.toy.json: missing for stack toy" in err
    assert "inventory.gone.json: no stack of the lock has this name" in err


def _one_line(excinfo: pytest.ExceptionInfo[UserError]) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_missing_tree_is_one_line(tmp_path: Path) -> None:
    paths = write_fixture(tmp_path)
    paths["tree"] = tmp_path / "nowhere"
    with pytest.raises(UserError) as e:
        cli.main(inventory_args(paths, tmp_path / "out.json"))
    assert "--tree" in _one_line(e) and "no sglang/__init__.py" in str(e.value)
    assert not (tmp_path / "out.json").exists()


def test_unknown_architecture_is_one_line(tmp_path: Path) -> None:
    profile = json.loads(json.dumps(PROFILE))
    profile["checkpoint"]["config"]["architectures"] = ["NoSuchForCausalLM"]
    paths = write_fixture(tmp_path, profile=profile)
    with pytest.raises(UserError) as e:
        cli.main(inventory_args(paths, tmp_path / "out.json"))
    assert "NoSuchForCausalLM" in _one_line(e) and "reach.json" in str(e.value)


def test_architecture_without_model_module_is_one_line(tmp_path: Path) -> None:
    files = {k: v for k, v in FIXTURE.items() if k != "sglang/srt/models/toy.py"}
    paths = write_fixture(tmp_path, files=files)
    with pytest.raises(UserError) as e:
        cli.main(inventory_args(paths, tmp_path / "out.json"))
    assert "no model module" in _one_line(e)


def test_malformed_inventory_is_one_line(built: tuple[dict[str, Path], dict], tmp_path: Path) -> None:
    checked_in = tmp_path / "checked_in"
    checked_in.mkdir()
    (checked_in / "inventory.toy.json").write_text('{"schema_version": 1, "sites": {"x": {"status": "maybe"}}, "unreached": []}')
    with pytest.raises(UserError) as e:
        cli.main(["check", f"--built=toy={tmp_path / 'inventory.toy.json'}", f"--inventory-dir={checked_in}"])
    assert _one_line(e) == (f"checked-in inventory {checked_in / 'inventory.toy.json'}: $.sites.x.status: expected "
                            '"prebuilt" or "gap", found the string "maybe"; regenerate it with '
                            "`tools/bazel run //jit_cache:update_inventory`")
    (checked_in / "inventory.toy.json").write_text("{not json")
    with pytest.raises(UserError) as e:
        cli.main(["check", f"--built=toy={tmp_path / 'inventory.toy.json'}", f"--inventory-dir={checked_in}"])
    assert _one_line(e).startswith(f"checked-in inventory {checked_in / 'inventory.toy.json'}: invalid JSON at "
                                   "line 1 column 2 (")


def test_duplicate_key_in_reach_is_one_line(tmp_path: Path) -> None:
    paths = write_fixture(tmp_path)
    paths["reach"].write_text('{"entry_modules": [], "entry_modules": []}')
    with pytest.raises(UserError) as e:
        cli.main(inventory_args(paths, tmp_path / "out.json"))
    assert _one_line(e) == (f"--reach {paths['reach']}: $: key 'entry_modules' appears twice in one object (the "
                            "object at line 1); remove one")


@pytest.mark.parametrize("flag", ["--triton-calls", "--sglang-modules"])
def test_an_ahead_of_time_list_of_the_wrong_shape_is_one_line_naming_the_flag_passed(tmp_path: Path, flag: str) -> None:
    """The inventory's --triton-calls / --sglang-modules file whose top level, or whose stack's
    entry, has the wrong type: one line naming the flag as the user passed it (not the build
    commands' --calls / --modules), the file and the JSON path; no inventory written."""
    paths = write_fixture(tmp_path)
    bad, out = tmp_path / "aot.json", tmp_path / "out.json"
    for text, expected in (("[]", "$: expected an object, found a list"),
                           ('{"stacks": {"toy": {}}}', "$.stacks.toy: expected a list, found an object")):
        bad.write_text(text)
        with pytest.raises(UserError) as e:
            cli.main(inventory_args(paths, out) + [flag, str(bad)])
        assert _one_line(e).startswith(f"{flag} {bad}: {expected}; "), str(e.value)
        assert not out.exists()


def test_an_unknown_stack_is_refused_naming_the_known_ones(tmp_path: Path) -> None:
    """An inventory is for a stack of the lock: another name is one line naming it and the
    lock's stacks, and nothing is written."""
    paths = write_fixture(tmp_path)
    out = tmp_path / "out.json"
    with pytest.raises(UserError) as e:
        cli.main(inventory_args(paths, out, stack="UNKNOWN"))
    assert _one_line(e) == (f"--stack UNKNOWN: not a stack of {paths['lock']} (its stacks: other, toy); "
                            "pass one of them")
    assert not out.exists()


def test_the_wheel_hints_spell_the_wheel_flag_as_the_inventory_takes_it(tmp_path: Path) -> None:
    """--wheel takes WHEEL (the stack is --stack): its messages say `--wheel WHEEL`, never STACK=WHEEL."""
    paths = write_fixture(tmp_path)
    wheel = tmp_path / "nowhere.whl"
    args = [a for a in inventory_args(paths, tmp_path / "out.json") if a != str(paths["tree"]) and a != "--tree"]
    with pytest.raises(UserError) as e:
        cli.main(args + ["--wheel", str(wheel)])
    assert _one_line(e).startswith(f"--wheel {wheel}: no such file; "), str(e.value)
    paths["tree"] = tmp_path / "nowhere"
    with pytest.raises(UserError) as e:
        cli.main(inventory_args(paths, tmp_path / "out.json"))
    assert "=" not in _one_line(e) and "--wheel WHEEL" in str(e.value)


def test_checked_in_data_files() -> None:
    reach = load_json_file(REPO_ROOT / "jit_cache" / "reach.json", "reach", REACH)
    validate_reach(reach, "jit_cache/reach.json")
    declared = {m["name"] for m in json.loads((REPO_ROOT / "kernel_cache" / "modules.json").read_text())["modules"]}
    unknown = sorted(set(reach["flashinfer_apis"].values()) - declared)
    assert unknown == [], f"jit_cache/reach.json flashinfer_apis name modules kernel_cache/modules.json lacks: {unknown}"
    facts = load_json_file(REPO_ROOT / "jit_cache" / "checkpoint_facts.json", "facts", CHECKPOINT_FACT_SCHEMA)
    for arch, entry in facts["architectures"].items():
        assert arch in reach["architectures"]
        for name, fact in entry["facts"].items():
            assert set(fact) == {"value", "source"} and fact["source"], (arch, name)


def test_torch_extension_and_helion_sites() -> None:
    source = textwrap.dedent('''
        import helion
        from torch.utils import cpp_extension
        def load_ext(src):
            return cpp_extension.load(name="toy_ext", sources=[src, "toy.cu"])
        @helion.kernel(static_shapes=True)
        def toy_helion(x):
            return x
    ''')
    sites = {s.id: s.details for s in scan_module("e.py", ast.parse(source))}
    assert sites == {"sglang-jit:e.py:load_ext": {"use": "torch-cpp-extension", "ext_name": "'toy_ext'",
                                                   "sources": ["src", "toy.cu"]},
                     "triton:e.py:toy_helion": {"via": "helion"}}


def test_autotune_count_through_a_runtime_choice() -> None:
    source = textwrap.dedent('''
        import triton
        BS = [32, 64] if big() else [16, 32]
        ODD = [1, 2, 3] if big() else [1]
        @triton.autotune(configs=[triton.Config({"BS": b}, num_warps=w) for b in BS for w in [2, 4, 8]], key=["H"])
        @triton.jit
        def same(x):
            pass
        @triton.autotune(configs=[triton.Config({"BS": b}) for b in ODD], key=["H"])
        @triton.jit
        def differs(x):
            pass
    ''')
    sites = {s.name: s.details["autotune"] for s in scan_module("a.py", ast.parse(source))}
    assert sites["same"]["configs"] == 6 and "chosen at import" in sites["same"]["configs_note"]
    assert sites["differs"] == {"configs": None, "key": ["H"]}


def test_compile_id_is_the_build_file_without_its_run_paths() -> None:
    """What lets //jit_cache:sglang_jit_9_0a_gpu_host reuse :sglang_jit_9_0a's compiles: two runs
    of one compile in other sandboxes and scratch directories get one id; another flag, source or
    compiler does not."""
    from tools.jit_cache.sglang_worker import compile_id

    def build_file(root: str, flag: str = "-O3", source: str = "norm.cuh") -> str:
        return (f"nvcc = {root}/scratch/worker/nvcc\ncudaflags = {flag} -I{root}/out/site/sglang "
                f"-Xcompiler=-ffile-prefix-map={root}/cuda=/kimi-k3/cuda\n"
                f"build {root}/scratch/cache/m/a.o: compile_cuda {root}/out/site/sglang/{source}\n")

    def maps(root: str) -> list[tuple[str, str]]:
        # The scratch is inside the output tree here: the longer one must be replaced first.
        return [(f"{root}/out/site", "/usr/local/lib/python3.11/dist-packages"), (f"{root}/cuda", "/kimi-k3/cuda"),
                (f"{root}/scratch", "/kimi-k3/scratch"), (root, "/root-that-must-not-win")]

    one = compile_id(build_file("/a/sandbox/1"), maps("/a/sandbox/1"))
    assert one == compile_id(build_file("/b/other-root/77"), maps("/b/other-root/77"))
    assert one != compile_id(build_file("/a/sandbox/1", flag="-O2"), maps("/a/sandbox/1"))
    assert one != compile_id(build_file("/a/sandbox/1", source="other.cuh"), maps("/a/sandbox/1"))
    assert one != compile_id(build_file("/a/sandbox/1"), maps("/a/sandbox/1")[1:])
    # In linux-sandbox the toolchain is named by its link path and its real root (two prefix
    # maps); staged by a remote worker it has one path (one map): the same compile, one id.
    local = build_file("/a/sandbox/1").replace(
        "-Xcompiler=-ffile-prefix-map=", "-Xcompiler=-ffile-prefix-map=/ob/external/cuda=/kimi-k3/cuda "
        "-Xcompiler=-ffile-prefix-map=")
    assert one == compile_id(local, maps("/a/sandbox/1") + [("/ob/external/cuda", "/kimi-k3/cuda")])


def test_a_reused_cache_must_be_the_same_stack_and_arch_with_compile_ids(tmp_path: Path) -> None:
    from tools.jit_cache.sglang_aot import MANIFEST, load_reused

    module = {"module": "m", "leaf": "sm90a/m/build-k/deps-d", "compile_sha256": "c" * 64}
    (tmp_path / MANIFEST).write_text(json.dumps({"stack": "pypi", "arch": "9.0a", "modules": [module]}))
    assert load_reused(tmp_path, "pypi", "9.0a")["modules"] == [module]
    with pytest.raises(UserError, match=r"built for stack pypi arch 9.0a, not pypi 12.0f"):
        load_reused(tmp_path, "pypi", "12.0f")
    (tmp_path / MANIFEST).write_text(json.dumps({"stack": "pypi", "arch": "9.0a", "modules": [{"module": "m"}]}))
    with pytest.raises(UserError, match=r"carry no compile_sha256 \(built by an older build-sglang\); rebuild it"):
        load_reused(tmp_path, "pypi", "9.0a")
    with pytest.raises(UserError, match=r"--reuse .*: no readable"):
        load_reused(tmp_path / "absent", "pypi", "9.0a")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
