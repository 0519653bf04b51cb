"""``OpenAISampler`` (sampler.py) against a loopback server that serves a tiny model: token ids and behaviour
logprobs equal in-process sampling, per-request seeds, retries, clear errors."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from longstraw_agents.models.presets import tiny_model
from longstraw_agents.sampler import OpenAISampler, SamplerError, SamplingConfig
from longstraw_agents.serving import CompletionServer
from longstraw_agents.torch_sampler import TorchSampler

STOP = 7


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3_5", dtype=torch.float64)


@contextlib.contextmanager
def served(model: torch.nn.Module, config: SamplingConfig) -> Iterator[OpenAISampler]:
    """An `OpenAISampler` of a loopback server that samples ``model`` in process with ``config``."""
    with CompletionServer(TorchSampler(model, [STOP], config)) as server:
        remote = OpenAISampler(server.url, [STOP], config, max_retries=1, backoff_s=0.01)
        try:
            yield remote
        finally:
            remote.close()


def test_openai_sampler_against_loopback_server(model):
    config = SamplingConfig(max_new_tokens=6, temperature=0.0)
    local = TorchSampler(model, [STOP], config)
    with served(model, config) as remote:
        handle = remote.fork([5, 6, 7, 8], 1)[0]
        gen = remote.generate(handle)
        remote.append(handle, [9, 10])
        gen2 = remote.generate(handle)
    lh = local.fork([5, 6, 7, 8], 1)[0]
    expected = local.generate(lh)
    local.append(lh, [9, 10])
    expected2 = local.generate(lh)
    assert gen.token_ids == expected.token_ids and gen2.token_ids == expected2.token_ids
    assert gen.logprobs == pytest.approx(expected.logprobs, abs=1e-9)
    assert handle.token_ids == [5, 6, 7, 8, *gen.token_ids, 9, 10, *gen2.token_ids]


def test_an_edited_context_is_what_the_next_request_sends(model):
    """After the environment edits the context, the served policy continues from the edited context exactly as
    in-process sampling does after ``TorchSampler.replace``."""
    config = SamplingConfig(max_new_tokens=5, temperature=0.0)
    local = TorchSampler(model, [STOP], config)
    with served(model, config) as remote:
        handle = remote.fork([5, 6, 7, 8], 1)[0]
        gen = remote.generate(handle)
        edited = [5, 6, 7, 8, 30, 31, 32]  # the turn replaced by a summary
        with pytest.raises(ValueError, match="does not start with the 5 tokens it is said to keep"):
            remote.replace(handle, [5, 6, 7, 9, 30], 5)
        remote.replace(handle, edited, 4)
        after = remote.generate(handle)
    lh = local.fork([5, 6, 7, 8], 1)[0]
    assert local.generate(lh).token_ids == gen.token_ids
    local.replace(lh, edited, 4)
    expected = local.generate(lh)
    assert after.token_ids == expected.token_ids and after.logprobs == pytest.approx(expected.logprobs, abs=1e-9)
    assert handle.token_ids == [*edited, *after.token_ids]


def test_openai_group_members_differ_and_runs_reproduce(model):
    """Every request carries its own seed (derived from the config's): the members of a group, which share their
    prompt, must not come back identical at temperature 1 (zero advantages), and the same base seed repeats them."""
    config = SamplingConfig(max_new_tokens=8, temperature=1.0, seed=5)

    def group(server: CompletionServer, seed: int) -> list[tuple[int, ...]]:
        remote = OpenAISampler(server.url, [STOP], config.model_copy(update={"seed": seed}), max_retries=0)
        outputs = [tuple(remote.generate(h).token_ids) for h in remote.fork([5, 6, 7, 8], 4)]
        remote.close()
        return outputs

    with CompletionServer(TorchSampler(model, [STOP], config)) as server:
        first, again, other = group(server, 5), group(server, 5), group(server, 6)
    assert len(set(first)) > 1
    assert again == first and other != first


def test_openai_batch_sends_concurrent_requests_that_draw_what_one_by_one_draws(model):
    """``generate_batch`` (what rollouts use: a server batches concurrent requests) gives each member the seed that
    ``generate`` called member by member gives it, so both draw the same tokens."""
    config = SamplingConfig(max_new_tokens=6, temperature=1.0, seed=9)
    with CompletionServer(TorchSampler(model, [STOP], config)) as server:
        batched = OpenAISampler(server.url, [STOP], config, max_retries=0, max_concurrency=3)
        together = batched.generate_batch(batched.fork([5, 6, 7], 4), [6, 3, 6, 6])
        single = OpenAISampler(server.url, [STOP], config, max_retries=0)
        handles = single.fork([5, 6, 7], 4)
        one_by_one = [single.generate(h, limit) for h, limit in zip(handles, [6, 3, 6, 6], strict=True)]
        batched.close()
        single.close()
    assert [g.token_ids for g in together] == [g.token_ids for g in one_by_one]
    assert len(together[1].token_ids) <= 3 and len({tuple(g.token_ids) for g in together}) > 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_down_retries_then_clear_error():
    sampler = OpenAISampler(f"http://127.0.0.1:{free_port()}", [STOP], max_retries=2, backoff_s=0.01, timeout_s=1)
    with pytest.raises(SamplerError, match="after 3 attempts"):
        sampler.generate(sampler.fork([1, 2], 1)[0])


class FlakyHandler(BaseHTTPRequestHandler):
    """Fails with 503 a given number of times, then answers; or answers garbage."""

    failures_left = 0
    garbage = False
    calls = 0

    def do_POST(self):  # noqa: N802
        type(self).calls += 1
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if type(self).failures_left > 0:
            type(self).failures_left -= 1
            status, payload = 503, {"error": "busy"}
        elif type(self).garbage:
            status, payload = 200, {"choices": [{"logprobs": {"tokens": ["hello"], "token_logprobs": [0.0]}}]}
        else:
            logprobs = {"tokens": ["token_id:3", "token_id:7"], "token_logprobs": [-0.5, -0.1]}
            status, payload = 200, {"choices": [{"finish_reason": "stop", "logprobs": logprobs}]}
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def flaky_server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FlakyHandler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    FlakyHandler.failures_left, FlakyHandler.garbage, FlakyHandler.calls = 0, False, 0
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_transient_server_errors_are_retried(flaky_server):
    FlakyHandler.failures_left = 2
    sampler = OpenAISampler(flaky_server, [STOP], max_retries=3, backoff_s=0.01)
    gen = sampler.generate(sampler.fork([1], 1)[0])
    assert gen.token_ids == [3, 7] and gen.logprobs == [-0.5, -0.1] and gen.finish_reason == "stop"
    assert FlakyHandler.calls == 3


def test_malformed_response_is_a_clear_error(flaky_server):
    FlakyHandler.garbage = True
    sampler = OpenAISampler(flaky_server, [STOP], max_retries=0)
    with pytest.raises(SamplerError, match="token_id"):
        sampler.generate(sampler.fork([1], 1)[0])
