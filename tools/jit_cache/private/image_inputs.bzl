"""The image's layers a first-use build runs on (sglang_jit_cache, triton_cache): their base
rootfs tar (the image's python3.11) and installed trees."""

load("//tools/image/private:providers.bzl", "LayerInfo")

def image_inputs(ctx):
    """(base tar, installed trees) of ctx.attr.layers, bottom layer first."""
    tars = []
    trees = []
    for layer in ctx.attr.layers:
        info = layer[LayerInfo]
        tars += info.tars
        if info.installed:
            trees.append(info.installed)
    if len(tars) != 1:
        fail("%s: layers must hold exactly one base rootfs tar (//image:layer_base), got %d" % (ctx.label, len(tars)))
    return tars[0], trees
