"""Test macros: the CPU and GPU suites are plain py_tests running pytest, with tags and data.

`artifacts` maps an environment variable to a label of a pinned artifact (e.g. a wheel from
@pins); the test receives the artifact's runfiles path in that variable (DESIGN.md "Test
artifacts"), so tests read real upstream bytes without knowing where Bazel keeps them.
"""

load("@rules_python//python:defs.bzl", "py_test")

def _artifact_env(artifacts):
    return {var: "$(rootpath %s)" % label for var, label in artifacts.items()}

def _pytest_test(name, srcs, artifacts, data, deps, env, tags, size, conftest, **kwargs):
    srcs = srcs or [name + ".py"]
    py_test(
        name = name,
        srcs = srcs,
        main = srcs[0],
        data = data + list(artifacts.values()),
        deps = deps + [conftest],
        env = env | _artifact_env(artifacts) if artifacts else env,
        # "pytest": .ci/count_results.py requires pytest's own report from these (a file whose
        # __main__ does not run pytest passes with the report Bazel writes for it, and no case run).
        tags = tags + ["pytest"],
        size = size,
        **kwargs
    )

def cpu_test(name, srcs = None, artifacts = {}, data = [], deps = [], env = {}, tags = [], size = "medium", **kwargs):
    """A CPU-suite test (tag cpu): runs anywhere, never needs a GPU or GitHub."""
    _pytest_test(name, srcs, artifacts, data, deps, env, ["cpu"] + tags, size, "//tests/cpu:conftest", **kwargs)

def gpu_test(name, srcs = None, artifacts = {}, data = [], deps = [], env = {}, tags = [], size = "large", **kwargs):
    """A GPU-suite test: tagged gpu (excluded from CPU runs by .bazelrc), exclusive (one GPU),
    local (needs the host's driver), and never cached (the GPU and driver are not inputs)."""
    _pytest_test(
        name,
        srcs,
        artifacts,
        data,
        deps,
        env,
        ["gpu", "exclusive", "local", "no-remote", "no-cache"] + tags,
        size,
        "//tests/gpu:conftest",
        **kwargs
    )
