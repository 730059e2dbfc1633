"""FlashInfer JIT modules compiled ahead of time from the patched tree (the SM120 kernel cache).

Takes: the patch gate's patched FlashInfer tree, kernel_cache/modules.json (which modules, with
which generator arguments), an arch list (12.0f, 9.0a) and a variant (full, lean), and the pinned
toolchain (the lock's CUDA 13.0 wheels, bookworm's g++-12 userland from pinned .debs, the stack's
tvm-ffi; a local CUDA only by request). Gives: the AOT layout
flashinfer/data/aot/<module>/<module>.so + kernel_cache.json (what the image ships), built with
FlashInfer's own commands, byte-identical on any host for the same inputs.

FlashInfer describes each JIT module as a JitSpec whose ninja file lists one compile command per
object plus one link command. This stage asks FlashInfer's own generators (run from the patched
tree, in a subprocess) for that ninja text, parses it, and turns it into a *plan*: per module, per
object, the exact compiler argv with every machine-specific absolute path replaced by a
placeholder. The plan is checked in (kernel_cache/plan_<arch>_<variant>.bzl, like a lock) so
Bazel knows every object at analysis time and runs one cached action per object
(tools/kernel_cache/defs.bzl).

Modules: tree (digests, the tree), modules (modules.json, arch lists), toolchain, probe (the
generators' subprocess), plan (ninja -> plan, the plan file, drift), actions (one object, one
link, assemble, spec files), build (the non-Bazel build), verify, cli (`python3 -m
tools.kernel_cache`), plans (the checked-in plans as a set: their recorded inputs checked,
every one regenerated from its stack's patch-gate tree; `python3 -m tools.kernel_cache.plans`).
"""
