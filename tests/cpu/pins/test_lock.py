"""tools/pins/lock.py: the lock's schema and validation (whole-value patterns, unreadable locks).

`tools.pins.lock.load` is the public validated loader; the fetch CLI's `verify` refuses what it refuses.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).absolute().parents[3]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tools.common.errors import UserError  # noqa: E402
from tools.fetch import cli as fetch_cli  # noqa: E402
from tools.pins import lock as lockfile  # noqa: E402


# ---------------------------------------------------------------------------------------------
# validation: whole-value patterns, unreadable locks


def schema_lock(tmp_path: Path, pins: dict[str, Any], stacks: dict[str, Any] | None = None) -> Path:
    path = tmp_path / "pins.lock.json"
    path.write_text(json.dumps({"schema_version": 1, "pins": pins, "stacks": stacks or {}}))
    return path


def a_file_pin(**override: Any) -> dict[str, Any]:
    return {"kind": "file", "filename": "a.whl", "urls": ["https://example.com/a.whl"], "sha256": "a" * 64,
            "size": 1, **override}


def a_diff_pin(**override: Any) -> dict[str, Any]:
    return {"kind": "git_diff", "repository": "https://h/o/r", "commit": "1" * 40, "commit_tree": "2" * 40,
            "parent": "3" * 40, "parent_tree": "4" * 40, "filename": "g.diff", "sha256": "b" * 64, **override}


@pytest.mark.parametrize(("pins", "stacks", "expected"), [
    ({"a": a_file_pin(sha256="a" * 64 + "\n")}, {}, "pin 'a': sha256 must be 64 lowercase hex chars"),
    ({"a": a_file_pin(filename="a.whl\n")}, {}, "pin 'a': filename must be a plain file name"),
    ({"a\n": a_file_pin()}, {}, "pin name 'a\\n' must match"),
    ({"g": a_diff_pin(commit="1" * 40 + "\n")}, {}, "pin 'g': commit must be a full 40-char lowercase hex"),
    ({"a": a_file_pin()}, {"s": {"sglang": "a", "closure_overrides": ["x==1\n"]}},
     "stack 's': closure_overrides must hold NAME==VERSION requirements"),
])
def test_patterns_match_the_whole_value_not_a_trailing_newline(tmp_path: Path, pins: dict[str, Any],
                                                               stacks: dict[str, Any], expected: str) -> None:
    lock = schema_lock(tmp_path, pins, stacks)
    with pytest.raises(UserError) as e:
        lockfile.load(lock)
    message = str(e.value)
    assert "\n" not in message and message.startswith(str(lock)) and expected in message, message
    with pytest.raises(UserError):  # `verify` refuses it too, instead of passing a lock that can never fetch
        fetch_cli.main(["verify", "--lock", str(lock)])


def test_a_file_pin_needs_its_size(tmp_path: Path) -> None:
    """The size caps every read of a source: a file pin without one is refused at load, on one
    line naming the lock and the pin (every pin of the project's locks has one)."""
    pin = a_file_pin()
    del pin["size"]
    lock = schema_lock(tmp_path, {"a": pin})
    with pytest.raises(UserError) as e:
        lockfile.load(lock)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{lock}: pin 'a': size is missing"), message
    proc = subprocess.run([sys.executable, "-m", "tools.fetch", "verify", "--lock", str(lock)],
                          capture_output=True, text=True, cwd=REPO_ROOT)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "size is missing" in proc.stderr, proc.stderr
    lockfile.load(lockfile.DEFAULT_LOCK)  # loads: every file pin of the project's lock has its size


def test_is_sha256_is_exact() -> None:
    assert lockfile.is_sha256("0123456789abcdef" * 4)
    for bad in ("a" * 64 + "\n", "A" * 64, "a" * 63, "a" * 65, "../" + "a" * 61, ""):
        assert not lockfile.is_sha256(bad), bad


def test_unreadable_lock_is_a_one_line_error(tmp_path: Path) -> None:
    latin1 = tmp_path / "latin1.json"
    latin1.write_bytes('{"schema_version": 1, "pins": {}, "stacks": {"s": {"description": "caf\u00e9"}}}'
                       .encode("latin-1"))
    with pytest.raises(UserError) as e:
        lockfile.load(latin1)
    message = str(e.value)
    assert "\n" not in message and message.startswith(str(latin1)) and "is not UTF-8 text (byte 0xe9" in message
    with pytest.raises(UserError, match="is a directory, not a lock file"):
        lockfile.load(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "tools.fetch", "verify", "--lock", str(latin1)],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr


def test_toolchains_name_file_pins_of_the_lock(tmp_path: Path) -> None:
    """A toolchain (the kernel stage's CUDA root) is made of file pins of the same lock: an
    unknown name, a git pin, an empty list or an unknown field is a one-line error naming it."""
    pins = {"a": a_file_pin(), "g": a_diff_pin()}

    def load(toolchains: dict[str, Any]) -> lockfile.Lock:
        path = tmp_path / "pins.lock.json"
        path.write_text(json.dumps({"schema_version": 1, "pins": pins, "stacks": {},
                                    "toolchains": toolchains}))
        return lockfile.load(path)

    lock = load({"cuda": {"release": "13.0", "pins": ["a"]}})
    assert lock.toolchain("cuda").pins == ("a",) and lock.toolchain("cuda").release == "13.0"
    with pytest.raises(UserError, match=r"toolchain 'nope' is not in the lock; toolchains: cuda"):
        lock.toolchain("nope")
    for bad, expected in [
        ({"release": "13.0", "pins": ["b"]}, "toolchain 'cuda': pins names unknown pin 'b'"),
        ({"release": "13.0", "pins": ["g"]}, "names 'g', a git_diff pin; a toolchain is made of file pins"),
        ({"release": "13.0", "pins": []}, "toolchain 'cuda': pins must name at least one pin"),
        ({"release": "13.0", "pins": ["a"], "pin": []}, "field 'pin' is not part of the schema"),
        ({"pins": ["a"]}, "toolchain 'cuda': release"),
    ]:
        with pytest.raises(UserError) as e:
            load({"cuda": bad})
        assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)
    # The canonical writer keeps the section (a lock rewrite must not drop the toolchain).
    data = {"schema_version": 1, "pins": pins, "stacks": {},
            "toolchains": {"cuda": {"pins": ["a"], "release": "13.0", "description": "d"}}}
    assert '"toolchains"' in lockfile.canonical_text(data)
    assert lockfile.parse_lock(tmp_path / "x", json.loads(lockfile.canonical_text(data))).toolchains


# ---------------------------------------------------------------------------------------------
# git_tree `paths`: the directories a pin's archive holds, each with its tree id (what a fetch
# checks against the commit: tests/cpu/fetch/test_git_tree_paths.py)


def a_paths_pin(paths: Any) -> dict[str, Any]:
    return {"kind": "git_tree", "repository": "https://h/o/cutlass", "commit": "1" * 40, "tree": "2" * 40,
            "paths": paths, "filename": "c.tar", "sha256": "c" * 64}


TREE = "3" * 40


@pytest.mark.parametrize(("paths", "expected"), [
    ({"../include": TREE}, "paths '../include' leaves the tree ('..'): name a directory inside the repository"),
    ({"include/../x": TREE}, "paths 'include/../x' leaves the tree ('..')"),
    ({"include": TREE, "examples/common": TREE}, "paths are not sorted: list them as 'examples/common', 'include'"),
    ({"/include": TREE}, "paths '/include' is absolute: name it relative to the repository root ('include')"),
    ({"include/": TREE}, "paths 'include/' is not normalized (an empty or '.' part): write 'include'"),
    ({"./include": TREE}, "paths './include' is not normalized (an empty or '.' part): write 'include'"),
    ({"tools//util": TREE}, "paths 'tools//util' is not normalized (an empty or '.' part): write 'tools/util'"),
    ({"": TREE}, "paths holds an empty path: name a directory (the whole tree is the pin without paths)"),
    ({"inc\nlude": TREE}, "paths 'inc\\nlude' holds a control character"),
    ({"include": TREE, "include/cute": TREE},
     "paths 'include/cute' lies inside 'include', which holds it already: drop 'include/cute'"),
    (["include"], "paths must be a non-empty object mapping each directory to its tree id"),
    ({}, "paths must be a non-empty object mapping each directory to its tree id"),
    ({"include": "3" * 39}, "paths['include'] must be the directory's full 40-char lowercase hex tree id"),
])
def test_bad_paths_are_refused_on_load_naming_the_pin(tmp_path: Path, paths: Any, expected: str) -> None:
    lock = schema_lock(tmp_path, {"cutlass": a_paths_pin(paths)})
    with pytest.raises(UserError) as e:
        lockfile.load(lock)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{lock}: pin 'cutlass': "), message
    assert expected in message, message
    with pytest.raises(UserError):  # `verify` refuses it too
        fetch_cli.main(["verify", "--lock", str(lock)])


def test_a_path_listed_twice_is_refused_on_load(tmp_path: Path) -> None:
    # A JSON object may name a key twice (the last would win); the lock's reader refuses it.
    lock = tmp_path / "pins.lock.json"
    text = json.dumps({"schema_version": 1, "pins": {"cutlass": a_paths_pin({"include": TREE})}, "stacks": {}})
    lock.write_text(text.replace(f'"include": "{TREE}"', f'"include": "{TREE}", "include": "{TREE}"'))
    with pytest.raises(UserError) as e:
        lockfile.load(lock)
    message = str(e.value)
    assert "\n" not in message and "cutlass" in message and "include" in message, message


def test_paths_load_and_write_canonically_after_the_tree(tmp_path: Path) -> None:
    paths = {"examples/common": "4" * 40, "include": "5" * 40, "tools/util/include": "6" * 40}
    lock = schema_lock(tmp_path, {"cutlass": a_paths_pin(paths)})
    pin = lockfile.load(lock).pin("cutlass")
    assert isinstance(pin, lockfile.GitTreePin) and list(pin.paths.items()) == list(paths.items())
    text = lockfile.canonical_text(json.loads(lock.read_text()))
    assert list(json.loads(text)["pins"]["cutlass"]) == ["kind", "filename", "repository", "commit", "tree", "paths",
                                                         "sha256"]
    assert lockfile.canonical_text(json.loads(text)) == text
    without = {k: v for k, v in a_paths_pin(paths).items() if k != "paths"}
    assert lockfile.load(schema_lock(tmp_path, {"whole": without})).pin("whole").paths == {}


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
