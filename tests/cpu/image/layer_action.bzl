"""What the layer analysis tests share: the one layer-writing action of the target under test."""

load("@bazel_skylib//lib:unittest.bzl", "analysistest", "asserts")

def layer_action(env):
    """The target's OciLayer action, or None (a failed assertion) when it has not exactly one."""
    actions = [a for a in analysistest.target_actions(env) if a.mnemonic == "OciLayer"]
    asserts.equals(env, 1, len(actions), "OciLayer actions of the target under test")
    return actions[0] if len(actions) == 1 else None
