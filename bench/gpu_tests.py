"""The GPU parity tests' verdicts, and the engine switches that keep ``bench/gpu.py`` from timing a kernel that failed.

``bench/gpu.sh`` runs ``pytest -m gpu`` first with a JUnit XML record; each kernel's tests are the test ids its
``KernelSwitch.tests`` pattern finds there. A kernel with a failed (or erroring) test is switched off: through the
environment (``env``, exported by ``gpu.sh`` before Python starts, since a module may read it at import) or an
``EngineConfig`` field (``engine``), and the rows it would have run in say so (``kernels_off``). The names are the
contract with the modules that read them:

- ``LONGSTRAW_DELTA_RULE=torch``: ``longstraw_agents.models`` runs GatedDeltaNet's pure-torch chunked scan instead
  of the Triton / flash-linear-attention kernels;
- ``EngineConfig.attention``: the attention backend (``longstraw_agents.attention.BACKEND_NAMES``); a failed fused
  CUDA backend gives way to the next of ``ATTENTION_FALLBACKS`` that exists and passed;
- ``LONGSTRAW_DECODE_GRAPHS=0``: batched decoding runs the eager step instead of the captured CUDA graph.

    python -m bench.gpu_tests env gpu_tests.xml       # the shell exports of the failed kernels' switches
    python -m bench.gpu_tests summary gpu_tests.xml   # each kernel's verdict
"""

from __future__ import annotations

import argparse
import re
import shlex
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Outcome = Literal["passed", "failed", "skipped"]
Verdict = Literal["passed", "failed", "skipped", "not run"]

# where a failed fused CUDA attention backend goes, in order (the first that exists and did not fail)
ATTENTION_FALLBACKS = ("cuda-flash", "cuda-cudnn", "eager")
DECODE_GRAPHS_ENV = "LONGSTRAW_DECODE_GRAPHS"  # "0": bench.gpu's decode phase runs the eager step


@dataclass(frozen=True)
class TestResult:
    """One test case of a JUnit record: ``module::name[params]`` (the module's dotted path) and its outcome."""

    __test__ = False  # (not a pytest test class)

    id: str
    outcome: Outcome


@dataclass(frozen=True)
class KernelSwitch:
    """A kernel, the GPU tests that check it (a regex searched in each test id), and how to run without it."""

    kernel: str
    tests: str
    env: dict[str, str] = field(default_factory=dict)
    attention: str | None = None  # the backend whose failure this is (the engine then takes a fallback)
    families: tuple[str, ...] | None = None  # the families it runs in (None: all)
    phases: tuple[str, ...] | None = None  # the phases it runs in (None: all)

    def covers(self, test_id: str) -> bool:
        return re.search(self.tests, test_id) is not None

    def applies_to(self, family: str, phase: str) -> bool:
        return (self.families is None or family in self.families) and (self.phases is None or phase in self.phases)


KERNELS = (
    KernelSwitch(
        "delta rule: flash-linear-attention's forward",
        r"test_hybrid\b.*::\S*fla",
        env={"LONGSTRAW_DELTA_RULE": "triton"},
        families=("hybrid",),
    ),
    KernelSwitch(
        "delta rule: the Triton scan",
        r"(test_delta_scan|test_hybrid)\b.*::\S*triton",
        env={"LONGSTRAW_DELTA_RULE": "torch"},
        families=("hybrid",),
    ),
    KernelSwitch("attention: cuda (flash or cuDNN, tuned)", r"test_attention\b.*::\S*\[cuda-", attention="cuda"),
    KernelSwitch("attention: cuda-flash", r"test_attention\b.*::\S*cuda-flash", attention="cuda-flash"),
    KernelSwitch("attention: cuda-cudnn", r"test_attention\b.*::\S*cudnn", attention="cuda-cudnn"),
    KernelSwitch(
        "DSA: index scores and sparse attention",
        r"test_dsa\b.*::",
        env={"LONGSTRAW_DSA_KERNELS": "0"},
        families=("mla",),
    ),
    KernelSwitch(
        "decoding: CUDA graph",
        r"test_step_graph\b.*::",
        env={DECODE_GRAPHS_ENV: "0"},
        phases=("decode",),
    ),
)


def read_junit(path: Path) -> list[TestResult]:
    """Every test case of a JUnit XML record (pytest's ``--junitxml``)."""
    results = []
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            outcome: Outcome = "failed"
        elif case.find("skipped") is not None:
            outcome = "skipped"
        else:
            outcome = "passed"
        results.append(TestResult(test_id, outcome))
    return results


def verdicts(results: Iterable[TestResult], kernels: Iterable[KernelSwitch] = KERNELS) -> dict[str, dict]:
    """Per kernel: ``failed`` if any of its tests failed, else ``passed`` if one passed, ``skipped`` if all were
    skipped, ``not run`` if the record has none; with the failed tests' ids and the counts."""
    results = list(results)
    out = {}
    for switch in kernels:
        mine = [r for r in results if switch.covers(r.id)]
        counts = {o: sum(r.outcome == o for r in mine) for o in ("passed", "failed", "skipped")}
        verdict: Verdict = (
            "failed" if counts["failed"] else "passed" if counts["passed"] else "skipped" if mine else "not run"
        )
        out[switch.kernel] = {
            "verdict": verdict,
            **counts,
            "failed_tests": [r.id for r in mine if r.outcome == "failed"],
        }
    return out


def switched_off(results: Iterable[TestResult], kernels: Iterable[KernelSwitch] = KERNELS) -> list[KernelSwitch]:
    """The kernels with a failed test."""
    found = verdicts(results, kernels)
    return [switch for switch in kernels if found[switch.kernel]["verdict"] == "failed"]


def attention_backend(off: Iterable[KernelSwitch], names: Iterable[str], requested: str = "auto") -> str:
    """``requested``, unless a failed backend could be chosen by it (its name, or ``auto``): then the first of
    ``ATTENTION_FALLBACKS`` that is one of ``names`` and did not fail."""
    failed = {switch.attention for switch in off if switch.attention is not None}
    if not failed or (requested != "auto" and requested not in failed):
        return requested
    return next(name for name in ATTENTION_FALLBACKS if name in set(names) and name not in failed)


def exports(off: Iterable[KernelSwitch]) -> str:
    """Shell lines that export the environment switches of ``off``."""
    return "".join(f"export {k}={shlex.quote(v)}\n" for switch in off for k, v in switch.env.items())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["env", "summary"])
    parser.add_argument("record", type=Path, help="pytest's --junitxml record of pytest -m gpu")
    args = parser.parse_args(argv)
    if not args.record.exists():  # (pytest did not get as far as writing it: nothing is known to have failed)
        print("# no record of the GPU tests" if args.what == "env" else f"no record at {args.record}")
        return
    results = read_junit(args.record)
    if args.what == "env":
        print(exports(switched_off(results)), end="")
        return
    for kernel, verdict in verdicts(results).items():
        failed = f": {', '.join(verdict['failed_tests'])}" if verdict["failed_tests"] else ""
        print(f"{kernel}: {verdict['verdict']} ({verdict['passed']} passed, {verdict['skipped']} skipped){failed}")


if __name__ == "__main__":
    main()
