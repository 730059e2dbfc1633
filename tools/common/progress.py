"""Progress of long work on stderr: done/total, rate and ETA.

Two shapes of work: byte streams (downloads, pushes: throttled lines with sizes and rates) and
counted items (compiled objects: one line per item, with what it was and how long it took).
"""
from __future__ import annotations

import sys
import threading
import time
from typing import IO

INTERVAL_S = 0.5


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} GB"


class Progress:
    """Throttled byte progress: `label: done / total (P%), ETA s, rate/s`, then one final line."""

    def __init__(self, label: str, total: int | None, stream: IO[str] | None = None) -> None:
        self.label = label
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.start = time.monotonic()
        self.last = self.start

    def advance(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= INTERVAL_S:
            self.last = now
            print(f"{self.label}: {self._status(now)}", file=self.stream, flush=True)

    def _status(self, now: float) -> str:
        elapsed = max(now - self.start, 1e-6)
        rate = self.done / elapsed
        text = human_bytes(self.done)
        if self.total:
            text += f" / {human_bytes(self.total)} ({100 * self.done / self.total:.0f}%)"
            if rate > 0:
                text += f", ETA {max(self.total - self.done, 0) / rate:.0f} s"
        return f"{text}, {human_bytes(rate)}/s"

    def finish(self, what: str) -> None:
        elapsed = time.monotonic() - self.start
        print(f"{self.label}: {what} {human_bytes(self.done)} in {elapsed:.1f} s "
              f"({human_bytes(self.done / max(elapsed, 1e-6))}/s)", file=self.stream, flush=True)


class ItemProgress:
    """Counted items, one line each: `label: n/total <unit>  what secs  elapsed  ETA` (thread-safe;
    the ETA is from the items done in this run, `already` ones are counted but not timed)."""

    def __init__(self, label: str, total: int, already: int = 0, unit: str = "items",
                 stream: IO[str] | None = None) -> None:
        self.label, self.total, self.unit = label, total, unit
        self.done, self.ran = already, 0
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = time.monotonic()
        self.lock = threading.Lock()

    def tick(self, what: str, secs: float) -> None:
        with self.lock:
            self.done += 1
            self.ran += 1
            elapsed = time.monotonic() - self.t0
            eta = elapsed / self.ran * (self.total - self.done)
            print(f"{self.label}{self.done}/{self.total} {self.unit}  {what} {secs:.1f}s  "
                  f"elapsed {elapsed:.0f}s  ETA {eta:.0f}s", file=self.stream, flush=True)
