"""The one error type every stage raises for bad input.

A UserError carries a single line naming the input and the fix; CLIs print it as
`error: <line>` and exit 2, never with a traceback.
"""
from __future__ import annotations

import sys
from typing import Callable, Sequence


class UserError(Exception):
    """Bad input or environment: the message is one line naming the input and the fix."""


def run_cli(main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None) -> int:
    """Run a stage's main(), turning a UserError into a one-line message and exit code 2."""
    try:
        return main(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
