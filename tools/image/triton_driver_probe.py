"""Runs inside the image (a chroot of its rootfs) with the image's python3: Triton's first kernel
launch set-up, as a server process meets it. The image's entrypoint binds the shipped Triton
cache (bind_triton_cache, as it does before it execs the server), then Triton's own CudaUtils()
loads its driver module, which Triton builds with a C compiler unless its cache holds it. Any
build Triton starts is recorded and refused (knobs.build.impl), so a miss is named, not
compiled. Prints one JSON line: bound entries, compiles, the loaded module's file, its key
inputs (TRITON_LIBCUDA_PATH), or the error. Copied into the rootfs by tools/image/triton_driver_check.py
check_triton_driver beside profile_probe.py (its entrypoint loader); imports nothing else of tools/.

argv: the entrypoint's path in the image, a writable directory for TRITON_CACHE_DIR.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_probe import load_entrypoint  # noqa: E402


def main(entrypoint, cache_dir):
    out = {"compiles": []}
    try:
        ep = load_entrypoint(entrypoint)
        env = dict(os.environ, TRITON_CACHE_DIR=cache_dir)
        out["bound"] = ep.bind_triton_cache(env)
        os.environ.update(env)
        out["TRITON_LIBCUDA_PATH"] = os.environ.get("TRITON_LIBCUDA_PATH")
        from triton import knobs

        def refuse(name, src, srcdir, library_dirs, include_dirs, libraries):
            out["compiles"].append(name)
            raise RuntimeError(f"Triton started building {name} from {src}: its cache has no entry for it")

        knobs.build.impl = refuse
        from triton.backends.nvidia.driver import CudaUtils

        utils = CudaUtils()
        out["module_file"] = getattr(utils.launch, "__self__", None).__file__
        out["module_real"] = os.path.realpath(out["module_file"])
        out["ok"] = not out["compiles"]
    except BaseException as e:
        out["ok"] = False
        out["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
    print("kimi-k3-triton-driver\t" + json.dumps(out, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
