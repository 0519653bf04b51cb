"""``longstraw train --check`` (app/check.py): a dry run that exits 0 and says what would run when the configuration
would run, and exits 2 naming every setting at fault otherwise; it writes nothing and loads no weights.
examples/train_served.yaml fails only on its machine-specific settings and passes once they point at a local
checkpoint and a live server."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from hf_checkpoints import save_bpe_tokenizer, save_tiny_llama
from tiny_runs import tiny_config_dict

from longstraw_agents.cli import main
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.sampler import SamplingConfig
from longstraw_agents.serving import CompletionServer
from longstraw_agents.tokenizer import load_tokenizer
from longstraw_agents.torch_sampler import TorchSampler

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_served.yaml"


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(scope="module")
def server() -> Iterator[CompletionServer]:
    """A live server listing the example's model name (its weights do not matter to --check)."""
    sampler = TorchSampler(tiny_model("llama", hidden=32, layers=1), [1], SamplingConfig())
    with CompletionServer(sampler, model_name="qwen2.5-7b-instruct") as running:
        yield running


def check(tmp_path: Path, config: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``train --check`` of ``config``, without the memory plan it prints after the checks (a second each: tested in
    tests/app/test_job.py)."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    code = main(["train", "--check", "--no-plan", str(path)])
    out, err = capsys.readouterr()
    return code, out, err


def error_fields(err: str) -> set[str]:
    """The settings named by the error lines of a failed check."""
    lines = [line.strip() for line in err.splitlines()[1:] if line.startswith("  ")]
    return {line.split(":", 1)[0] for line in lines if not line.startswith("env.kwargs.")}


def test_a_runnable_config_exits_0_says_what_would_run_and_writes_nothing(tmp_path: Path, capsys) -> None:
    config = tiny_config_dict(tmp_path / "run")
    code, out, err = check(tmp_path, config, capsys)
    assert code == 0, err
    assert "OK, nothing was written" in out
    shown = ("LongStraw/Calculator-v0", "preset llama: llama", "parameters", "sampled in this process", "a new run")
    assert all(text in out for text in shown), out
    assert "2 steps of 2 groups x 4 episodes (16 episodes)" in out
    assert not (tmp_path / "run").exists()


def test_every_problem_is_reported_with_its_setting_and_exit_2(tmp_path: Path, capsys) -> None:
    config = tiny_config_dict(
        tmp_path / "run",
        env={"id": "LongStraw/NoSuchEnv-v0"},
        model={"path": str(tmp_path / "missing-model")},
        tokenizer=str(tmp_path / "missing-tokenizer"),
        policy={"served": {"base_url": closed_port_url()}},
    )
    code, _, err = check(tmp_path, config, capsys)
    assert code == 2
    assert error_fields(err) == {"env.id", "model.path", "tokenizer", "policy.served.base_url"}
    assert "no model directory at" in err and "no server answers at" in err
    assert not (tmp_path / "run").exists()

    code, _, err = check(tmp_path, {**config, "steps": "3"}, capsys)  # the schema comes first, as for training
    assert code == 2 and "steps: Input should be a valid integer" in err


def test_a_served_policy_is_checked_against_its_live_server(tmp_path: Path, server, capsys) -> None:
    served = {"base_url": server.url, "model": "qwen2.5-7b-instruct"}
    code, out, err = check(tmp_path, tiny_config_dict(tmp_path / "run", policy={"served": served}), capsys)
    assert code == 0, err
    assert f"served by {server.url} as 'qwen2.5-7b-instruct', weight version 0" in out
    assert "POST /update_weights_from_disk" in out and str(tmp_path / "run" / "served_weights") in out

    wrong = {**served, "model": "another"}
    code, _, err = check(tmp_path, tiny_config_dict(tmp_path / "run", policy={"served": wrong}), capsys)
    assert code == 2 and error_fields(err) == {"policy.served.model"}
    assert "serves ['qwen2.5-7b-instruct'], not 'another'" in err
    assert server.policy_version == 0  # the endpoint probe loaded nothing


def test_the_layout_is_checked_against_the_launch_as_train_checks_it_and_the_mesh_shown(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tiny_config_dict(tmp_path / "run", parallel={"dp": 2, "cp": 2, "fsdp": True})
    code, _, err = check(tmp_path, config, capsys)  # in one process, which `train` refuses
    assert code == 2 and error_fields(err) == {"parallel"}
    assert "parallel.dp (2) x parallel.cp (2) must equal the number of processes (WORLD_SIZE=1, without a" in err

    # Rank 0 of two nodes of 2 processes (torchrun's environment): the mesh; the other processes print nothing.
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    code, out, err = check(tmp_path, config, capsys)
    assert code == 0, err
    [shown] = [line.split(None, 1)[1] for line in out.splitlines() if line.strip().startswith("parallel ")]
    assert shown == (
        "dp 2 x cp 2 = 4 processes on 2 nodes of 2; mesh (a row per dp rank: its cp ranks) [[0, 1], "
        "[2, 3]], dp across the nodes; FSDP2 over all 4 ranks; a process without a heartbeat for 600 s (one every "
        "5 s) is dead, a collective waits up to 1800 s"
    )
    monkeypatch.setenv("RANK", "3")
    assert check(tmp_path, config, capsys)[:2] == (0, "")

    # cp groups of 3 on nodes of 2 processes would straddle them
    monkeypatch.setenv("WORLD_SIZE", "6")
    code, _, err = check(tmp_path, tiny_config_dict(tmp_path / "run", parallel={"dp": 2, "cp": 3}), capsys)
    assert code == 2 and error_fields(err) == {"parallel"} and "parallel.cp (3) does not fit nodes of 2" in err


def test_an_existing_run_needs_resume(tmp_path: Path, capsys) -> None:
    checkpoint = tmp_path / "run" / "checkpoint"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text("{}")
    code, _, err = check(tmp_path, tiny_config_dict(tmp_path / "run"), capsys)
    assert code == 2 and "output_dir:" in err and "--resume" in err


def resume_check(tmp_path: Path, steps_done: int, steps: int, capsys) -> str:
    checkpoint = tmp_path / "run" / "checkpoint"
    checkpoint.mkdir(parents=True, exist_ok=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": steps_done, "policy_version": steps_done}))
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(tiny_config_dict(tmp_path / "run", steps=steps)))
    assert main(["train", "--check", "--no-plan", "--resume", str(path)]) == 0
    return capsys.readouterr().out


def test_a_resumed_run_counts_the_steps_after_its_checkpoint(tmp_path: Path, capsys) -> None:
    out = resume_check(tmp_path, steps_done=3, steps=5, capsys=capsys)
    assert "resumed from its checkpoint at step 3" in out
    assert "2 steps (steps 4..5 of 5) of 2 groups x 4 episodes (16 episodes)" in out
    out = resume_check(tmp_path, steps_done=5, steps=5, capsys=capsys)
    assert "0 steps (the checkpoint has done all 5; raise steps to train further)" in out and "(0 episodes)" in out


def test_a_bad_env_setting_is_one_line_with_a_suggestion(tmp_path: Path, capsys) -> None:
    config = tiny_config_dict(tmp_path / "run", env={"id": "LongStraw/Calculator-v0", "kwargs": {"max_turnz": 2}})
    code, _, err = check(tmp_path, config, capsys)
    assert code == 2 and "Traceback" not in err
    assert "env.kwargs.max_turnz: Extra inputs are not permitted; did you mean 'max_turns'?" in err


def test_the_served_example_fails_only_on_its_machine_paths_then_passes(tmp_path: Path, server, capsys) -> None:
    example = yaml.safe_load(EXAMPLE.read_text())
    example["output_dir"] = str(tmp_path / "run")
    example["policy"]["served"]["base_url"] = closed_port_url()
    code, _, err = check(tmp_path, example, capsys)
    assert code == 2 and error_fields(err) == {"model.path", "tokenizer", "policy.served.base_url"}, err

    checkpoint = save_bpe_tokenizer(tmp_path / "checkpoint")
    save_tiny_llama(checkpoint, vocab_size=load_tokenizer(str(checkpoint)).vocab_size)
    example["model"]["path"] = example["tokenizer"] = str(checkpoint)
    example["policy"]["served"]["base_url"] = server.url
    files = sorted(checkpoint.iterdir())
    code, out, err = check(tmp_path, example, capsys)
    assert code == 0, err
    assert f"{checkpoint}: llama" in out and "bfloat16" in out and "weight version 0" in out
    assert sorted(checkpoint.iterdir()) == files and not (tmp_path / "run").exists()  # nothing written


def test_a_served_policy_config_is_refused_where_it_cannot_work(tmp_path: Path, capsys) -> None:
    """The schema: a served policy's URL is the server's root (a mesh may train it: tests/app/test_served.py)."""
    with_v1 = tiny_config_dict(tmp_path / "run", policy={"served": {"base_url": "http://h:1/v1"}})
    code, _, err = check(tmp_path, with_v1, capsys)
    assert code == 2 and "policy.served: " in err and "leave out the /v1" in err


class _ModelsOnly(BaseHTTPRequestHandler):
    """A completions server without weight updates (as vLLM's): it lists its model, every other route is a 404."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        found = self.path == "/v1/models"
        data = json.dumps({"object": "list", "data": [{"id": "m"}]} if found else {"detail": "Not Found"}).encode()
        self.send_response(200 if found else 404)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def test_a_server_that_cannot_load_weights_is_refused(tmp_path: Path, capsys) -> None:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _ModelsOnly)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        served = {"base_url": f"http://127.0.0.1:{httpd.server_address[1]}", "model": "m"}
        code, _, err = check(tmp_path, tiny_config_dict(tmp_path / "run", policy={"served": served}), capsys)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert code == 2 and error_fields(err) == {"policy.served.weight_sync"}
    assert "no POST /update_weights_from_disk" in err and "vLLM is not supported yet" in err


def test_a_summary_threshold_above_the_models_context_is_one_line_naming_it(tmp_path: Path, capsys) -> None:
    """The model's context caps the env's context budget; a summary threshold that no longer fits below it is
    refused by --check and by a run, in one line, before anything is written."""
    context = {"max_context_tokens": 4096, "strategy": {"kind": "summary", "threshold": 2560}}
    env = {"id": "LongStraw/NeedleSearch-v0", "kwargs": {"context": context}}
    model = {"preset": "llama", "overrides": {"hidden": 32, "layers": 1}, "max_context": 2048}
    config = tiny_config_dict(tmp_path / "run", env=env, model=model)
    code, _, err = check(tmp_path, config, capsys)
    assert code == 2 and "env: the summary threshold (2560) must be below max_context_tokens (2024)" in err
    assert "the model's context limit of 2048 tokens" in err
    assert main(["train", str(tmp_path / "config.yaml")]) == 2
    assert capsys.readouterr().err.startswith("error: the summary threshold (2560)")
    assert not (tmp_path / "run").exists()


def test_a_warm_start_drill_is_checked_against_the_env_and_the_models_context(tmp_path: Path, capsys) -> None:
    """The stages are listed when they can run; a drill for an env without one, or longer than the model's
    context, is one line naming the stage's setting."""
    drill = {"drill": [{"tokens": [10, 20], "sft": {"steps": 3, "batch_size": 2}}], "episodes": 4}
    page_recall = {"id": "LongStraw/PageRecall-v0", "kwargs": {"pages": 2, "page_tokens": 60}}
    code, out, err = check(tmp_path, tiny_config_dict(tmp_path / "run", env=page_recall, warm_start=drill), capsys)
    assert code == 0, err
    assert "warm start  drill 1: 3 steps x 2 documents of 10-20 tokens; 4 scripted episodes: 100 steps x 8" in out

    code, _, err = check(tmp_path, tiny_config_dict(tmp_path / "run", warm_start=drill), capsys)
    assert code == 2 and error_fields(err) == {"warm_start.drill"} and "CalculatorEnv has no drill" in err

    model = {"preset": "llama", "overrides": {"hidden": 32}, "max_context": 512}
    too_long = {**drill, "drill": [{"tokens": [10, 600]}]}
    config = tiny_config_dict(tmp_path / "run", env=page_recall, model=model, warm_start=too_long)
    code, _, err = check(tmp_path, config, capsys)
    assert code == 2 and error_fields(err) == {"warm_start.drill[0].tokens"}, err
