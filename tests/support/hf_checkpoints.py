"""Real checkpoints built on the spot: a byte-level BPE trained with the ``tokenizers`` library on text the project
generates (scripted Calculator episodes), saved as a transformers ``PreTrainedTokenizerFast`` directory, and tiny
random-init models saved with ``save_pretrained``. Nothing is downloaded."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import gymnasium
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from longstraw_agents.envs import EASY_CALCULATOR_KWARGS, ScriptedPolicy, run_episode
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.tokenizer import CHAT_SPECIAL_TOKENS, ENDOFTEXT, IM_END

CORPUS_EPISODES = 48


@functools.cache
def generated_corpus(episodes: int = CORPUS_EPISODES) -> list[str]:
    """The text of scripted Calculator episodes (system prompts with tool schemas, questions, calls, results)."""
    env = gymnasium.make("LongStraw/Calculator-v0", **EASY_CALCULATOR_KWARGS)
    policy = ScriptedPolicy(env)
    return [segment.text for seed in range(episodes) for segment in run_episode(env, policy, seed=seed)]


def save_bpe_tokenizer(
    directory: Path,
    *,
    vocab_size: int = 600,
    special_tokens: Sequence[str] = CHAT_SPECIAL_TOKENS,
    tags: Sequence[str] = (),
    eos_token: str = IM_END,
) -> Path:
    """Train a byte-level BPE on ``generated_corpus()`` and save it as a Hugging Face tokenizer directory.

    The special tokens (the ChatML ones by default) take the first ids; ``<|endoftext|>`` pads when present. The
    ``tags`` take the last ids, as added tokens that are not special (Qwen's ``<tool_call>``)."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: any text encodes
        show_progress=False,
    )
    backend.train_from_iterator(generated_corpus(), trainer)
    backend.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in tags])
    pad = {"pad_token": ENDOFTEXT} if ENDOFTEXT in special_tokens else {}
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos_token, **pad).save_pretrained(directory)
    return directory


def save_tiny_llama(directory: Path, vocab_size: int, *, seed: int = 0) -> Path:
    """A random-init tiny Llama-layout CausalLM saved with ``save_pretrained`` (config.json + safetensors)."""
    tiny_model("llama", vocab_size=vocab_size, seed=seed, hidden=32, layers=1).save_pretrained(directory)
    return directory
