"""A minimal OpenAI-compatible completions server over ``TorchSampler`` (token-id prompts, vLLM's response shape).

It exists so that ``OpenAISampler`` can be tested end to end on one machine, and to serve a tiny local policy
to tools that speak the OpenAI API. Bind it to loopback only; it is single-model and serialises requests.

>>> server = CompletionServer(TorchSampler(model, stop_token_ids=[eos]))
>>> server.start()          # serves http://127.0.0.1:<server.port>/v1/completions
>>> server.stop()
"""

from __future__ import annotations

import json
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from longstraw_agents.sampler import SamplingConfig
from longstraw_agents.torch_sampler import TorchSampler


class CompletionServer:
    def __init__(self, sampler: TorchSampler, host: str = "127.0.0.1", port: int = 0, model_name: str = "default"):
        self.sampler = sampler
        self.model_name = model_name
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer((host, port), self._handler())
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        host = self._httpd.server_address[0]
        assert isinstance(host, str)  # the name of an AF_INET socket is (host, port)
        return f"http://{host}:{self.port}"

    def start(self) -> CompletionServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> CompletionServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) for t in prompt):
            raise ValueError("prompt must be a non-empty list of token ids")
        config = SamplingConfig(
            temperature=float(body.get("temperature", 1.0)),
            top_p=float(body.get("top_p", 1.0)),
            max_new_tokens=int(body.get("max_tokens", 16)),
            seed=_seed(body.get("seed")),
        )
        stop = body.get("stop_token_ids") or sorted(self.sampler.stop_token_ids)
        with self._lock:
            sampler = TorchSampler(self.sampler.engine, stop, config, policy_version=self.sampler.policy_version)
            generation = sampler.complete(prompt)
        return {
            "object": "text_completion",
            "model": self.model_name,
            "choices": [
                {
                    "index": 0,
                    "text": "",
                    "finish_reason": generation.finish_reason,
                    "logprobs": {
                        "tokens": [f"token_id:{t}" for t in generation.token_ids],
                        "token_logprobs": generation.logprobs,
                    },
                }
            ],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(generation.token_ids)},
        }

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                if self.path.rstrip("/") != "/v1/completions":
                    self._send(404, {"error": {"message": f"no route {self.path}"}})
                    return
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                    self._send(200, server.complete(body))
                except (ValueError, TypeError) as err:
                    self._send(400, {"error": {"message": str(err)}})

            def _send(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:  # keep test output clean
                pass

        return Handler


def _seed(value: Any) -> int:
    """The request's seed; none (or null) means a fresh random one, as with the OpenAI API."""
    return secrets.randbits(31) if value is None else int(value)
