"""Progress of a long job on stderr: the one progress line of the commands and the benchmarks.

On a terminal, a bar redrawn in place (``\\r``), at most ten times a second. Elsewhere (a log
file, CI, a pipe) a line only when another tenth of the work is done or ``every`` seconds passed
since the last line, whichever comes first: a log stays short, and a slow stretch is never silent.
"""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

BAR_WIDTH = 30
REDRAW_S = 0.1   # a terminal's bar is redrawn at most this often


class Progress:
    """``update(done)`` as the work goes on, ``close()`` at the end. ``what`` follows the count
    ("240/240 done"); ``label`` starts each line (who is working); ``quiet``: print nothing."""

    def __init__(self, total: int, what: str = "done", *, label: str = "", quiet: bool = False,
                 every: float = 15.0, stream: Optional[TextIO] = None) -> None:
        self.total, self.what, self.label, self.quiet, self.every = max(1, total), what, label, quiet, every
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.started = self.last = time.monotonic()
        self.tenth = 0          # tenths of the work done at the last line (not on a terminal)
        self.drawn = False      # a bar is on the terminal's current line

    def update(self, done: int, detail: str = "") -> None:
        """``done`` of ``total`` units finished; ``detail``: the rest of the line (queue sizes...)."""
        if self.quiet:
            return
        now = time.monotonic()
        tenth = 10 * done // self.total
        if self.tty:
            if now - self.last < REDRAW_S and done < self.total:
                return
        elif tenth <= self.tenth and now - self.last < self.every:
            return
        self.last, self.tenth = now, max(self.tenth, tenth)
        filled = BAR_WIDTH * min(done, self.total) // self.total
        line = (f"{self.label}[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done}/{self.total} {self.what}"
                f"{'  ' + detail if detail else ''}  {now - self.started:.0f} s")
        if self.tty:
            self.stream.write("\r" + line + "\033[K")   # erase what a longer line left
            self.drawn = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the terminal's bar line (nothing elsewhere)."""
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = False
