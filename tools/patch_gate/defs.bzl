"""Thin Bazel rules over tools/patch_gate (all logic is in the Python tool; internals in private/).

stack_patch_gate: the targets of one patches folder (flashinfer_patches/, sglang_patches/) for the
    selected stack: the gate, its drift-checked tree, manifest, table, :update_manifest, :check.
patched_wheel: a checked tree repacked as a `<version>+kimik3.<digest>` wheel.
patched_tree: the gate's `apply` as one action (fails on a conflict or bad input, not on drift).
checked_tree: a patched_tree plus the drift check against the committed manifest, as a
    validation action: every consumer of the tree fails on drift.
"""

load("//tools/patch_gate/private:checked_tree.bzl", _checked_tree = "checked_tree")
load("//tools/patch_gate/private:patched_tree.bzl", _patched_tree = "patched_tree")
load("//tools/patch_gate/private:patched_wheel.bzl", _patched_wheel = "patched_wheel")
load("//tools/patch_gate/private:stack_patch_gate.bzl", _stack_patch_gate = "stack_patch_gate")

checked_tree = _checked_tree
patched_tree = _patched_tree
patched_wheel = _patched_wheel
stack_patch_gate = _stack_patch_gate
