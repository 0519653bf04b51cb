"""``CompletionServer`` (serving.py) on its own: vLLM's completions response shape over a tiny model, the request's
sampling fields honoured, clear 4xx answers for bad requests and unknown routes."""

from __future__ import annotations

import httpx
import pytest
import torch

from longstraw_agents.models.presets import tiny_model
from longstraw_agents.sampler import SamplingConfig
from longstraw_agents.serving import CompletionServer
from longstraw_agents.torch_sampler import TorchSampler

STOP = 7


@pytest.fixture(scope="module")
def server():
    model = tiny_model("llama", dtype=torch.float64)
    with CompletionServer(TorchSampler(model, [STOP], SamplingConfig()), model_name="tiny") as running:
        yield running


def post(server: CompletionServer, body: object, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_response_has_the_completions_shape_with_token_ids_and_logprobs(server: CompletionServer) -> None:
    response = post(server, {"prompt": [3, 4, 5], "max_tokens": 4, "temperature": 0.0, "stop_token_ids": [255]})
    assert response.status_code == 200
    payload = response.json()
    assert payload["object"] == "text_completion" and payload["model"] == "tiny"
    choice = payload["choices"][0]
    ids = [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
    assert len(ids) == len(choice["logprobs"]["token_logprobs"]) == 4 and choice["finish_reason"] == "length"
    assert all(lp <= 0.0 for lp in choice["logprobs"]["token_logprobs"])
    assert payload["usage"] == {"prompt_tokens": 3, "completion_tokens": 4}
    again = post(server, {"prompt": [3, 4, 5], "max_tokens": 4, "temperature": 0.0, "stop_token_ids": [255]})
    assert again.json()["choices"] == payload["choices"]  # greedy decoding is deterministic


def test_a_stop_token_of_the_request_ends_the_completion(server: CompletionServer) -> None:
    greedy = {"prompt": [3, 4, 5], "max_tokens": 4, "temperature": 0.0, "stop_token_ids": [255]}
    first = int(post(server, greedy).json()["choices"][0]["logprobs"]["tokens"][0].split(":")[1])
    stopped = post(server, {**greedy, "stop_token_ids": [first]}).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["logprobs"]["tokens"] == [f"token_id:{first}"]


def test_seeded_requests_repeat_and_differ_by_seed(server: CompletionServer) -> None:
    body = {"prompt": [9, 8, 7, 6], "max_tokens": 8, "temperature": 1.0, "stop_token_ids": [255]}

    def tokens(seed: int) -> list[str]:
        return post(server, {**body, "seed": seed}).json()["choices"][0]["logprobs"]["tokens"]

    assert tokens(1) == tokens(1)
    assert len({tuple(tokens(seed)) for seed in range(4)}) > 1


@pytest.mark.parametrize(
    "body",
    [{"prompt": []}, {"prompt": "text"}, {"prompt": [1, "2"]}, {"prompt": [1], "max_tokens": "many"}, {}],
    ids=["empty", "text", "mixed", "bad-max-tokens", "no-prompt"],
)
def test_bad_requests_get_400_with_a_message(server: CompletionServer, body: dict) -> None:
    response = post(server, body)
    assert response.status_code == 400 and response.json()["error"]["message"]


def test_unknown_route_is_404(server: CompletionServer) -> None:
    response = post(server, {"prompt": [1]}, path="/v1/chat/completions")
    assert response.status_code == 404 and "/v1/chat/completions" in response.json()["error"]["message"]
