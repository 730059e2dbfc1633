"""The GPU suite without Bazel: lay out the stack's wheels and kernel cache into one site
directory (site) and run tests/gpu with pytest, printing a table (run; `python -m tools.gpu_suite`).
"""
