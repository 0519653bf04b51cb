"""app/serve.py through ``longstraw serve``: a run directory and the model directory ``longstraw export`` made of it,
each served by the console script on a free port, answer the official ``openai`` client (chat and completions) with
the same tokens, and stop on SIGINT; the limits flags bound requests and a run's context bounds its server;
transformers prints nothing while the model loads; what cannot be served fails with exit 2 and one line saying
why."""

from __future__ import annotations

import json
import re
import select
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import torch
from hf_checkpoints import save_tiny_llama
from terminal import sigint_as_in_a_terminal
from tiny_runs import checkpoint_weights, tiny_config

from longstraw_agents.app.export import export_hf
from longstraw_agents.app.serve import load_policy, policy_server
from longstraw_agents.app.training import train
from longstraw_agents.cli import main
from longstraw_agents.serving import ServingLimits
from longstraw_agents.trainer import GRPOTrainer

LONGSTRAW = Path(sys.executable).with_name("longstraw")
STARTUP_S = 120  # imports and the model load: 7-12 s measured on a busy 2-core machine
ASK = [{"role": "user", "content": "What is 2+3?"}]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One GRPO step of a tiny run (weight decay moves the weights: its checkpoint is not the init)."""
    trainer = {"group_size": 4, "lr": 1e-2, "weight_decay": 0.5}
    return train(tiny_config(tmp_path_factory.mktemp("serve") / "run", steps=1, groups_per_step=1, trainer=trainer))


@pytest.fixture(scope="module")
def model_dir(run_dir: Path) -> Path:
    return export_hf(run_dir, run_dir.parent / "hf")


@dataclass
class Served:
    """A ``longstraw serve`` subprocess, a client of the URL it printed, and its banner's line of limits."""

    process: subprocess.Popen[str]
    api: openai.OpenAI
    limits: str


@contextmanager
def longstraw_serve(path: Path, *flags: str) -> Iterator[Served]:
    """``longstraw serve PATH --port 0`` (and ``flags``) as a subprocess, once its banner is printed."""
    command = [str(LONGSTRAW), "serve", str(path), "--port", "0", "--device", "cpu", *flags]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=sigint_as_in_a_terminal
    )
    try:
        assert process.stdout is not None and process.stderr is not None
        ready, _, _ = select.select([process.stdout], [], [], STARTUP_S)
        banner = process.stdout.readline() if ready else ""
        url = re.search(r"(http://\S+)/v1 ", banner)
        assert url, f"no URL in {banner!r}; stderr: {'' if process.poll() is None else process.stderr.read()}"
        limits = process.stdout.readline()  # printed with the first line
        api = openai.OpenAI(base_url=url[1] + "/v1", api_key="unused", max_retries=0, timeout=60)
        yield Served(process, api, limits)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def stop_with_ctrl_c(process: subprocess.Popen[str]) -> None:
    """SIGINT, as Ctrl-C sends it: the exit code is 130 and stderr says only that it stopped (no traceback, no
    transformers progress bar or warning)."""
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=30)
    assert process.returncode == 130, err
    assert err == "stopped\n"


def chat_ids(api: openai.OpenAI, model: str) -> list[int]:
    """The ids of a seeded chat reply (vLLM's ``return_tokens_as_token_ids`` labels each logprob token by id)."""
    chat = api.chat.completions.create(
        model=model, messages=ASK, max_tokens=8, seed=3, logprobs=True, extra_body={"return_tokens_as_token_ids": True}
    )
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content
    return [int(entry.token.removeprefix("token_id:")) for entry in content]


# The console script imports torch, transformers and the app layer (5-8 s; 12 s on a busy 2-core machine) before
# it loads the model: slow, though the request and the stop take well under a second.
@pytest.mark.slow
def test_serving_a_run_directory_answers_chat_and_completions_then_stops_on_ctrl_c(run_dir: Path) -> None:
    """With the limits flags too: the banner's second line says them, and a request beyond them is a 400."""
    version = GRPOTrainer.checkpoint_info(run_dir / "checkpoint")["policy_version"]
    flags = ("--max-tokens", "8", "--memory-budget", "512M", "--queue-timeout", "5")
    with longstraw_serve(run_dir, *flags) as served:
        api = served.api
        [model] = api.models.list().data
        assert model.id == str(run_dir)
        chat = api.chat.completions.create(model=model.id, messages=ASK, max_tokens=8, seed=1)
        assert chat.choices[0].message.role == "assistant"
        assert chat.to_dict()["metadata"] == {"weight_version": str(version)}  # the checkpoint's policy version
        completion = api.completions.create(model=model.id, prompt="Hello", max_tokens=4, seed=1)
        assert completion.usage is not None and completion.usage.completion_tokens >= 1
        with pytest.raises(openai.BadRequestError, match=r"9 is more than this server allows \(8: longstraw serve"):
            api.completions.create(model=model.id, prompt="Hello", max_tokens=9)
        assert served.limits.startswith("limits: max_tokens 8 (--max-tokens), context 1,048,576, memory budget 0.48")
        stop_with_ctrl_c(served.process)


@pytest.mark.slow  # the console script's start, as above
def test_serving_the_export_of_a_run_answers_as_the_run_does(run_dir: Path, model_dir: Path) -> None:
    policy = load_policy(run_dir, device="cpu")
    with policy_server(policy, port=0, model_name="run", model_path=str(run_dir)) as in_process:
        api = openai.OpenAI(base_url=in_process.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        expected = chat_ids(api, "run")
    with longstraw_serve(model_dir) as served:
        assert chat_ids(served.api, str(model_dir)) == expected  # same weights, same tokenizer, same prompt ids
        stop_with_ctrl_c(served.process)  # loading the model directory printed no "Loading weights" bar


def test_loading_a_model_directory_prints_no_progress_bar(model_dir: Path, capfd: pytest.CaptureFixture[str]) -> None:
    from transformers.utils import logging as hf_logging

    load_policy(model_dir, device="cpu")
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")  # transformers' "Loading weights" bar went to stderr before
    assert hf_logging.is_progress_bar_enabled()  # and the bars are back on for whatever runs next in the process


def test_a_runs_context_limit_bounds_what_its_server_serves(run_dir: Path) -> None:
    policy = load_policy(run_dir, device="cpu")
    policy.max_context = 40  # as the run's model.max_context would set it
    with policy_server(policy, port=0, model_name="run", model_path=str(run_dir)) as server:
        assert server.context == 40 and server.limits.max_tokens == 16_384
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="context is 40 tokens"):
            api.completions.create(model="run", prompt=[5, 6], max_tokens=39)
    limits = ServingLimits(max_tokens=8, context=100)
    with policy_server(policy, port=0, model_name="run", model_path=str(run_dir), limits=limits) as server:
        assert server.context == 100 and server.limits.max_tokens == 8


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--max-tokens", "0", "not a positive integer: '0'"),
        ("--memory-budget", "lots", "not a size: 'lots'"),
        ("--memory-budget", "0", "not a positive size: '0'"),
        ("--queue-timeout", "-1", "not a positive number: '-1'"),
    ],
)
def test_bad_limits_flags_fail_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, says: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", str(tmp_path), flag, value])
    assert exit_info.value.code == 2 and f"{flag}: {says}" in capsys.readouterr().err


def test_a_queue_timeout_beyond_a_day_fails_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", str(tmp_path), "--queue-timeout", "1e9"]) == 2
    assert capsys.readouterr().err == "error: serve: queue_timeout_s: Input should be less than or equal to 86400\n"


def test_a_run_is_served_with_its_checkpoint_tokenizer_and_sampling(run_dir: Path) -> None:
    policy = load_policy(run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    saved = checkpoint_weights(run_dir)
    for name, param in policy.model.named_parameters():
        assert torch.equal(param, saved[name]), name
    assert policy.tokenizer.name == "longstraw-bpe-v1" and policy.sampling.max_new_tokens == 24
    assert config["sampling"]["max_new_tokens"] == 24
    assert policy.policy_version == GRPOTrainer.checkpoint_info(run_dir / "checkpoint")["policy_version"]


def test_a_missing_directory_fails_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {tmp_path / 'nowhere'}: no such directory (give a Hugging Face model directory or a run " + (
        "directory)\n"
    )


def test_a_directory_without_config_json_is_neither_kind(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", str(tmp_path)]) == 2
    assert (
        "neither a Hugging Face model directory nor a run directory: it has no config.json" in capsys.readouterr().err
    )


def test_a_model_directory_without_a_tokenizer_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_tiny_llama(tmp_path, vocab_size=300)
    capsys.readouterr()  # what saving it printed
    assert main(["serve", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path} has no tokenizer (tokenizer.json)" in err and err.count("\n") == 1


def test_a_run_without_a_checkpoint_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(tiny_config(tmp_path).model_dump_json())
    assert main(["serve", str(tmp_path)]) == 2
    assert "is not a GRPOTrainer checkpoint" in capsys.readouterr().err


def test_a_run_config_that_does_not_load_names_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"steps": "many"}))
    assert main(["serve", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "config.json is not a run config" in err and "steps" in err


def test_a_device_that_is_not_there_fails_clearly(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", str(model_dir), "--device", "tpu:x"]) == 2
    assert "error: device 'tpu:x':" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["serve", str(model_dir), "--device", "cuda"]) == 2
        assert "no GPU is visible" in capsys.readouterr().err


def test_a_port_in_use_fails_clearly(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with closing(socket.socket()) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", str(model_dir), "--port", str(port), "--device", "cpu"]) == 2
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in capsys.readouterr().err
