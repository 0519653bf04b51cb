"""Progress bars that suit where they are written: tqdm's bar on a terminal (or a notebook's widget), and plain lines
at a steady pace where the output is a file, a pipe or a CI log.

A tqdm bar redraws itself with carriage returns and, when bars are nested, cursor moves: in a log file that is a
single line of ``\\r``-separated frames and escape codes. ``progress_bar`` gives such an output a bar that writes
one ordinary line (``warm start:  45% 45/100 [00:30<00:37, 1.50step/s, loss 0.523]``) at most every
``PLAIN_LINE_INTERVAL_S`` seconds, and the last line of a bar that is kept when it closes. ``TQDM_MININTERVAL``, which
sets how often tqdm redraws, sets that interval too.
"""

from __future__ import annotations

import os
import sys
from typing import IO, Any

from tqdm.auto import tqdm as auto_tqdm
from tqdm.std import tqdm as std_tqdm

PLAIN_LINE_INTERVAL_S = 30.0
"""Seconds between two lines of a bar written to a file: often enough to see that a long phase is alive, rarely
enough that a day-long run's log stays readable (about 3,000 lines a day per bar)."""

PLAIN_FORMAT = "{desc}: {percentage:3.0f}% {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
"""A plain line is tqdm's line without the bar."""


def progress_bar(
    *,
    total: int,
    desc: str,
    unit: str,
    enabled: bool | None,
    initial: int = 0,
    leave: bool = True,
    file: IO[str] | None = None,
) -> std_tqdm:
    """A progress bar for ``total`` units written to ``file`` (default: standard error).

    enabled: True: tqdm's bar on a terminal or in a notebook, plain lines elsewhere; None: the bar on a terminal or
        in a notebook only; False: nothing.
    leave: keep the bar when it closes (its last line); a bar of a sub-phase (one step's rollouts) leaves nothing,
        and written to a file it shows only once it has run for ``PLAIN_LINE_INTERVAL_S``.
    """
    stream = file if file is not None else sys.stderr
    live = _in_notebook() or _is_terminal(stream)
    kwargs: dict[str, Any] = dict(total=total, desc=desc, unit=unit, initial=initial, leave=leave, file=file)
    if live or not enabled:
        return auto_tqdm(**kwargs, disable=not (live and enabled is not False))
    return PlainLineProgress(**kwargs, interval=plain_line_interval())


def plain_line_interval() -> float:
    """Seconds between two plain lines: ``TQDM_MININTERVAL`` when set, else ``PLAIN_LINE_INTERVAL_S``."""
    return float(os.environ.get("TQDM_MININTERVAL", PLAIN_LINE_INTERVAL_S))


class PlainLineProgress(std_tqdm):
    """tqdm for an output that is not a terminal: each display is one line of text (no carriage return, no cursor
    move, no bar), at most one every ``interval`` seconds; a kept bar (``leave``) ends with its final line.

    Built the way tqdm's own front ends are (``tqdm.rich``, ``tqdm.notebook``): tqdm counts and formats, and
    ``display`` / ``clear`` say how a line reaches the output."""

    def __init__(self, *args: Any, interval: float, leave: bool = True, **kwargs: Any):
        self._closing = False
        self._last_line_t: float | None = None
        super().__init__(
            *args,
            leave=leave,
            mininterval=interval,
            miniters=1,  # every update looks at the clock; the interval alone paces the lines
            delay=0.0 if leave else interval,  # a short sub-phase writes nothing
            bar_format=PLAIN_FORMAT,
            disable=False,
            **kwargs,
        )

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if msg == "":  # tqdm erasing the line to redraw or drop it: a log keeps what it has
            return False
        now = self._time()
        if not self._closing and self._last_line_t is not None and now - self._last_line_t < self.mininterval:
            return False  # a redraw after a message written between lines (tqdm.write, logging_redirect_tqdm)
        self._last_line_t = now
        # when closing, tqdm itself ends the line (a newline after this display)
        self.fp.write(str(self) if msg is None else msg)
        if not self._closing:
            self.fp.write("\n")
        self.fp.flush()
        return True

    def clear(self, nolock: bool = False) -> None:
        """Nothing to erase: lines written to a file stay."""

    def close(self) -> None:
        self._closing = True
        super().close()


def _is_terminal(stream: IO[str]) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _in_notebook() -> bool:
    """Whether ``tqdm.auto`` chose the notebook's widget bar (which draws itself, with no terminal)."""
    notebook = sys.modules.get("tqdm.notebook")
    return notebook is not None and issubclass(auto_tqdm, notebook.tqdm_notebook)
