"""`python -m tools.kernel_cache`."""
import sys

from tools.common.errors import run_cli
from tools.kernel_cache import main

sys.exit(run_cli(main))
