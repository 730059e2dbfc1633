"""entrypoint_layer_test: analysis test of the image's entrypoint layer (nothing is built)."""

load("@bazel_skylib//lib:unittest.bzl", "analysistest", "asserts")
load(":layer_action.bzl", "layer_action")

def _entrypoint_layer_test_impl(ctx):
    env = analysistest.begin(ctx)
    action = layer_action(env)
    if action:
        argv = action.argv
        asserts.true(env, "-m tools.image.entrypoint_layer " in " ".join(argv),
                     "the layer action must check the launch profiles (tools.image.entrypoint_layer): %s" % argv)
        checked = sorted([argv[i + 1] for i in range(len(argv) - 1) if argv[i] == "--profile"])
        asserts.equals(env, sorted([f.path for f in ctx.files.expected_profiles]), checked,
                       "profiles the action checks and ships")
        for flag in ("--entrypoint", "--needs", "--selections", "--lock"):
            asserts.true(env, flag in argv, "the check takes %s: %s" % (flag, argv))
    return analysistest.end(env)

# The entrypoint layer's action checks every profile it ships, with the entrypoint's own guard,
# so a profile the entrypoint would refuse never reaches an image.
entrypoint_layer_test = analysistest.make(
    _entrypoint_layer_test_impl,
    attrs = {
        "expected_profiles": attr.label(allow_files = True, mandatory = True, doc = "the launch profiles"),
    },
)
