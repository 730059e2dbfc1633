"""Where a Bazel run spent its time: the top actions and tests of a JSON trace profile.

    python3 -m tools.bench.profile PROFILE.json.gz [--top 15] [--by target|mnemonic]

Take the profile with `--profile=FILE.json.gz --experimental_profile_include_target_label
--noslim_profile` (a user.bazelrc line reaches the README's commands unchanged). Each action or
test is one "action processing" event; this sums their durations per target and mnemonic (the
what) and prints the top ones with their share of all action time. Bazel records no CPU time
per action, so the figure is wall seconds in the action: on a machine whose cores are all busy
for the whole run (the 2-core case the README's goals are set for), an action's wall time is the
core time it took, give or take what the other job stole from it. Also prints the run's wall time,
the sum of action time and the critical path's actions (from the "critical path component"
events).
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from tools.common.errors import UserError, run_cli

ACTION_CATEGORY = "action processing"
CRITICAL_CATEGORY = "critical path component"


@dataclass(frozen=True)
class Row:
    target: str
    mnemonic: str
    what: str
    seconds: float
    count: int


def load_events(path: Path) -> list[dict[str, Any]]:
    try:
        raw = path.read_bytes()
        data = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    except FileNotFoundError:
        raise UserError(f"{path}: no such profile; take one with --profile={path}") from None
    except (OSError, EOFError, ValueError) as e:
        raise UserError(f"{path}: not a Bazel JSON trace profile ({e}); take one with --profile=FILE.json.gz") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise UserError(f"{path}: no traceEvents list; take one with --profile=FILE.json.gz")
    return [e for e in events if isinstance(e, dict)]


def _mnemonic(event: dict[str, Any]) -> str:
    args = event.get("args") or {}
    if args.get("mnemonic"):
        return str(args["mnemonic"])
    name = str(event.get("name", ""))
    return "TestRunner" if name.startswith("Testing ") else name.split(" ", 1)[0]


def action_rows(events: Iterable[dict[str, Any]], by: str = "target") -> list[Row]:
    """Action time summed per (target, mnemonic) (by="target") or per mnemonic, largest first."""
    seconds: dict[tuple[str, str], float] = defaultdict(float)
    counts: dict[tuple[str, str], int] = defaultdict(int)
    names: dict[tuple[str, str], str] = {}
    for e in events:
        if e.get("cat") != ACTION_CATEGORY or e.get("ph") != "X":
            continue
        target = str((e.get("args") or {}).get("target", "")) if by == "target" else ""
        key = (target, _mnemonic(e))
        seconds[key] += float(e.get("dur", 0)) / 1e6
        counts[key] += 1
        names.setdefault(key, str(e.get("name", "")))
    rows = [Row(t, m, names[(t, m)] if counts[(t, m)] == 1 else f"{counts[(t, m)]} actions", s, counts[(t, m)])
            for (t, m), s in seconds.items()]
    return sorted(rows, key=lambda r: (-r.seconds, r.target, r.mnemonic))


def run_wall_seconds(events: Sequence[dict[str, Any]]) -> float:
    spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events
             if e.get("ph") == "X" and "ts" in e]
    return (max(b for _, b in spans) - min(a for a, _ in spans)) / 1e6 if spans else 0.0


def critical_path(events: Iterable[dict[str, Any]]) -> list[tuple[str, float]]:
    return [(str(e.get("name", "")), float(e.get("dur", 0)) / 1e6) for e in events
            if e.get("cat") == CRITICAL_CATEGORY and e.get("ph") == "X"]


def report(path: Path, top: int, by: str) -> str:
    events = load_events(path)
    rows = action_rows(events, by)
    total = sum(r.seconds for r in rows)
    crit = critical_path(events)
    lines = [f"Profile {path.name}: run {run_wall_seconds(events):.0f} s wall, {sum(r.count for r in rows)} actions "
             f"and tests, {total:.0f} s in them, critical path {sum(s for _, s in crit):.0f} s "
             f"({len(crit)} actions).", "",
             "| # | target | mnemonic | seconds | share | what |", "|---|---|---|---|---|---|"]
    for i, r in enumerate(rows[:top], 1):
        share = 100 * r.seconds / total if total else 0.0
        what = r.what.replace("|", "/")[:80]
        lines.append(f"| {i} | `{r.target or '-'}` | {r.mnemonic} | {r.seconds:.1f} | {share:.1f}% | {what} |")
    rest = rows[top:]
    if rest:
        lines.append(f"| | {len(rest)} others | | {sum(r.seconds for r in rest):.1f} | "
                     f"{100 * sum(r.seconds for r in rest) / total if total else 0:.1f}% | |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("profile", type=Path)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--by", choices=("target", "mnemonic"), default="target")
    args = p.parse_args(argv)
    if args.top < 1:
        raise UserError(f"--top {args.top}: expected a count of 1 or more")
    sys.stdout.write(report(args.profile, args.top, args.by))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
