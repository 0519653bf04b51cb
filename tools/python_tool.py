"""The ``python`` tool: run a program in the sandbox (see `longstraw_agents.tools.sandbox`) and show its output.

Each call is a fresh process: nothing persists between calls. The model sees stdout, then stderr under a
``[stderr]`` line, then, when the run failed, one ``Error:`` line that says how (exit status, timeout, CPU limit).
Where the sandbox cannot isolate the network (and ``SandboxConfig.allow_network`` is off) no code runs: every call
fails with error kind ``"denied"`` and a message that says why and how to allow it.
"""

from __future__ import annotations

import signal

from .function import Tool, tool
from .result import DEFAULT_MAX_OUTPUT_CHARS, ErrorKind, ToolFailure, ToolOutput, truncation_marker
from .sandbox import NetworkIsolationUnavailable, SandboxConfig, SandboxResult, run_python

_RESERVED_CHARS = 300
"""Room kept for markers and the final error line when the streams share the output budget."""


def make_python_tool(
    config: SandboxConfig | None = None, *, name: str = "python", max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS
) -> Tool:
    """A ``python(code)`` tool that runs each call under ``config``'s limits."""
    sandbox_config = config or SandboxConfig()

    def python(code: str) -> ToolOutput:
        """Run a Python 3 program in a sandbox and return what it prints.

        Every call starts a fresh interpreter in an empty temporary directory, so variables and files do not
        persist between calls: print() everything you need. Rely on the standard library only.

        Args:
            code: The complete program to run, e.g. "import math\\nprint(math.comb(10, 3))".
        """
        try:
            result = run_python(code, sandbox_config)
        except NetworkIsolationUnavailable as exc:  # fail closed: the code was not run
            raise ToolFailure(f"the python tool is disabled here: {exc}", kind="denied") from None
        return render_sandbox_result(result, sandbox_config, max_output_chars)

    return tool(python, name=name, max_output_chars=max_output_chars)


def render_sandbox_result(result: SandboxResult, config: SandboxConfig, max_output_chars: int) -> ToolOutput:
    """What the model sees of a run, cut so that the tool's cap keeps both streams and the error line."""
    budget = max(0, max_output_chars - _RESERVED_CHARS)
    stderr, stderr_cut = _clip(result.stderr, result.stderr_bytes, result.stderr_truncated, budget // 2)
    stdout, stdout_cut = _clip(result.stdout, result.stdout_bytes, result.stdout_truncated, budget - len(stderr))
    parts = [stdout] if stdout else []
    if stderr:
        parts.append(f"[stderr]\n{stderr}")
    error, reason = _failure(result, config)
    if reason:
        parts.append(f"Error: {reason}")
    content = "\n".join(part.rstrip("\n") for part in parts) or "(no output)"
    truncated = stdout_cut or stderr_cut
    return ToolOutput(
        content,
        error=error,
        truncated=truncated,
        original_length=result.stdout_bytes + result.stderr_bytes if truncated else None,
    )


def _clip(text: str, total_bytes: int, cut_by_sandbox: bool, budget_chars: int) -> tuple[str, bool]:
    """At most ``budget_chars`` of a stream, with a marker counting every byte not shown."""
    if not cut_by_sandbox and len(text) <= budget_chars:
        return text, False
    kept = text[:budget_chars]
    return kept + truncation_marker(total_bytes - len(kept.encode()), "bytes"), True


def _failure(result: SandboxResult, config: SandboxConfig) -> tuple[ErrorKind | None, str]:
    if result.timed_out:
        return "timeout", f"the program timed out after {config.timeout_s:g} s (wall clock) and was killed"
    if result.returncode == -signal.SIGXCPU:
        return "exception", f"the program exceeded its CPU time limit of {config.cpu_time_s} s and was killed"
    if result.returncode == -signal.SIGKILL:
        return "exception", f"the program was killed (SIGKILL): CPU time limit of {config.cpu_time_s} s or memory"
    if result.returncode < 0:
        return "exception", f"the program was killed by {result.signal_name}"
    if result.returncode > 0:
        detail = f": {result.error_line}" if result.error_line else ""
        return "exception", f"the program exited with status {result.returncode}{detail}"
    return None, ""


python = make_python_tool()
"""The ``python`` tool with the default `SandboxConfig`."""
