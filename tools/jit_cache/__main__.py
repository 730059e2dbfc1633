"""`python3 -m tools.jit_cache` (the Bazel actions, //jit_cache:update_inventory and the check)."""
import sys

from tools.common.errors import run_cli
from tools.jit_cache.cli import main

sys.exit(run_cli(main))
