"""``longstraw train`` on two "nodes" of one machine, as a cluster runs it: one launcher per node with ``--nnodes 2``
(torchrun and its c10d rendezvous on localhost, then accelerate launch's multi-machine options), 2 processes each,
dp 2 x cp 2 with FSDP2 on gloo. A run passes a tool call longer than ``parallel.timeout_s``, loses node 1 (its
launcher's process group killed) and ends on every surviving process with a ``RankFailure`` naming node 1's ranks,
leaving a whole checkpoint and store; it resumes to a third step and ends with the weights of one process trained on
the same groups. A node whose processes never join, and a node that sees another directory under the run
directory's path, stop the run on every node with an error naming them, before any step."""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import slow_env
import torch
import yaml
from paths import REPO
from tiny_runs import checkpoint_weights, tiny_config_dict

from longstraw_agents.app.config import TrainConfig, check_model, check_tokenizer, load_config
from longstraw_agents.app.run import build_policy
from longstraw_agents.app.seeds import task_seed
from longstraw_agents.store import Store
from longstraw_agents.trainer import GRPOTrainer

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # each test starts 4 workers and 2 launchers: 20-60 s

NODES, PER_NODE = 2, 2
HOST = socket.gethostname()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _torchrun(node: int, port: int) -> list[str]:
    """One node's torchrun: the c10d rendezvous on localhost, hosted by node 0's launcher."""
    return [
        *("-m", "torch.distributed.run", "--nnodes", str(NODES), "--nproc-per-node", str(PER_NODE)),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"job{port}"),
        *("--rdzv-conf", f"is_host={int(node == 0)}", "--max-restarts", "0"),
    ]


def _accelerate(node: int, port: int) -> list[str]:
    """One machine's accelerate launch (``--num_processes``: of the whole job; the main process on machine 0)."""
    return [
        *("-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", str(NODES), "--machine_rank", str(node)),
        *("--num_processes", str(NODES * PER_NODE), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port)),
        *("--mixed_precision", "no", "--dynamo_backend", "no"),
    ]


LAUNCHERS = {"torchrun": _torchrun, "accelerate": _accelerate}


@dataclass
class Node:
    """One node's launcher, started in a session of its own, and its logs."""

    process: subprocess.Popen[str]
    out: Path
    err: Path

    def finish(self, timeout: float = 300) -> tuple[int, str, str]:
        """Its return code, stdout and stderr once it ends (killed with its process group after ``timeout``)."""
        try:
            code = self.process.wait(timeout=timeout)
        finally:
            self.kill()
        return code, self.out.read_text(), self.err.read_text()

    def kill(self) -> None:
        """``kill -9`` of the launcher's process group; torchrun's workers, in sessions of their own, end with their
        launcher (``parallel.liveness``)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def _start_nodes(
    tmp_path: Path, launcher: str, train_args: list[list[str]], cwds: list[Path] | None = None
) -> list[Node]:
    """``longstraw train`` on every node at once (node n with ``train_args[n]``, in ``cwds[n]``); tests/support on
    the workers' path (``slow_env``)."""
    port = _free_port()
    path = os.pathsep.join([str(REPO / "tests" / "support"), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path}  # gloo on CPU
    nodes = []
    for node in range(NODES):
        command = [sys.executable, *LAUNCHERS[launcher](node, port), "-m", "longstraw_agents.cli", "train"]
        out, err = (tmp_path / f"{launcher}-node{node}-{port}.{kind}" for kind in ("out", "err"))
        with out.open("w") as stdout, err.open("w") as stderr:  # files: a full pipe would stall a launcher
            process = subprocess.Popen(
                command + train_args[node],
                stdout=stdout,
                stderr=stderr,
                text=True,
                env=env,
                cwd=None if cwds is None else cwds[node],
                start_new_session=True,
            )
        nodes.append(Node(process, out, err))
    return nodes


def _launch_nodes(
    tmp_path: Path, launcher: str, train_args: list[list[str]], cwds: list[Path] | None = None
) -> list[tuple[int, str, str]]:
    """``_start_nodes``, then each launcher's (return code, stdout, stderr). On a timeout every process of both
    nodes is killed."""
    nodes = _start_nodes(tmp_path, launcher, train_args, cwds)
    try:
        return [node.finish() for node in nodes]
    finally:
        for node in nodes:
            node.kill()


def _errors(stderr: str) -> list[str]:
    """The one-line errors the CLI printed (one per process of the node)."""
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def _one_process(config: TrainConfig, steps: int) -> dict[str, torch.Tensor]:
    """The run's initial policy trained in this process on every group the run stored, step by step (dp rank 0's
    groups then dp rank 1's): the weights one process holding all of them ends with."""
    vocab_size = check_tokenizer(config.tokenizer).vocab_size
    model = build_policy(config.model, check_model(config.model, vocab_size), config.seed)
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    trainer = GRPOTrainer(model, config.trainer, ref_model=reference)
    with Store.open(Path(config.output_dir) / "trajectories.db", create=False) as store:
        groups = store.groups()
    for step in range(1, steps + 1):
        trainer.train_step([trainer.group_from_trajectories(groups[f"step{step}-dp{r}-g0"]) for r in range(2)])
    return {name: t.detach().clone() for name, t in trainer.model.state_dict().items()}


TIMEOUT_S = 6.0  # parallel.timeout_s: a process silent this long is dead
SLOW_TOOL_S = 1.5 * TIMEOUT_S  # a tool call longer than it, in step 1
STUCK_S = 300.0  # a tool call in step 3 that outlasts the test: node 1 is killed meanwhile


@pytest.mark.stops_a_rank("node 1 is killed in step 3")
def test_two_nodes_survive_a_slow_tool_end_on_a_lost_node_resume_and_equal_one_process(tmp_path: Path) -> None:
    """Node 1 is killed (``kill -9`` of its launcher's process group) while rank 0 is in a tool call of step 3: its
    processes end with their launcher, node 0's within ``timeout_s`` + 30 s, each naming node 1's ranks; the store
    and the checkpoint are whole, and the run resumes from them."""
    run_dir = tmp_path / "run"
    parallel = {"dp": 2, "cp": 2, "fsdp": True, "timeout_s": TIMEOUT_S, "heartbeat_s": 1.0}
    settings: dict[str, Any] = tiny_config_dict(run_dir, parallel=parallel, steps=3)
    settings["model"] = {**settings["model"], "dtype": "float64", "max_context": 1024}
    # A random-init policy solves nothing: every advantage is zero. Strong weight decay moves the policy off the KL
    # reference in the first step, so that from the second on the gradient is the KL's over every sampled token.
    # Adam's epsilon at 1 keeps the update linear in small gradients: at 1e-8, a gradient entry near zero would turn
    # a 1e-14 rounding difference (the context sharded over cp ranks sums in another order) into lr / 1e-8 times it.
    trainer = {"lr": 0.1, "weight_decay": 1.0, "adam_epsilon": 1.0, "beta": 1.0}
    settings["trainer"] = {**settings["trainer"], **trainer}
    pauses = {task_seed(0, 0, 0): SLOW_TOOL_S, task_seed(0, 2, 0): STUCK_S}  # dp rank 0's group, on rank 0
    slow = {"id": f"slow_env:{slow_env.ENV_ID}", "kwargs": {**settings["env"]["kwargs"], "pauses": pauses}}
    config_path, resume_path = tmp_path / "train.yaml", tmp_path / "resume.yaml"
    config_path.write_text(yaml.safe_dump({**settings, "env": slow}))
    resume_path.write_text(yaml.safe_dump({**settings, "env": {**slow, "kwargs": {**slow["kwargs"], "pauses": {}}}}))

    node0, node1 = _start_nodes(tmp_path, "torchrun", [[str(config_path)]] * NODES)
    try:
        _wait_for(node0.out, "step    2 ", node0)
        node1.kill()
        code0, out0, err0 = node0.finish(timeout=TIMEOUT_S + 30)  # every surviving process ended by then
        _, _, err1 = node1.finish()
    finally:
        node0.kill()
        node1.kill()
    assert code0 != 0 and out0.count("step    1 ") == 1  # the writer alone prints
    # Node 0's processes name node 1's ranks: gone (a collective's connection closed) or silent (no heartbeat);
    # torchrun stops a node's other worker as soon as one exits, so on busy cores one may go before it prints.
    errors = _errors(err0)
    assert 1 <= len(errors) <= PER_NODE, err0[-3000:]
    node1_ranks = rf"ranks? [23](, 3)? \(node 1, host {HOST}\)"
    for error in errors:
        assert re.match(
            rf"error: training step 3: rank [01] \(node 0, host {HOST}\) gave up on the other ranks: ", error
        )
        assert re.search(rf"{node1_ranks} (is gone|are gone|sent no heartbeat)", error), error
        assert error.split(" Backend error")[0].endswith("resume with --resume.")
    # Node 1's processes ended with their launcher instead of training on, orphaned.
    assert any(re.search(rf"rank [23] \(node 1, host {HOST}\) lost its launcher", e) for e in _errors(err1)), err1

    # The tool call of step 1, longer than timeout_s, failed nothing; the store and the checkpoint are whole.
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2] and lines[0]["rollout_seconds"] >= SLOW_TOOL_S
    with sqlite3.connect(run_dir / "trajectories.db") as db:
        assert db.execute("pragma integrity_check").fetchone() == ("ok",)
    with Store.open(run_dir / "trajectories.db", create=False) as store:
        stored = {group: len(members) for group, members in store.groups().items()}
    assert stored == {f"step{s}-dp{r}-g0": 4 for s in (1, 2) for r in range(2)}
    saved = GRPOTrainer.checkpoint_info(run_dir / "checkpoint")["step"]
    assert saved in (1, 2)  # step 2's, unless the kill cut its save short (then step 1's, whole)

    resumed = _launch_nodes(tmp_path, "accelerate", [[str(resume_path), "--resume", "--steps", "3"]] * NODES)
    for code, _, err in resumed:
        assert code == 0, err[-3000:]
    assert [out.count("run directory:") for _, out, _ in resumed] == [1, 0]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3] if saved == 2 else [1, 2, 2, 3]  # step 2 run again
    assert all(line["grad_norm"] > 1e-3 for line in lines[1:])  # the KL's gradient: the sampled tokens count
    with Store.open(run_dir / "trajectories.db", create=False) as store:
        assert sorted(store.groups()) == [f"step{s}-dp{r}-g0" for s in range(1, 4) for r in range(2)]
    checkpoint = {p.name for p in (run_dir / "checkpoint").iterdir()}
    assert {f"random_states_{r}.pkl" for r in range(NODES * PER_NODE)} <= checkpoint

    expected = _one_process(load_config(config_path), steps=3)
    got = checkpoint_weights(run_dir)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert (got[name] - tensor).abs().max() <= 1e-10, name


def _wait_for(path: Path, text: str, node: Node, timeout: float = 300) -> None:
    """Until ``text`` is in the file at ``path`` (its node still running)."""
    deadline = time.monotonic() + timeout
    while text not in path.read_text():
        assert node.process.poll() is None, f"the node ended before printing {text!r}"
        assert time.monotonic() < deadline, f"no {text!r} within {timeout} s"
        time.sleep(0.1)


def test_a_node_whose_processes_never_join_stops_the_others(tmp_path: Path) -> None:
    """Node 1's launcher joins the rendezvous, but its processes exit before joining the job (the config is not on
    that node): node 0's processes name them after ``parallel.timeout_s`` and write nothing."""
    run_dir = tmp_path / "run"
    config_path = tmp_path / "train.yaml"
    config_path.write_text(yaml.safe_dump(tiny_config_dict(run_dir, parallel={"dp": 2, "cp": 2, "timeout_s": 3})))
    (node0, _, err0), (node1, _, err1) = _launch_nodes(
        tmp_path, "torchrun", [[str(config_path)], [str(tmp_path / "elsewhere.yaml")]]
    )
    assert node0 != 0 and node1 != 0
    assert "does not exist" in _errors(err1)[0]
    # Each of node 0's processes that reaches its timeout prints one line; on a busy machine one may still be on
    # its way to the roster when the first gives up, and torchrun then stops it before it prints (the slow one
    # is then named beside node 1's ranks)
    errors = _errors(err0)
    assert 1 <= len(errors) <= PER_NODE, err0[-3000:]
    for error in errors:
        assert re.search(rf"rank [0-{PER_NODE - 1}] \(node 0, host {HOST}\) waited parallel.timeout_s=3 s", error)
        late = r"(rank \d \(node 0\); )?"
        assert re.search(rf"for the job's 4 processes to join: {late}ranks 2, 3 \(node 1\) did not", error)
    assert not run_dir.exists()


def test_a_node_that_sees_another_run_directory_stops_every_node(tmp_path: Path) -> None:
    """A relative output_dir, and each node's launcher in a directory of its own: the same path names two
    directories, as a node-local disk would. Every node stops before any step, naming node 1's ranks; rank 0's
    directory, made for the run, is removed again and node 1's is left as it was."""
    config_path = tmp_path / "train.yaml"
    config_path.write_text(yaml.safe_dump(tiny_config_dict("run", parallel={"dp": 2, "cp": 2})))
    cwds = [tmp_path / f"node{node}" for node in range(NODES)]
    for cwd in cwds:
        cwd.mkdir()
    (cwds[1] / "run").mkdir()
    nodes = _launch_nodes(tmp_path, "torchrun", [[str(config_path)]] * NODES, cwds=cwds)
    for code, _, err in nodes:
        assert code != 0
        errors = _errors(err)
        # (torchrun stops a node's other workers as soon as one exits: on busy cores one may go before it prints)
        assert 1 <= len(errors) <= PER_NODE, err[-3000:]
        for error in errors:
            assert "output_dir run must be one directory that every node sees" in error
            assert f"do not see rank 0's {cwds[0] / 'run'}: ranks 2, 3 (node 1, host {HOST}): " in error
            assert f"{cwds[1] / 'run'} is another directory there" in error
    assert not (cwds[0] / "run").exists() and not list((cwds[1] / "run").iterdir())
