"""The inventory of first-use compiles (issue #27): what serving would compile the first time it
runs, per stack, and which of it the image already ships built.

Takes: a stack's SGLang tree (the patch gate's patched tree the image ships, or the pinned wheel,
gated here), the launch profiles (image/profiles/*.json), jit_cache/reach.json (roots, pruning,
resolved settings, FlashInfer APIs -> kernel-cache modules), jit_cache/checkpoint_facts.json,
image/backend_needs.json and the stack's kernel-cache plan. Gives: jit_cache/inventory.<stack>.json,
every compile site of the tree (kinds flashinfer, sglang-jit, cute-dsl, triton, inductor) with a
stable id, and for each one a profile reaches: its file and kernel or module, its
specializations, `prebuilt` or `gap` and the reason. Nothing from the tree is imported or run:
the sites and the reach come from reading its AST (jit_cache/README.md says what that misses).

Modules: sites (one module's compile sites), reach (the import closure and its pruning), tree
(the source tree, the gate for a wheel), inventory (one stack's inventory, the comparison), cli
(`python3 -m tools.jit_cache inventory|check|install`).

What a real server compiles (issue #38): first_use_hooks (run inside every process of the server
through first_use_site/sitecustomize.py: each first-use compile recorded, or in verify mode any
compile after ready failed by name) and recording (`python3 -m tools.jit_cache.recording
merge|check`: the per-process records merged into jit_cache/recordings/<stack>.<arch>.json).
"""
