"""The pins stage's module extensions, as MODULE.bazel uses them.

  pins         one lazily fetched, verified repository per pin of the lock, and the hub @pins
  debian       one repository per Debian set of third_party/debian.lock.json: its verified .debs
               as a flat apt repository (@debian_<set>//:repo)
  python_venv  the Python toolchain for tools and tests: a venv built from a hashed lock

Implementations: tools/pins/private/pins.bzl and tools/pins/private/python_venv.bzl.
"""

load("//tools/pins/private:pins.bzl", _debian = "debian", _pins = "pins")
load("//tools/pins/private:python_venv.bzl", _python_venv = "python_venv")

debian = _debian
pins = _pins
python_venv = _python_venv
