"""``LongStraw/PythonTask-v0``: write a function that hidden tests check in the sandbox.

The agent may run code with the ``python`` tool (each call a fresh sandboxed interpreter), then answers with the
complete function inside ``<answer>…</answer>`` (a Markdown code fence around it is fine). The reward is the
fraction of hidden tests passed. A solution that does not even load (syntax error, exception at import, no
function of the right name) scores 0 and says why in ``info["score"]``; a test that hangs ends the run at the
timeout, and the tests that finished before it still count.

How the hidden tests run: the answer is written as ``solution.py`` next to a small harness, which imports it
(``sys.path.insert(0, "")``: the sandbox runs ``python3 -I``) and calls the function on every test input, reading
the inputs from stdin. It prints each result as canonical JSON on a line that starts with a random per-run nonce;
the expected values never enter the sandbox, so a solution cannot read them, and the comparison happens here.
The solution's own prints are captured during its calls. This guards against wrong and careless code, not
against an adversary: the solution runs in the harness's interpreter (see `longstraw_agents.tools.sandbox` for
what the sandbox does and does not isolate).
"""

from __future__ import annotations

import json
import math
import re
import secrets
from typing import Any, ClassVar

import numpy as np
from pydantic import Field, field_validator

from longstraw_agents.tools import (
    SandboxConfig,
    SandboxResult,
    Tool,
    format_tool_call,
    make_python_tool,
    run_python,
)

from .base import Score, ToolEnv, ToolEnvConfig
from .python_problems import FAMILIES, PythonProblem, canonical_json, make_python_problem

MiB = 1 << 20
MAX_REPORTED_FAILURES = 3

_CODE_FENCE = re.compile(r"^```[\w+-]*[ \t]*\n(?P<code>.*?)\n?```$", re.DOTALL)

_HARNESS = """\
import contextlib, io, json, sys


def main():
    spec = json.loads(sys.stdin.read())
    nonce, out = spec["nonce"], sys.stdout

    def report(record):
        out.write(nonce + " " + json.dumps(record) + "\\n")
        out.flush()

    def describe(exc):
        return (type(exc).__name__ + ": " + str(exc))[:300]

    sys.path.insert(0, "")  # python3 -I leaves the working directory off sys.path
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            import solution
        function = getattr(solution, spec["function"])
    except BaseException as exc:
        report({"load_error": describe(exc)})
        return
    for index, args in enumerate(spec["cases"]):
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                result = function(*args)
            report({"index": index, "result": json.dumps(result, sort_keys=True)})
        except BaseException as exc:
            report({"index": index, "error": describe(exc)})


main()
"""


class PythonTaskConfig(ToolEnvConfig):
    num_tests: int = Field(
        default=8, ge=1, le=100, description="Hidden tests per problem (the family's edge cases first)."
    )
    families: tuple[str, ...] = Field(
        default=tuple(FAMILIES), min_length=1, description="Problem families to draw from."
    )
    test_timeout_s: float = Field(default=10.0, gt=0, le=300, description="Wall-clock limit of one hidden-test run.")
    tool_timeout_s: float = Field(default=5.0, gt=0, le=300, description="Wall-clock limit of one python tool call.")
    allow_network: bool = Field(
        default=False,
        description="Run the python tool and the hidden tests with the host's network (SandboxConfig.allow_network); "
        "only for hosts where the sandbox cannot create a network namespace.",
    )
    max_turns: int = Field(default=6, ge=1, description="Assistant turns per episode.")
    max_tokens: int = Field(default=8192, ge=1, description="Token budget of the whole episode.")

    @field_validator("families")
    @classmethod
    def _known_families(cls, families: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [name for name in families if name not in FAMILIES]
        if unknown:
            raise ValueError(f"unknown problem families {unknown}; known: {sorted(FAMILIES)}")
        return families


class PythonTaskEnv(ToolEnv[PythonProblem]):
    """Programming problems; reward = fraction of hidden tests passed."""

    config_class = PythonTaskConfig
    config: PythonTaskConfig
    instructions: ClassVar[str] = "Write the Python function the user asks for. You may test code first."

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        network = self.config.allow_network
        self._python_tool = make_python_tool(
            SandboxConfig(
                timeout_s=self.config.tool_timeout_s,
                cpu_time_s=_cpu_seconds(self.config.tool_timeout_s),
                allow_network=network,
            ),
            max_output_chars=4000,
        )
        self._test_sandbox = SandboxConfig(
            timeout_s=self.config.test_timeout_s,
            cpu_time_s=_cpu_seconds(self.config.test_timeout_s),
            max_output_bytes=MiB,
            allow_network=network,
        )

    def make_task(self, rng: np.random.Generator) -> PythonProblem:
        return make_python_problem(rng, self.config.families, self.config.num_tests)

    def tools(self, task: PythonProblem) -> list[Tool]:
        return [self._python_tool]

    def user_prompt(self, task: PythonProblem) -> str:
        example = f"{task.function}({', '.join(map(repr, task.example_args))})"
        return (
            f"Write a Python function\n\n    {task.signature}\n\nthat {task.description}.\n\n"
            f"For example, {example} returns {task.example_result!r}.\n\n"
            "Hidden tests will call the function. Answer with the complete function (standard library only) "
            "inside <answer></answer>."
        )

    def score(self, task: PythonProblem, answer: str) -> Score:
        return run_hidden_tests(task, extract_code(answer), self._test_sandbox)

    def scripted_turns(self, task: PythonProblem) -> list[str]:
        example = f"{task.function}({', '.join(map(repr, task.example_args))})"
        check = f"{task.reference}\nprint({example})\n"
        return [format_tool_call("python", {"code": check}), f"<answer>\n{task.reference}</answer>"]


def extract_code(answer: str) -> str:
    """The code of an answer: its text, without a surrounding Markdown code fence."""
    text = answer.strip()
    fenced = _CODE_FENCE.match(text)
    return fenced["code"] if fenced else text


def run_hidden_tests(task: PythonProblem, code: str, sandbox: SandboxConfig) -> Score:
    """Run ``code``'s function on the hidden tests in the sandbox; the reward is the fraction that pass."""
    total = len(task.cases)
    if not code.strip():
        return Score(0.0, {"passed": 0, "total": total, "error": "the answer holds no code"})
    nonce = secrets.token_hex(16)
    stdin = json.dumps({"nonce": nonce, "function": task.function, "cases": list(task.cases)})
    run = run_python(_HARNESS, sandbox, stdin=stdin, files={"solution.py": code})
    records = _harness_records(run.stdout, nonce)
    load_error = next((record["load_error"] for record in records if "load_error" in record), None)
    outcomes: dict[int, dict[str, Any]] = {}
    for record in records:
        index = record.get("index")
        if isinstance(index, int) and 0 <= index < total:
            outcomes.setdefault(index, record)  # the harness writes each index once; later lines are not its own
    passed = 0
    failures: list[dict[str, Any]] = []
    for index, (args, expected) in enumerate(zip(task.cases, task.expected, strict=True)):
        outcome = outcomes.get(index, {"error": "did not run (the program ended or timed out before it)"})
        if outcome.get("result") is not None and _same_json(outcome["result"], expected):
            passed += 1
        elif len(failures) < MAX_REPORTED_FAILURES:
            got = {"error": outcome["error"]} if "error" in outcome else {"got": outcome.get("result")}
            failures.append({"args": args, "expected": expected, **got})
    error = load_error or _run_failure(run, sandbox)
    details = {"passed": passed, "total": total, "error": error, "failures": failures}
    return Score(passed / total, details)


def _run_failure(run: SandboxResult, sandbox: SandboxConfig) -> str | None:
    """Why the test run ended early, if it did (the harness itself exits 0 whatever the solution does)."""
    if run.timed_out:
        return f"the tests timed out after {sandbox.timeout_s:g} s"
    if run.returncode < 0:
        return f"the test run was killed by {run.signal_name} (CPU limit {sandbox.cpu_time_s} s, or memory)"
    if run.returncode > 0:
        return f"the test run exited with status {run.returncode}: {run.error_line}"
    return None


def _harness_records(stdout: str, nonce: str) -> list[dict[str, Any]]:
    records = []
    prefix = nonce + " "
    for line in stdout.splitlines():
        if not line.startswith(prefix):
            continue
        try:
            record = json.loads(line[len(prefix) :])
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _same_json(result: Any, expected: str) -> bool:
    if not isinstance(result, str):
        return False
    try:
        return canonical_json(json.loads(result)) == expected
    except json.JSONDecodeError:
        return False


def _cpu_seconds(timeout_s: float) -> int:
    """A CPU limit that does not undercut the wall-clock limit, so that a busy loop reports as a timeout."""
    return max(1, math.ceil(timeout_s))
