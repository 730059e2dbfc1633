"""Module extension: a fingerprint of the local CUDA toolchain, an input of every kernel-cache action.

The kernel cache compiles with a local CUDA (nvcc 13.0 at /usr/local/cuda, or KIMI_CUDA_HOME) and
the host's C++ compiler. Their versions must be part of each object's cache key, or a changed
toolchain would give stale cache hits (locally and in a shared remote cache). This repository records what
`nvcc --version`, CUDA's version.json and the host compilers say, and re-runs when the nvcc
binary or version.json changes (watched) or when KIMI_CUDA_HOME / KIMI_K3_HOST_ROOT change.
"""

def _first_line(res):
    if res.return_code != 0:
        return "unavailable (exit %d)" % res.return_code
    return res.stdout.strip()

def _fingerprint_impl(rctx):
    cuda = rctx.os.environ.get("KIMI_CUDA_HOME", "") or "/usr/local/cuda"
    host = rctx.os.environ.get("KIMI_K3_HOST_ROOT", "") or "/run/kimi-k3-host"
    nvcc = rctx.path(cuda + "/bin/nvcc")
    lines = ["cuda_home: " + cuda]
    if nvcc.exists:
        rctx.watch(nvcc)
        lines.append("nvcc: " + _first_line(rctx.execute([str(nvcc), "--version"])))
    else:
        lines.append("nvcc: missing at %s (set KIMI_CUDA_HOME)" % nvcc)
    version_json = rctx.path(cuda + "/version.json")
    if version_json.exists:
        rctx.watch(version_json)
        lines.append("version.json: " + rctx.read(version_json))

    # The compilers nvcc drives: the host userland's when tools/bazel mounts it (see
    # tools/kernel_cache --host-root), else this root's.
    if rctx.path(host + "/usr/bin").exists:
        cxx = ["chroot", host, "c++", "--version"]
        os_release = rctx.path(host + "/etc/os-release")
    else:
        cxx = ["c++", "--version"]
        os_release = rctx.path("/etc/os-release")
    lines.append("c++: " + _first_line(rctx.execute(cxx)))
    if os_release.exists:
        lines.append("os-release: " + rctx.read(os_release))
    rctx.file("fingerprint.txt", "\n".join(lines) + "\n")
    rctx.file("BUILD.bazel", 'exports_files(["fingerprint.txt"], visibility = ["//visibility:public"])\n')

_fingerprint = repository_rule(
    implementation = _fingerprint_impl,
    environ = ["KIMI_CUDA_HOME", "KIMI_K3_HOST_ROOT"],
    local = True,
)

def _ext_impl(_mctx):
    _fingerprint(name = "kimi_cuda_toolchain")

cuda_toolchain = module_extension(implementation = _ext_impl)
