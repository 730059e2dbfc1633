"""Stand-ins for FlashKDA's pins and the stack's torch wheel, so the CPU suite builds a wheel with
//kernel_cache's own flashkda_wheel rule and the pinned toolchain without GitHub (FlashKDA is a
GitHub-only input) and without the GB-sized torch wheel:

    flashkda_fixture.py KDA_TAR CUTLASS_TAR TORCH_WHEEL

KDA_TAR: a tree in the shape of FlashKDA's (a setup.py with a CUDAExtension flash_kda_C from
csrc/flash_kda.cpp and csrc/smxx/fwd_launch.cu, the flash_kda package), with tiny sources that
include a CUTLASS header and no torch header; CUTLASS_TAR: the directories the build takes and
one it must leave out; TORCH_WHEEL: METADATA and one header. Written here, not copied from
FlashKDA; deterministic (fixed order, times and owners).
"""
from __future__ import annotations

import io
import sys
import tarfile
import zipfile

SETUP_PY = '''import os
from setuptools import setup
from torch.utils.cpp_extension import CUDAExtension, BuildExtension

this_dir = os.path.dirname(os.path.abspath(__file__))
SUPPORTED_CUDA_ARCHS = ["90a", "120a"]


def nvcc_threads():
    return ["--threads", "4"]


ext_modules = [
    CUDAExtension(
        name="flash_kda_C",
        sources=["csrc/flash_kda.cpp", "csrc/smxx/fwd_launch.cu"],
        include_dirs=[
            os.path.join(this_dir, "cutlass", "include"),
            os.path.join(this_dir, "cutlass", "tools", "util", "include"),
            os.path.join(this_dir, "csrc"),
        ],
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "-lineinfo", *nvcc_threads()]},
    )
]
setup(name="flash_kda", version="0.0.1" + os.getenv("SUFFIX", ""), ext_modules=ext_modules,
      packages=["flash_kda"], cmdclass={"build_ext": BuildExtension})
'''

KDA = {
    "setup.py": SETUP_PY,
    "csrc/fwd.h": "#pragma once\nint fixture_launch(int* out);\n",
    "csrc/flash_kda.cpp": '#include "fwd.h"\n#include "fixture/util.h"\nint fixture_host(int* out) { return fixture_launch(out) + FIXTURE_UTIL; }\n',
    "csrc/smxx/fwd_launch.cu": ('#include "fwd.h"\n#include "cute/fixture.hpp"\n'
                                "__global__ void fixture_kernel(int* out) { *out = FIXTURE_VALUE; }\n"
                                "int fixture_launch(int* out) { fixture_kernel<<<1, 1>>>(out); return 0; }\n"),
    "flash_kda/__init__.py": "from flash_kda_C import fwd  # the real package's import\n",
}
CUTLASS = {
    "include/cute/fixture.hpp": "#pragma once\n#define FIXTURE_VALUE 41\n",
    "tools/util/include/fixture/util.h": "#pragma once\n#define FIXTURE_UTIL 1\n",
    "examples/common/fixture.h": "#pragma once\n",
    "docs/not-unpacked.md": "left out of the tree\n",
}


def write_tar(path: str, files: dict[str, str]) -> None:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            data = files[name].encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))


def write_torch_wheel(path: str) -> None:
    with zipfile.ZipFile(path, "w") as z:
        for name, text in (("torch-2.13.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0\n"),
                           ("torch/include/torch/extension.h", "#pragma once\n")):
            z.writestr(zipfile.ZipInfo(name, (1980, 1, 1, 0, 0, 0)), text)


def main(argv: list[str]) -> int:
    kda, cutlass, torch = argv
    write_tar(kda, KDA)
    write_tar(cutlass, CUTLASS)
    write_torch_wheel(torch)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
