"""The GPU suite without Bazel: lay out the stack's wheels and kernel cache into one site
directory (site) and run tests/gpu with pytest, printing a table (run; `python -m tools.gpu_suite`);
the GPU host recipe: one folder with all a GPU host needs (bundle; `//tools/gpu_suite:bundle`) and
its run.sh on the GPU host, which builds the GPU's kernel selection and runs the suite (host).
"""
