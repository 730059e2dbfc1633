"""Runs under the image's python3.11 (tools/jit_cache/bytecode.py starts it; stdlib only): imports
the requested modules and keeps the code object the import compiled from each source under the
image's root (its standard library and site-packages), then writes each as checked-hash (PEP 552)
bytecode, laid out as PYTHONPYCACHEPREFIX reads it: <out>/<image path of the source's
directory>/<name>.<tag>.pyc.

Compiled here, by the image's own interpreter, because marshal output belongs to the compiling
interpreter; the import's own compile is kept (its code objects, with the image's path of the
source as their file name, what py_compile's dfile gives) rather than compiling every file a
second time. Checked-hash, because the trees' files carry no fixed mtime (a timestamp .pyc would
not match) and because a checked file is validated against its source's bytes at every import.

Request (JSON): modules, root (the scratch root the interpreter runs from, as sys.path holds it),
out, result. Result (JSON): compiled (count), failed ([module, error]).
"""
import importlib
import importlib.util
import json
import os
import sys
import traceback
import types


def capture_compiles(root):
    """{source path: (source bytes, code)} of every module the import system compiles from a
    source under root from now on."""
    from importlib import _bootstrap_external

    compiled = {}
    original = _bootstrap_external.SourceLoader.source_to_code

    def source_to_code(self, data, path, *, _optimize=-1):
        code = original(self, data, path, _optimize=_optimize)
        if isinstance(path, str) and path.endswith(".py") and path.startswith(root + os.sep):
            compiled[path] = (bytes(data), code)
        return code

    _bootstrap_external.SourceLoader.source_to_code = source_to_code
    return compiled


def retitled(code, filename):
    """code and every code object among its constants with co_filename `filename`."""
    consts = tuple(retitled(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def add_earlier_imports(compiled, root):
    """The modules under root imported before capture_compiles (interpreter start-up: encodings,
    sitecustomize, .pth hooks), compiled from their sources as the import system compiles them."""
    for module in list(sys.modules.values()):
        spec = getattr(module, "__spec__", None)
        origin = getattr(spec, "origin", None)
        if (isinstance(origin, str) and origin.endswith(".py") and origin.startswith(root + os.sep)
                and origin not in compiled):
            with open(origin, "rb") as f:
                data = f.read()
            compiled[origin] = (data, compile(data, origin, "exec", dont_inherit=True))


def write_bytecode(compiled, root, out):
    from importlib import _bootstrap_external

    tag = sys.implementation.cache_tag
    for source in sorted(compiled):
        data, code = compiled[source]
        rel = os.path.relpath(source, root)
        directory, name = os.path.split(rel)
        pyc = _bootstrap_external._code_to_hash_pyc(retitled(code, "/" + rel), importlib.util.source_hash(data), True)
        os.makedirs(os.path.join(out, directory), exist_ok=True)
        with open(os.path.join(out, directory, name[:-3] + "." + tag + ".pyc"), "wb") as f:
            f.write(pyc)
    return len(compiled)


def main(request_path):
    with open(request_path) as f:
        request = json.load(f)
    compiled = capture_compiles(request["root"])
    failed = []
    for name in request["modules"]:
        try:
            importlib.import_module(name)
        except BaseException as e:  # a module's import may raise anything; each is named
            said = str(e).splitlines()
            failed.append([name, type(e).__name__ + (": " + said[0] if said else "")])
            traceback.print_exc()
    result = {"failed": failed, "compiled": 0}
    if not failed:
        add_earlier_imports(compiled, request["root"])
        result["compiled"] = write_bytecode(compiled, request["root"], request["out"])
    with open(request["result"], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
