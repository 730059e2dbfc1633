"""Installs the first-use compile recorder (../first_use_hooks.py) in every Python process that
starts with this directory first on PYTHONPATH: SGLang spawns its scheduler, detokenizer and
workers as fresh interpreters (multiprocessing spawn), and each imports sitecustomize at start.
Only this file lives here, so nothing else on PYTHONPATH is shadowed; the hooks are loaded by
path under the name `kimi_k3_first_use_hooks`. A sitecustomize this one shadows (Debian's, a
venv's) is run after it, so the interpreter is otherwise set up as it would have been."""
import importlib.util
import os
import sys


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _run_shadowed(here):
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            _load("_kimi_k3_shadowed_sitecustomize", candidate)
            return


_here = os.path.dirname(os.path.abspath(__file__))
_load("kimi_k3_first_use_hooks", os.path.join(os.path.dirname(_here), "first_use_hooks.py")).install()
_run_shadowed(_here)
