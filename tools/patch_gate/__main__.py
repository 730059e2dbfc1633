"""`python -m tools.patch_gate`."""
import sys

from tools.common.errors import run_cli
from tools.patch_gate.cli import main

sys.exit(run_cli(main))
