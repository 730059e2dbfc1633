"""`python3 -m tools.kernel_cache` (the Bazel actions and the probe subprocess run it this way)."""
import sys

from tools.common.errors import run_cli
from tools.kernel_cache.cli import main

sys.exit(run_cli(main))
