"""A policy served by another process (``policy.served``): its sampler, and its weights kept equal to the trainer's.

In the synchronous loop every episode of a step is sampled by one weight version, the trainer's current one:

- before anything is sampled (``ServedPolicy.sampler``) the server must serve the trainer's weights: they are pushed
  unless the server already reports the trainer's policy version and nothing in this process changed the weights
  since they were loaded (a warm start does). A server started from ``model.path`` with ``--weight-version 0``
  (SGLang) is then used as it is; one that reports no number (SGLang's ``"default"``) gets the weights once;
- after each optimizer step (``ServedPolicy.push``) the trainer's weights are written and loaded by the server
  (``weight_sync.DiskWeightSync``), which then reports the new version; the episodes sampled next record it
  (``OpenAISampler`` follows the version each response reports);
- the sampler is pinned to the version pushed: a response of another version (something else changed the
  server's weights) fails the rollout, so the run stops before training on it (``SamplerError``).

Asynchronous GRPO (``max_staleness``, ``app.async_rollouts``) pushes while the server samples the next steps: its
sampler (``following_sampler``) follows the versions the responses report, each turn recording its own.

On a mesh (``ranks``) the writer (global rank 0) alone talks to the server; every rank takes part in assembling the
weights a part at a time from their FSDP2 shards (``parallel.fsdp.whole_parts``: no device ever holds the whole
model), and learns the writer's outcome. The first cp rank of each dp rank samples from the server.

A LoRA policy (``model.lora``) is pushed as merged weights (``W + s·B A`` under the transformers names, merged a part
at a time: ``lora.merged_tensors``): the disk protocol loads a whole model, so the server needs no LoRA support.
SGLang's and vLLM's own LoRA loading (an adapter beside the base) are not used.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from longstraw_agents.app.config import ServedPolicySpec
from longstraw_agents.app.distributed import Ranks
from longstraw_agents.models.lora import lora_layers, merged_tensors
from longstraw_agents.parallel.fsdp import whole_parts
from longstraw_agents.sampler import OpenAISampler, SamplingConfig
from longstraw_agents.weight_sync import DiskWeightSync, SyncResult, WeightSyncError

log = logging.getLogger(__name__)
T = TypeVar("T")

SERVED_WEIGHTS = "served_weights"
"""The run directory's folder of pushed weight versions (``weight_sync.directory`` unless set)."""


def weights_directory(spec: ServedPolicySpec, run_dir: Path) -> Path:
    """Where the versions pushed to the server are written."""
    return Path(spec.weight_sync.directory) if spec.weight_sync.directory else run_dir / SERVED_WEIGHTS


class ServedPolicy:
    """The served policy of one run.

    weights_changed: the trainer's weights differ from those the server was started with although the policy
        version is the same (a warm start ran in this process): the first sampling pushes them whatever the server
        reports.
    ranks: the run's processes (every one makes the same calls; the writer alone talks to the server).
    """

    def __init__(
        self, spec: ServedPolicySpec, run_dir: Path, *, weights_changed: bool = False, ranks: Ranks | None = None
    ):
        self.spec = spec
        self.ranks = ranks or Ranks()
        self.sync = DiskWeightSync(
            spec.base_url,
            weights_directory(spec, run_dir),
            keep=spec.weight_sync.keep,
            timeout_s=spec.weight_sync.timeout_s,
        )
        self.version: int | None = None  # the version known to be served: None until checked
        self.weights_changed = weights_changed
        self.last_push: SyncResult | None = None
        self._sampler: OpenAISampler | None = None

    def sampler(
        self, model: torch.nn.Module, policy_version: int, stop_ids: Sequence[int], sampling: SamplingConfig
    ) -> OpenAISampler:
        """A sampler of the server, once it serves ``model`` at ``policy_version`` (pushed first if need be)."""
        self._retire_sampler()
        self.bring_up_to_date(model, policy_version)
        self._sampler = self._open(policy_version, stop_ids, sampling, pinned_version=policy_version)
        return self._sampler

    def following_sampler(
        self, policy_version: int, stop_ids: Sequence[int], sampling: SamplingConfig
    ) -> OpenAISampler:
        """A sampler that follows the weight versions the server reports, each turn recording the one that sampled it,
        and refuses a response that reports none: asynchronous GRPO's, whose pushes land while it samples. The
        caller closes it (a push does not retire it)."""
        return self._open(policy_version, stop_ids, sampling, versioned=True)

    def _open(
        self, policy_version: int, stop_ids: Sequence[int], sampling: SamplingConfig, **version_rule: Any
    ) -> OpenAISampler:
        """An ``OpenAISampler`` of the server under the spec's limits; ``version_rule``: a pinned version, or
        versions followed as the server reports them."""
        spec = self.spec
        return OpenAISampler(
            spec.base_url,
            stop_ids,
            sampling,
            model=spec.model,
            policy_version=policy_version,
            timeout_s=spec.timeout_s,
            max_retries=spec.max_retries,
            max_concurrency=spec.max_concurrency,
            **version_rule,
        )

    def bring_up_to_date(self, model: torch.nn.Module, policy_version: int) -> None:
        """Push ``model`` unless the server is known, or reports, to serve it at ``policy_version`` already."""
        if self.version == policy_version and not self.weights_changed:
            return
        if not self.weights_changed and self._writers(self.sync.served_version) == policy_version:
            self.version = policy_version
            log.info("the server at %s serves policy version %d already", self.spec.base_url, policy_version)
            return
        self.push(model, policy_version)

    def push(self, model: torch.nn.Module, policy_version: int) -> SyncResult:
        """Write ``model`` as ``policy_version`` and have the server load it (on a mesh: assembled a part at a time
        from the shards, every rank taking part; the writer's outcome on every rank)."""
        self._retire_sampler()
        lora = bool(lora_layers(model))
        if self.ranks.mesh is None and not lora:
            result = self.sync.push(model, policy_version)
        else:  # (the writer writes the parts; the others take part in their gathers, keeping nothing)
            parts: Iterable[dict[str, torch.Tensor]] = whole_parts(model, keep=self.ranks.writes)
            if lora:  # the adapters merged into their weights, part by part
                parts = (merged_tensors(model, part) for part in parts)
            result = self._writers(lambda: self.sync.push(model, policy_version, parts), parts)
        self.version, self.weights_changed, self.last_push = policy_version, False, result
        log.info(
            "pushed policy version %d to %s (written in %.1fs, loaded in %.1fs)",
            policy_version,
            self.spec.base_url,
            result.write_seconds,
            result.load_seconds,
        )
        return result

    def _writers(self, ask: Callable[[], T], parts: Iterable[object] = ()) -> T:
        """``ask()`` on the writer, its answer on every rank (its error raised on every rank: a ``WeightSyncError``
        elsewhere); the others take ``parts`` meanwhile (their share of the collectives ``ask`` runs on the
        writer)."""
        if self.ranks.mesh is None:
            return ask()
        answer: tuple[T | None, str | None] = (None, None)
        error: Exception | None = None
        if self.ranks.writes:
            try:
                answer = (ask(), None)
            except Exception as err:  # noqa: BLE001 - every rank must hear of it, then it is raised
                error, answer = err, (None, str(err) if isinstance(err, WeightSyncError) else repr(err))
        else:
            for _ in parts:
                pass
        value, failure = self.ranks.from_writer(answer)
        if error is not None:
            raise error
        if failure is not None:
            raise WeightSyncError(f"the writer's push failed: {failure}")
        return value  # type: ignore[return-value]  # (None only beside a failure)

    def close(self) -> None:
        if self._sampler is not None:
            self._sampler.close()
        self.sync.close()

    def _retire_sampler(self) -> None:
        """Close the last sampler (its version is about to change, or a new one replaces it)."""
        sampler, self._sampler = self._sampler, None
        if sampler is not None:
            sampler.close()
