"""Repositories of the kernel cache's pinned compiler toolchain (MODULE.bazel: kernel_toolchain).

  @kimi_cuda           a CUDA root assembled from the NVIDIA wheels that the lock's toolchain
                       "cuda-13.0" names (third_party/pins.lock.json "toolchains"): each wheel
                       fetched and verified by tools/fetch (cache, mirrors, air-gapped fill as for
                       every pin), its nvidia/cu13/ tree unpacked into root/, laid out like a CUDA
                       install (lib64 and targets/x86_64-linux/{include,lib} links, unversioned
                       lib*.so links), plus root/kimi-k3-toolchain.json: the pins by sha256.
  @kimi_cxx_userland   the host C++ compiler nvcc drives and the C library it compiles against:
                       Debian bookworm's g++-12, binutils, libc6-dev and libpython3.11-dev headers,
                       unpacked from the .debs of third_party/debian.lock.json set
                       "kernel-userland" by `python3 -m tools.fetch.debian extract` (verified like
                       every pin). Used through --sysroot, never chrooted into.

Both are plain inputs of the compile and link actions (filegroups of every file), so the actions
run sandboxed and remotely, and their keys change exactly when a pinned byte does. Nothing here
probes the host: a local CUDA is an explicit opt-in (--//kernel_cache:cuda_home).
"""

load("//tools/pins/private:fetch.bzl", "FETCH_ENVIRON", "fetch_pin_file", "tool_env", "tool_python", "watch_python_sources")

_WHEEL_PREFIX = "nvidia/cu13"

# Wheels the kernel stage takes only headers from (the modules link only cudart, the driver stub
# and nvrtc): their shared libraries (hundreds of MB) would be inputs of every action.
_HEADERS_ONLY_LIBS = ["libcublas", "libcurand", "libnvblas"]
IDENTITY_FILE = "kimi-k3-toolchain.json"

def _cuda_root_impl(rctx):
    lock = json.decode(rctx.read(rctx.attr.lock))
    tc = lock.get("toolchains", {}).get(rctx.attr.toolchain)
    if tc == None:
        fail("%s: no toolchain '%s' in the lock's \"toolchains\"; add it (see docs/DESIGN.md)" % (rctx.attr.lock, rctx.attr.toolchain))
    pins = {}
    for pin in tc["pins"]:
        spec = lock["pins"][pin]
        sub = {"schema_version": lock["schema_version"], "pins": {pin: spec}, "stacks": {}}
        rctx.file("locks/%s.json" % pin, json.encode_indent(sub))
        # (.zip: rctx.extract picks the format by suffix.)
        wheel = "wheels/%s.zip" % spec["filename"]
        fetch_pin_file(rctx, "locks/%s.json" % pin, pin, wheel)

        # Bazel's own unzip keeps each member's mode (nvcc, ptxas, cicc stay executable).
        rctx.extract(wheel, output = "root", stripPrefix = _WHEEL_PREFIX)
        rctx.delete(wheel)
        pins[pin] = {"filename": spec["filename"], "sha256": spec["sha256"]}
    rctx.delete("locks")
    rctx.delete("wheels")

    # The layout of a CUDA install that nvcc.profile and FlashInfer's link line expect.
    rctx.symlink("root/lib", "root/lib64")
    rctx.symlink("root/include", "root/targets/x86_64-linux/include")
    rctx.symlink("root/lib", "root/targets/x86_64-linux/lib")
    for entry in rctx.path("root/lib").readdir():
        name = entry.basename
        if [p for p in _HEADERS_ONLY_LIBS if name.startswith(p)]:
            rctx.delete(entry)
            continue
        if ".so." in name and ".alt." not in name and "-builtins" not in name:
            link = "root/lib/" + name.split(".so.")[0] + ".so"
            if not rctx.path(link).exists:
                rctx.symlink(entry, link)
    nvcc = rctx.path("root/bin/nvcc")
    if not nvcc.exists:
        fail("toolchain '%s': no bin/nvcc in the unpacked wheels; the lock must name nvidia-cuda-nvcc" % rctx.attr.toolchain)
    rctx.file("root/" + IDENTITY_FILE, json.encode_indent({
        "toolchain": rctx.attr.toolchain,
        "release": tc["release"],
        "pins": pins,
    }) + "\n")
    rctx.file("BUILD.bazel", """\
package(default_visibility = ["//visibility:public"])

# Every file of the CUDA root: the compile and link actions' declared inputs.
filegroup(
    name = "root",
    srcs = glob(["root/**"], exclude = ["root/{identity}"]) + [":identity"],
)

# Its identity (the pins by sha256): the path the actions take the root's location from.
filegroup(
    name = "identity",
    srcs = ["root/{identity}"],
)
""".format(identity = IDENTITY_FILE))

cuda_root = repository_rule(
    implementation = _cuda_root_impl,
    attrs = {
        "lock": attr.label(mandatory = True, allow_single_file = True),
        "toolchain": attr.string(mandatory = True),
    },
    environ = FETCH_ENVIRON,
)

_DEBIAN_TOOL_PACKAGES = [
    Label("//tools/pins:BUILD.bazel"),
    Label("//tools/fetch:BUILD.bazel"),
    Label("//tools/common:BUILD.bazel"),
]

def _cxx_userland_impl(rctx):
    lock = rctx.path(rctx.attr.lock)
    rctx.watch(lock)
    watch_python_sources(rctx, _DEBIAN_TOOL_PACKAGES)
    rctx.report_progress("unpacking Debian set %s" % rctx.attr.set)
    res = rctx.execute(
        [tool_python(rctx), "-m", "tools.fetch.debian", "extract", "--lock", str(lock), "--set", rctx.attr.set, "--out", "root"],
        environment = tool_env(rctx),
        timeout = 3600,
        quiet = False,
    )
    if res.return_code != 0:
        fail("Debian set '%s': %s" % (rctx.attr.set, (res.stderr.strip().splitlines() or ["extract failed"])[-1]))
    if not rctx.path("root/usr/bin/g++-12").exists:
        fail("Debian set '%s' has no usr/bin/g++-12: the kernel stage compiles with g++-12 (add it to the set's roots)" % rctx.attr.set)
    rctx.file("BUILD.bazel", """\
package(default_visibility = ["//visibility:public"])

# Every file of the compiler userland (usr/bin/g++-12, its libexec, binutils, libc6-dev headers):
# the compile and link actions' declared inputs. Documentation is left out (nothing the compilers
# run reads it, and its links dangle without the packages' doc directories).
filegroup(
    name = "root",
    srcs = glob(["root/**"], exclude = [
        "root/.debian-set.json",
        "root/usr/share/doc/**",
        "root/usr/share/info/**",
        "root/usr/share/lintian/**",
        "root/usr/share/locale/**",
        "root/usr/share/man/**",
    ]) + [":identity"],
)

# The set's lock entries (name, version, sha256 of every .deb) as unpacked.
filegroup(
    name = "identity",
    srcs = ["root/.debian-set.json"],
)
""")

cxx_userland = repository_rule(
    implementation = _cxx_userland_impl,
    attrs = {
        "lock": attr.label(mandatory = True, allow_single_file = True),
        "set": attr.string(mandatory = True),
    },
    environ = FETCH_ENVIRON,
)

def _kernel_toolchain_impl(_mctx):
    cuda_root(name = "kimi_cuda", lock = "//third_party:pins.lock.json", toolchain = "cuda-13.0")
    cxx_userland(name = "kimi_cxx_userland", lock = "//third_party:debian.lock.json", set = "kernel-userland")

kernel_toolchain = module_extension(implementation = _kernel_toolchain_impl)
