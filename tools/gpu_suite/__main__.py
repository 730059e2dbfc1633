"""`python -m tools.gpu_suite`."""
import sys

from tools.common.errors import run_cli
from tools.gpu_suite.run import main

sys.exit(run_cli(main))
