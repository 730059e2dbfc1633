"""No command deletes what it did not write (docs/DESIGN.md "Conventions").

Every directory a tool replaces goes through tools/common/files.py's swap, which replaces only an
absent path, an empty directory or the same tool's previous output (its marker). These tests hold
the list of callers, each with its tool (a marker: its reruns replace its own output) or None (a
tree shipped byte for byte: it carries no marker, so only an empty directory, what Bazel gives an
action, is replaced), and the list of every other tree removal in tools/ with why the tree is
the caller's own. A new caller or removal fails here until it is listed, with its reason.
Behaviour per caller is tested in its stage's tests (a user's directory refused and kept).
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).absolute().parents[3]
TOOLS = REPO_ROOT / "tools"

# (file, function, the directory's expression) -> the tool= expression (None: a shipped tree).
SWAP_CALLERS = {
    ("fetch/debian.py", "extract_set", "out"): "EXTRACT_TOOL",
    ("fetch/debian.py", "local_repository", "out"): "REPOSITORY_TOOL",
    ("fetch/place.py", "extract_tar", "out"): "EXTRACT_TOOL",
    ("gpu_suite/bundle.py", "write_bundle", "out"): "BUNDLE_TOOL",
    ("gpu_suite/host.py", "install_triton", "site"): "HOST_TOOL",
    ("gpu_suite/host.py", "sglang_jit_proof", "cache"): "HOST_TOOL",
    ("gpu_suite/host.py", "triton_proof", "bound"): "HOST_TOOL",
    ("gpu_suite/host.py", "triton_proof", "shipped"): "HOST_TOOL",
    ("gpu_suite/server_bundle.py", "main", "args.out"): "TOOL",
    ("gpu_suite/host.py", "unpack_into", "target"): "HOST_TOOL",
    ("image/layout.py", "build_image", "out"): "None",
    ("image/rootfs.py", "pull_base", "out"): "PULL_TOOL",
    ("image/wheel_install.py", "install_wheels", "out"): "None",
    ("jit_cache/sglang_aot.py", "build_sglang", "out"): "None",
    ("jit_cache/triton_aot.py", "build_triton", "out"): "None",
    ("jit_cache/triton_recorded.py", "build", "out"): "None",
    ("kernel_cache/actions.py", "assemble", "out.absolute()"): "tool",  # None from the CLI, BUILD_TOOL from build
    ("kernel_cache/cli.py", "main", "args.out.absolute()"): "None",
    ("kernel_cache/flashkda.py", "make_tree", "out.absolute()"): "None",
    ("kernel_cache/toolchain.py", "unpack_tvm_ffi", "out"): "None",
    ("kernel_cache/toolchain.py", "write_cuda_stubs", "out"): "None",
    ("patch_gate/gate.py", "run_gate", "out_dir"): "None",
    ("patch_gate/gate.py", "write_remapped", "out.resolve()"): "REMAPPED_TOOL",
    ("rbe/cluster.py", "up", "lay.run"): "RUN_TOOL",
    ("rbe/root.py", "ensure_root", "root"): "ROOT_TOOL",
    ("rbe/root.py", "ensure_venv", "venv"): "VENV_TOOL",
}

# (file, function, the removed tree's expression) -> why that tree is the caller's own.
TREE_REMOVALS = {
    ("common/files.py", "scratch_dir", "path"): "its own mkdtemp, at exit",
    ("common/files.py", "sweep_dead_scratch", "path"): "a scratch_dir of its prefix holding the owner lock file that no live process holds (a killed earlier run's)",
    ("bench/kernel_cache.py", "main", "run"): "the bench's own mkdtemp under --work",
    ("bench/remote_cache.py", "Nginx.start", "self.dir / 'store' / 'probe'"): "its probe blob in its own nginx store",
    ("bench/remote_cache.py", "main", "work"): "its own mkdtemp (kept with --keep)",
    ("bench/remote_cache.py", "rmtree", "path"): "the helper main uses on its own mkdtemp",
    ("common/files.py", "dir_replaced_atomically", "tmp"): "its own temp sibling",
    ("common/files.py", "replace_dir", "garbage"): "the previous output after the swap (checked replaceable)",
    ("fetch/git.py", "new_repo", "tmp"): "its own temp repository (a mkdtemp beside dest), removed when filling it failed",
    ("image/rootfs.py", "host_python_rootfs", "tmp"): "its own temp sibling",
    ("image/rootfs.py", "pull_base", "tmp"): "its own temp sibling (a failed pull, or after the swap)",
    ("image/launch_profile_check.py", "check_launch_profiles", "work"): "its scratch folder inside the root it unpacked",
    ("image/smoke.py", "smoke", "bundle.parent"): "its own mkdtemp",
    ("image/triton_driver_check.py", "check_triton_driver", "work"): "its scratch folder inside the root it unpacked",
    ("image/verify.py", "check_signature_and_blobs", "work"): "its own mkdtemp",
    ("image/wheel_install.py", "install_wheels", "stages"): "its own temp sibling",
    ("jit_cache/sglang_aot.py", "merge_site_trees.merge", "d"): "a folder of the site it is merging",
    ("jit_cache/triton_aot.py", "fix_source_mtimes", "top"): "a merged folder of links in its own site",
    ("jit_cache/triton_aot.py", "fixed_root", "FIXED_ROOT"): "the fixed build root, under its lock",
    ("kernel_cache/build.py", "build", "run_dir"): "its own mkdtemp in the cache's gen/",
    ("kernel_cache/cli.py", "main", "tmp"): "its own temp sibling",
    ("kernel_cache/flashkda.py", "cmd_wheel", "work"): "its own mkdtemp beside --out",
    ("kernel_cache/probe.py", "run_probe", "work"): "its own mkdtemp",
    ("patch_gate/gate.py", "run_gate", "scratch"): "its own mkdtemp",
    ("rbe/root.py", "ensure_root", "scratch"): "its own mkdtemp (the set's local repository)",
    ("rbe/supervisor.py", "Supervisor.casd", "old"): "a store an earlier layout of the cluster's own data directory wrote (BuildGrid's disk CAS, a casd cache per worker; Layout.superseded names only those)",
}


def _calls(names: set[str]) -> dict[tuple[str, str, str], list[str]]:
    """(file, enclosing function, first argument) -> the tool= expressions of calls to `names`."""
    found: dict[tuple[str, str, str], list[str]] = {}
    for path in sorted(TOOLS.rglob("*.py")):
        rel = str(path.relative_to(TOOLS))

        def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                scope = (*scope, node.name)
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
                # The directory replaced or removed: replace_dir's is its second argument.
                where = 1 if name == "replace_dir" else 0
                if name in names and len(node.args) > where:
                    tool = [ast.unparse(k.value) for k in node.keywords if k.arg == "tool"]
                    key = (rel, ".".join(scope), ast.unparse(node.args[where]))
                    found.setdefault(key, []).append(tool[0] if tool else "<no tool=>")
            for child in ast.iter_child_nodes(node):
                visit(child, scope)
        visit(ast.parse(path.read_text(), str(path)), ())
    return found


def test_every_directory_swap_is_listed_with_its_tool() -> None:
    found = {k: v for k, v in _calls({"dir_replaced_atomically", "replace_dir"}).items()
             if k[0] != "common/files.py"}
    got = {k: tools[0] for k, tools in found.items() if len(set(tools)) == 1}
    assert got == SWAP_CALLERS, ("a directory swap not listed, or with another tool: list it in "
                                 "SWAP_CALLERS with its tool (None only for a tree shipped byte for byte)")


def test_every_other_tree_removal_says_why_the_tree_is_its_own() -> None:
    found = set(_calls({"rmtree"}))
    assert found == set(TREE_REMOVALS), (
        f"unlisted: {sorted(found - set(TREE_REMOVALS))}; gone: {sorted(set(TREE_REMOVALS) - found)}; "
        "remove only what this run created (a mkdtemp, a temp sibling) or go through "
        "tools/common/files.py's swap")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
