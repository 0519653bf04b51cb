"""``longstraw serve``: a policy behind the OpenAI-compatible server (``serving.CompletionServer``), with the chat
format the environments train with (``QwenChatTemplate``) on ``/v1/chat/completions``.

What is served comes from one directory:

- a Hugging Face model directory (``save_pretrained``'s ``config.json`` and weights, e.g. what ``longstraw export``
  writes) with the model's tokenizer next to it (``tokenizer.json``, loaded by ``tokenizer.load_tokenizer``);
- a ``longstraw train`` run directory: the policy of its checkpoint (``export.load_run_policy``) with the run's own
  tokenizer, turn length (``sampling.max_new_tokens``: a chat reply's default ``max_completion_tokens``) and policy
  version (reported as ``weight_version``); a LoRA run's adapter merged into the weights in process.

Turns end at the tokenizer's end-of-turn token, as in training. The model runs on the GPU when there is one. What a
request may ask and what the requests in flight may hold are ``ServingLimits`` (``serving`` says what happens at
each). transformers' progress bars and warnings are kept out of the output while the model loads: the banner and
errors are all ``serve`` prints.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from longstraw_agents.app.chat_template import QwenChatTemplate
from longstraw_agents.app.config import ConfigError, ModelSpec, check_model, check_tokenizer
from longstraw_agents.app.export import load_run_policy
from longstraw_agents.app.run import build_policy
from longstraw_agents.models import context_limit
from longstraw_agents.models.lora import lora_layers, merged_copy
from longstraw_agents.sampler import SamplingConfig
from longstraw_agents.serving import CompletionServer, ServingLimits
from longstraw_agents.tokenizer import Tokenizer
from longstraw_agents.torch_sampler import TorchSampler

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""What ``AutoTokenizer.from_pretrained`` reads a local tokenizer from (one of them)."""

Dtype = Literal["float32", "float64", "bfloat16"]


@dataclass
class LoadedPolicy:
    """A policy ready to serve: its model, tokenizer, sampling config (whose ``max_new_tokens`` bounds a chat reply
    by default) and the weight version it reports."""

    model: torch.nn.Module
    tokenizer: Tokenizer
    sampling: SamplingConfig
    policy_version: int
    source: str
    """What was loaded, for the banner: ``"model directory"`` or ``"run directory (policy version N)"``."""
    max_context: int | None = None
    """The run's ``model.max_context`` (None: the model config's context)."""


def load_policy(path: str | Path, dtype: Dtype | None = None, device: str | None = None) -> LoadedPolicy:
    """The policy of ``path``: a Hugging Face model directory (its ``config.json`` names a ``model_type``) or a run
    directory. ``dtype``: the weights' type (default: the run's, float32 for a model directory); ``device``: where
    the model runs (default: the GPU when there is one).

    Raises ``FileNotFoundError`` or ``ConfigError`` with a one-line message for what cannot be served."""
    target = _device(device)
    with quiet_transformers():
        policy = _load(Path(path), dtype)
    policy.model.to(target)
    return policy


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' progress bars ("Loading weights") and its info and warning logs off for the block (its errors
    still show), then as they were."""
    from transformers.utils import logging as hf_logging

    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        hf_logging.set_verbosity(verbosity)


def _device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ConfigError(f"device {name!r}: {err}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r}: no GPU is visible to torch here")
    return device


def _load(path: Path, dtype: Dtype | None) -> LoadedPolicy:
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such directory (give a Hugging Face model directory or a run directory)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"{path} is neither a Hugging Face model directory nor a run directory: it has no config.json"
        )
    try:
        saved = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{config_file} is not JSON: {err}") from None
    if isinstance(saved, dict) and "model_type" in saved:
        return _model_directory(path, dtype)
    return _run_directory(path, dtype)


def _model_directory(path: Path, dtype: Dtype | None) -> LoadedPolicy:
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{path} has no tokenizer (tokenizer.json): save the tokenizer the model was trained with next to it "
            "(tokenizer.save_pretrained)"
        )
    tokenizer = check_tokenizer(str(path))
    spec = ModelSpec(path=str(path), dtype=dtype or "float32")
    model = build_policy(spec, check_model(spec, tokenizer.vocab_size), seed=0)
    return LoadedPolicy(model, tokenizer, SamplingConfig(), 0, "model directory")


def _run_directory(path: Path, dtype: Dtype | None) -> LoadedPolicy:
    run = load_run_policy(path)
    model = merged_copy(run.model) if lora_layers(run.model) else run.model  # a LoRA run: its adapter merged in
    model = model if dtype is None else model.to(getattr(torch, dtype))
    source = f"run directory (policy version {run.policy_version}{', LoRA merged' if model is not run.model else ''})"
    return LoadedPolicy(
        model, run.tokenizer, run.config.sampling, run.policy_version, source, run.config.model.max_context
    )


def policy_server(
    policy: LoadedPolicy,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    model_name: str,
    model_path: str,
    weight_version: int | None = None,
    limits: ServingLimits | None = None,
) -> CompletionServer:
    """A server of ``policy`` listening on ``host:port`` (0: a free port), not started yet (``OSError`` when the
    address cannot be bound). weight_version: the version it reports (default: the policy's); limits: what requests
    may ask and hold (default: ``ServingLimits()``, within a run's ``model.max_context``)."""
    sampler = TorchSampler(
        policy.model,
        [policy.tokenizer.eos_token_id],
        policy.sampling,
        policy_version=policy.policy_version if weight_version is None else weight_version,
    )
    return CompletionServer(
        sampler,
        host=host,
        port=port,
        model_name=model_name,
        tokenizer=policy.tokenizer,
        model_path=model_path,
        chat_template=QwenChatTemplate(policy.tokenizer),
        limits=_within_context(limits or ServingLimits(), policy),
    )


def _within_context(limits: ServingLimits, policy: LoadedPolicy) -> ServingLimits:
    """``limits`` with the run's context limit (``model.max_context``) when they set none."""
    if limits.context is not None or policy.max_context is None:
        return limits
    return limits.model_copy(update={"context": context_limit(policy.model.config, policy.max_context)})
