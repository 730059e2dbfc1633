"""Pins: the one lock (third_party/pins.lock.json) and the tools that write it.

Takes: upstream coordinates (PyPI names and versions, git commits). Gives: validated pins
(lock: schema and validation), PyPI pins and stack closures (pypi), the hashed venv locks
(venv_lock). Fetching the bytes is tools.fetch.
"""
