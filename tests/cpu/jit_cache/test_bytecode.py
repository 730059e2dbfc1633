"""The image's Python bytecode for builds and tests (tools/jit_cache/bytecode_tree.py, bytecode.py,
bytecode_worker.py), on a fixture root with this test's own python3 as the image's: the worker
writes checked-hash files by image path for what the import reached, a python3 pointed at them
(PYTHONPYCACHEPREFIX through link_prefix) loads them, and a source changed since is compiled from
source, never taken from the stale file; a module that fails to import is named."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.common.errors import UserError
from tools.jit_cache import bytecode, bytecode_tree

WORKER = Path(bytecode.__file__).with_name("bytecode_worker.py")
SITE_REL = "usr/local/lib/python3/dist-packages"


def _root(tmp_path: Path) -> Path:
    """A scratch root with a site-packages of two modules, one importing the other."""
    root = tmp_path / "root"
    pkg = root / SITE_REL / "fixturepkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "helper.py").write_text("VALUE = 'compiled'\n")
    (pkg / "entry.py").write_text("from fixturepkg.helper import VALUE\nWORDS = {'a', 'b', 'c'}\n")
    return root


def _env(root: Path, **extra: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root / SITE_REL), "PYTHONNOUSERSITE": "1",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0", **extra}


def _run_worker(root: Path, out: Path, modules: list[str]) -> dict[str, object]:
    request = root.parent / "request.json"
    result = root.parent / "result.json"
    request.write_text(json.dumps({"modules": modules, "root": str(root), "out": str(out), "result": str(result)}))
    proc = subprocess.run([sys.executable, str(WORKER), str(request)], env=_env(root), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return json.loads(result.read_text())


def _tree(tmp_path: Path, root: Path) -> Path:
    tree = tmp_path / "bytecode"
    prefix = tree / bytecode_tree.PREFIX
    prefix.mkdir(parents=True)
    assert _run_worker(root, prefix, ["fixturepkg.entry"]) == {"failed": [], "compiled": 3}
    (prefix / bytecode_tree.MARKER).write_text("{}")
    return tree


def test_checked_hash_files_by_image_path_for_what_the_import_reached(tmp_path: Path) -> None:
    root = _root(tmp_path)
    tree = _tree(tmp_path, root)
    tag = sys.implementation.cache_tag
    pyc = tree / bytecode_tree.PREFIX / SITE_REL / "fixturepkg" / f"helper.{tag}.pyc"
    data = pyc.read_bytes()
    assert data[:4] == importlib.util.MAGIC_NUMBER
    assert int.from_bytes(data[4:8], "little") == 0b11  # hash-based, checked
    source = (root / SITE_REL / "fixturepkg" / "helper.py").read_bytes()
    assert data[8:16] == importlib.util.source_hash(source)
    import marshal
    assert marshal.loads(data[16:]).co_filename == f"/{SITE_REL}/fixturepkg/helper.py"
    # The same request writes the same bytes (the tree is an action's output).
    again = tmp_path / "again"
    again.mkdir()
    _run_worker(root, again, ["fixturepkg.entry"])
    assert (again / SITE_REL / "fixturepkg" / f"helper.{tag}.pyc").read_bytes() == data


def test_a_python_pointed_at_the_tree_loads_it_and_never_a_stale_file(tmp_path: Path) -> None:
    root = _root(tmp_path)
    tree = _tree(tmp_path, root)
    assert bytecode_tree.split_trees([root, tree]) == ([root], [tree])
    prefix = bytecode_tree.link_prefix(tree, tmp_path / "pycache", root)

    def run() -> tuple[str, str]:
        proc = subprocess.run([sys.executable, "-v", "-c", "import fixturepkg.entry as e; print(e.VALUE)"],
                              env=_env(root, PYTHONPYCACHEPREFIX=prefix), capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip(), proc.stderr

    value, log = run()
    assert value == "compiled"
    assert f"helper.{sys.implementation.cache_tag}.pyc matches" in log
    # The source changed after the tree was written (a check's mutated tree): compiled from source.
    (root / SITE_REL / "fixturepkg" / "helper.py").write_text("VALUE = 'changed since'\n")
    value, log = run()
    assert value == "changed since"
    assert f"helper.{sys.implementation.cache_tag}.pyc matches" not in log


def test_the_chroot_env_names_the_prefix_only_with_a_bytecode_tree(tmp_path: Path) -> None:
    root = _root(tmp_path)
    assert bytecode_tree.chroot_env([root]) == []
    tree = _tree(tmp_path, root)
    assert bytecode_tree.chroot_env([root, tree]) == [f"PYTHONPYCACHEPREFIX=/{bytecode_tree.PREFIX}"]


def test_a_module_that_fails_to_import_is_named_and_nothing_is_written(tmp_path: Path) -> None:
    root = _root(tmp_path)
    (root / SITE_REL / "fixturepkg" / "broken.py").write_text("raise ImportError('no libcuda here')\n")
    out = tmp_path / "out"
    out.mkdir()
    result = _run_worker(root, out, ["fixturepkg.entry", "fixturepkg.broken"])
    assert result == {"failed": [["fixturepkg.broken", "ImportError: no libcuda here"]], "compiled": 0}
    assert not any(out.iterdir())


def test_no_module_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="--module: none given"):
        bytecode.build_bytecode("pypi", "12.0f", [], tmp_path / "base.tar", [tmp_path], "/" + SITE_REL,
                                tmp_path / "out")
    assert not (tmp_path / "out").exists()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
