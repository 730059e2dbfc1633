"""Providers shared between the image rules."""

LayerInfo = provider(
    doc = "One image layer from tools/image/layer.py.",
    fields = {"blob": "the layer blob (tar+gzip)", "descriptor": "its descriptor JSON"},
)
