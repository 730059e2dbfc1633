"""Pins: the one lock (third_party/pins.lock.json) and the tools that write it.

Takes: upstream coordinates (PyPI names and versions, git commits). Gives: validated pins
(lock: schema, validation and the public loader `lock.load`), wheel pins and stack closures
(pypi: `python3 -m tools.pins.pypi add-pypi NAME==VERSION` and `lock-closure --stack S`), the
Debian package sets (debian: third_party/debian.lock.json, `python3 -m tools.pins.debian`), the
hashed venv locks (venv_lock: `python3.11 -m tools.pins.venv_lock`), and the module extensions
that make the lock into Bazel repositories (extensions.bzl; internals in private/).

Package graph (imports point one way only):

    tools.common  <-  tools.pins.lock  <-  tools.fetch        (verified bytes, add-git-diff)
                                       <-  tools.pins.pypi    (index metadata and pip only)
                                       <-  tools.fetch  <-  tools.pins.debian  (.debs through the fetcher)
    tools.common  <-  tools.pins.venv_lock

Only tools.pins.debian imports tools.fetch (it sits above it: its .debs are fetched, mirrored and
unpacked, not only resolved); the PyPI tools need only what an index publishes (sha256, size,
PEP 658 metadata) or what pip reads itself.
"""
