"""kernel_cache_layer_test: analysis test of the image's kernel-cache layer (nothing is built)."""

load("@bazel_skylib//lib:unittest.bzl", "analysistest", "asserts")
load(":layer_action.bzl", "layer_action")

def _kernel_cache_layer_test_impl(ctx):
    env = analysistest.begin(ctx)
    action = layer_action(env)
    if action:
        inputs = [f.short_path for f in action.inputs.to_list()]
        caches = [p for p in inputs if p.startswith("kernel_cache/")]
        asserts.equals(env, [ctx.attr.expected_tree], caches, "kernel cache trees the layer takes")
        argv = action.argv
        i = argv.index("--kernel-cache-arch") if "--kernel-cache-arch" in argv else -1
        asserts.true(env, i >= 0 and argv[i + 1] == ctx.attr.expected_arch,
                     "the layer action must run its arch guard with --kernel-cache-arch %s: %s" % (ctx.attr.expected_arch, argv))
    return analysistest.end(env)

# With --//kernel_cache:arch=9.0a in effect, the kernel-cache layer must still take the SM120
# cache (its own, not an empty stand-in: FlashInfer must not compile at the first request) and
# run its arch guard: the image's environment says 12.0f. The wiring is the same on every stack;
# it is analysed on the pypi stack because the default stack's patched tree needs FlashInfer
# #4460 (a GitHub-only pin) even to be analysed, which the CPU suite must not.
kernel_cache_layer_test = analysistest.make(
    _kernel_cache_layer_test_impl,
    attrs = {
        "expected_tree": attr.string(mandatory = True, doc = "short path of the kernel cache tree"),
        "expected_arch": attr.string(mandatory = True),
    },
    config_settings = {
        str(Label("//kernel_cache:arch")): "9.0a",
        str(Label("//third_party:stack")): "pypi",
    },
)
