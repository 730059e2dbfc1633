"""The image stage: reproducible layer tars, the OCI layout, push, and checks of the result.

Takes: the stack's verified wheels, the patched trees, the kernel cache, the Debian base.
Gives: layer blobs (layer), the OCI layout (layout), the SPDX SBOM (sbom), the base rootfs tar
(rootfs), a pushed image by digest (push), and the smoke test of an unpacked image (smoke).
"""
