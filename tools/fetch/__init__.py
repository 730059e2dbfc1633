"""Verified fetch: every upstream input comes from the lock, by hash, through one cache.

Takes: the pins lock (tools.pins.lock), mirror directories (--mirror, $KIMI_K3_MIRROR), origin
URLs and git repositories. Gives: verified artifacts (`python3 -m tools.fetch fetch --pin NAME`
prints the path of a CAS entry, or places it at --out), filled mirror directories (`mirror`),
and `git_diff` pins (`add-git-diff`). Nothing unverified ever enters the cache.

Modules: cache (the content-addressed cache, entry locks, eviction), sources (mirror files and
HTTP downloads capped at the lock's size, falling through bad sources), git (git pins and the
canonical diff), place (--out files and trees, whole or not at all), cli (the commands),
debian (the Debian sets' .debs: fetch, mirror, extract, flat repository; the Debian CLI).
Package graph: tools.common <- tools.pins (lock, debian) <- tools.fetch; no tools.pins module
imports this package (the Debian CLI's entry point aside). Stdlib only: this runs inside Bazel
repository rules with a bare interpreter.
Layout and environment (KIMI_K3_CACHE, KIMI_K3_MIRROR) are in docs/DESIGN.md.
"""
