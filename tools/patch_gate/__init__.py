"""The patch gate: check every patch of a series against a wheel tree, remap, apply atomically.

Takes: a series (`pin:<lock pin>` / `file:<patch next to the series>` entries, in order), the
pinned wheel it patches (or an unpacked wheel directory), a wheel_layout.json, the fetched pin
files and the lock (third_party/pins.lock.json) their sha256 are checked against.
Gives: the patched tree (whole, or not at all), the manifest of changed files (sha256 before and
after, each patch's state), the table of states (applies / already upstream / excluded /
conflicts, hunk offsets), the wheel-layout patches for review, and the tree repacked as a
`<version>+kimik3.<digest>` wheel.

Pipeline per target:
  1. read the series (series.py);
  2. remap each patch from the upstream source layout to the wheel layout with the declared
     rules of a wheel_layout.json (remap.py; files absent from the wheel are excluded and
     reported, a path no rule covers is an error; patch.py parses and checks the patch text);
  3. in a scratch copy, for patch N with 1..N-1 already applied: `git apply --check` forward and
     in reverse -> `applies` / `already upstream` / `conflicts` (file and hunk named, gitapply.py),
     then apply (gate.py);
  4. only if no patch conflicts: verify every untouched file against the wheel's RECORD, write
     the manifest of changed files (manifest.py), and rename the scratch tree onto the output in
     one step.

Subcommands (cli.py): apply, check, update-manifest, check-manifest, install-manifest, remap,
repack-wheel (wheel.py); see `python3 -m tools.patch_gate --help` and flashinfer_patches/README.md.
`python3 -m tools.patch_gate.version_coherence` refuses incoherent FlashInfer package sets.
Exit codes: 0 ok, 1 conflict or manifest drift, 2 bad input (a malformed patch included).
"""
