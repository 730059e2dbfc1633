"""`python -m tools.fetch`."""
import sys

from tools.common.errors import run_cli
from tools.fetch import main

sys.exit(run_cli(main))
