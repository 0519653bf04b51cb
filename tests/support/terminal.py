"""Subprocesses that meet Ctrl-C as a terminal's command does.

A shell that starts a job in the background without job control (``make test &``, a CI runner's script) sets SIGINT
to ignored in it, and an ignored signal stays ignored through ``exec``: Python then installs no KeyboardInterrupt
handler, and a SIGINT sent to the child does nothing. A child started with ``preexec_fn=sigint_as_in_a_terminal``
gets the default disposition back, whatever the test runner inherited."""

from __future__ import annotations

import signal


def sigint_as_in_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
