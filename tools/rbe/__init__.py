"""A real REAPI cluster on loopback, from pins: BuildGrid 0.9.1 (PyPI, a hashed lock), PostgreSQL
18 and buildbox 1.4.30 (Debian set rbe-cluster of third_party/debian.lock.json), for
`tools/bazel build --config=rbe`.

Takes: the Debian set rbe-cluster, rbe/requirements_lock.txt, a worker count and a port. Gives:
`python3 -m tools.rbe up --workers N` (REAPI at grpc://127.0.0.1:50051, instance `main`),
`status` (processes and RSS), `down` (nothing left listening, running or mounted).

Modules: config (paths, BuildGrid's config, the command lines: pure), root (the cluster root by
mmdebstrap, BuildGrid's venv), exec_root (what remote actions run over: Bazel's sealed root, as
local actions do), enter (into the root's own mount and PID namespaces, pivot_root),
supervisor (PID 1 in the root: starts, watches and stops the processes), cluster (up, down,
status on the host), exec_image (the exec root as an OCI image for a hosted engine: `image`),
__main__ (the CLI). Package graph: common, pins, fetch, image <- rbe.
"""
