"""The pins stage's module extensions, as MODULE.bazel uses them.

  pins         one lazily fetched, verified repository per pin of the lock, and the hub @pins
  python_venv  the Python toolchain for tools and tests: a venv built from a hashed lock

Implementations: tools/pins/private/pins.bzl and tools/pins/private/python_venv.bzl.
"""

load("//tools/pins/private:pins.bzl", _pins = "pins")
load("//tools/pins/private:python_venv.bzl", _python_venv = "python_venv")

pins = _pins
python_venv = _python_venv
