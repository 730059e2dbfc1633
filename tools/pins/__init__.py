"""Pins: the one lock (third_party/pins.lock.json) and the tools that write it.

Takes: upstream coordinates (PyPI names and versions, git commits). Gives: validated pins
(lock: schema, validation and the public loader `lock.load`), wheel pins and stack closures
(pypi: `python3 -m tools.pins.pypi add-pypi NAME==VERSION` and `lock-closure --stack S`), the
Debian package sets (debian: third_party/debian.lock.json, `python3 -m tools.fetch.debian`), the
hashed venv locks (venv_lock: `python3.11 -m tools.pins.venv_lock`), and the module extensions
that make the lock into Bazel repositories (extensions.bzl; internals in private/).

Package graph (imports point one way only; the stage order is in docs/DESIGN.md):

    tools.common  <-  tools.pins.lock  <-  tools.pins.pypi    (index metadata and pip only)
                                       <-  tools.pins.debian  (the Debian lock and its resolver)
    tools.common  <-  tools.pins.venv_lock

Nothing here imports a later stage: the .debs of a Debian set are fetched, mirrored, unpacked and
laid out as a repository by tools.fetch.debian, which is also the Debian CLI (`python3 -m
tools.fetch.debian`: this package's lock commands and the fetch stage's). The PyPI tools need only
what an index publishes (sha256, size, PEP 658 metadata) or what pip reads itself.
"""
