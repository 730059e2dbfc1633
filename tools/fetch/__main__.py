"""`python3 -m tools.fetch` (commands: tools/fetch/cli.py)."""
import sys

from tools.common.errors import run_cli
from tools.fetch.cli import main

sys.exit(run_cli(main))
