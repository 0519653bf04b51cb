"""Progress bars (longstraw_agents/progress.py): tqdm's bar on a terminal, plain lines at a steady pace in a file."""

from __future__ import annotations

import io

import pytest
import tqdm.std

from longstraw_agents.progress import PLAIN_LINE_INTERVAL_S, PlainLineProgress, plain_line_interval, progress_bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def count_to_three(enabled: bool | None, out: io.StringIO, leave: bool = True) -> str:
    bar = progress_bar(total=3, desc="warm start", unit="step", enabled=enabled, leave=leave, file=out)
    for step in range(3):
        bar.set_postfix_str(f"loss {step}", refresh=False)
        bar.update(1)
    bar.close()
    return out.getvalue()


def test_a_terminal_gets_tqdms_redrawn_bar() -> None:
    shown = count_to_three(True, Terminal())
    assert "\r" in shown and "warm start: 100%" in shown and "|" in shown
    assert "warm start" in count_to_three(None, Terminal())  # None: the bar where there is a terminal
    assert count_to_three(False, Terminal()) == ""


def test_a_file_gets_plain_lines_without_carriage_returns_or_escapes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TQDM_MININTERVAL", "0")  # a line at every update
    lines = count_to_three(True, io.StringIO()).splitlines()
    assert lines[0].startswith("warm start:   0% 0/3")
    assert [line.split("%")[0] for line in lines[1:4]] == ["warm start:  33", "warm start:  67", "warm start: 100"]
    assert lines[1].endswith(", loss 0]") and lines[3].endswith(", loss 2]")
    assert lines[-1].startswith("warm start: 100% 3/3")  # the kept bar's last line, as it closed
    text = "\n".join(lines)
    assert "\r" not in text and "\x1b" not in text and "|" not in text
    assert count_to_three(None, io.StringIO()) == ""  # None: nothing without a terminal
    assert count_to_three(False, io.StringIO()) == ""


class Clock:
    """tqdm's clock (``tqdm.std.time``), moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(tqdm.std, "time", clock)
    monkeypatch.delenv("TQDM_MININTERVAL", raising=False)
    return clock


def test_plain_lines_come_once_per_interval(clock: Clock) -> None:
    """Ten seconds a step, a line every 30 seconds: the first line, then one at steps 3 and 6, and the last."""
    assert plain_line_interval() == PLAIN_LINE_INTERVAL_S == 30.0
    out = io.StringIO()
    bar = progress_bar(total=7, desc="warm start", unit="step", enabled=True, file=out)
    for _ in range(7):
        clock.now += 10.0
        bar.update(1)
    bar.close()
    shown = [line.split(" [")[0] for line in out.getvalue().splitlines()]
    assert shown == ["warm start:   0% 0/7", "warm start:  43% 3/7", "warm start:  86% 6/7", "warm start: 100% 7/7"]


def test_a_sub_phase_shows_only_once_it_has_run_for_the_interval(clock: Clock) -> None:
    """A bar that is not kept (one step's rollouts) writes nothing when it is over within the interval."""
    assert count_to_three(True, io.StringIO(), leave=False) == ""
    out = io.StringIO()
    bar = progress_bar(total=4, desc="rollout", unit="ep", enabled=True, leave=False, file=out)
    for _ in range(4):
        clock.now += 20.0
        bar.update(1)
    bar.close()
    assert [line.split(" [")[0] for line in out.getvalue().splitlines()] == ["rollout:  50% 2/4", "rollout: 100% 4/4"]


def test_messages_between_lines_do_not_repeat_the_bar(clock: Clock) -> None:
    """tqdm.write (and logging_redirect_tqdm) clears and redraws the bars around a message; a plain bar erases
    nothing and adds no line until its interval has passed."""
    out = io.StringIO()
    bar = progress_bar(total=2, desc="GRPO", unit="step", enabled=True, file=out)
    assert isinstance(bar, PlainLineProgress)
    bar.update(1)
    bar.write("a warning", file=out)
    bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert lines[1] == "a warning" and len(lines) == 3 and lines[2].startswith("GRPO: 100% 2/2")
