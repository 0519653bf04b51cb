"""The trainer's weights to a served policy, through the disk: SGLang's ``POST /update_weights_from_disk``.

Trainer side (``DiskWeightSync.push``): after an optimizer step the policy is written as a transformers directory
(``save_pretrained``: ``config.json`` and safetensors) under a temporary name and renamed into place, so a server
never reads a half-written directory; ``POST {base_url}/update_weights_from_disk`` with ``{"model_path": DIR,
"weight_version": "N"}`` then asks the server to load it (SGLang answers ``{"success": ..., "message": ...}`` once the
weights are loaded), and the version the server reports afterwards (``GET /model_info``) must be N. Directories of
older versions are deleted once the server serves a newer one.

Server side (``load_weights``): what ``CompletionServer`` does with such a request: it reads the directory's tensors
into the served model in place, after checking that they are of the same architecture (the config's architecture
fields, every tensor's name and shape); on a mismatch nothing is changed and the error names what differs.

Supported servers: SGLang (the directory must be on a filesystem the server reads: the same machine, or a shared
mount at the same path) and ``longstraw_agents.serving.CompletionServer``. vLLM is not supported yet: its OpenAI
server has no endpoint that loads weights from a directory; pushing weights into it takes an NCCL group between
trainer and server (TRL's ``vllm-serve`` protocol) or a worker extension called through vLLM's development-mode
``/collective_rpc``, and this project implements neither.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from longstraw_agents.sampler import served_weight_version

UPDATE_PATH = "/update_weights_from_disk"
VERSION_PREFIX = "v"

# The config fields that fix an architecture: a checkpoint that differs in one of them cannot be loaded into the served
# model even when every tensor has the right shape (e.g. the heads of an attention projection).
ARCHITECTURE_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "tie_word_embeddings",
    "rope_parameters",
    "rope_theta",
    "layer_types",
)


class WeightSyncError(RuntimeError):
    """The server did not take the trainer's weights (unreachable, refused them, or reports another version)."""


class WeightsMismatch(ValueError):
    """A weights directory is not of the served model's architecture (the message names what differs)."""


@dataclass(frozen=True)
class SyncResult:
    """One push: the version the server now serves, the directory it loaded and the seconds writing and loading took."""

    version: int
    path: Path
    write_seconds: float
    load_seconds: float


def save_weights(model: torch.nn.Module, path: str | Path) -> Path:
    """Write ``model`` as a transformers directory at ``path`` (``save_pretrained``: config and safetensors),
    atomically: into a temporary sibling first, renamed into place once whole; an older ``path`` is replaced."""
    return _written_whole(path, lambda tmp: model.save_pretrained(tmp))  # type: ignore[operator]  # transformers'


def save_weight_parts(model: torch.nn.Module, parts: Iterable[dict[str, torch.Tensor]], path: str | Path) -> Path:
    """Write ``model``'s config and the tensors of ``parts`` (``parallel.fsdp.whole_parts``: a sharded model's
    weights assembled a part at a time) as a sharded transformers directory at ``path`` — one safetensors file per
    part and ``model.safetensors.index.json``, what ``save_pretrained`` writes for a large model — atomically, as
    ``save_weights``. Every part is taken even when writing fails (taking one may be a collective)."""
    from safetensors.torch import save_file

    pending = iter(parts)

    def write(tmp: Path) -> None:
        model.config.save_pretrained(tmp)  # type: ignore[union-attr,operator]  # a transformers model's config
        weight_map: dict[str, str] = {}
        total = 0
        for index, part in enumerate(pending):
            name = f"part-{index:05d}.safetensors"
            if repeated := sorted(weight_map.keys() & part.keys()):
                raise ValueError(f"tensors {repeated} are in two parts of the weights")
            save_file({k: t.contiguous() for k, t in part.items()}, tmp / name, metadata={"format": "pt"})
            weight_map |= dict.fromkeys(part, name)
            total += sum(t.numel() * t.element_size() for t in part.values())
        index_file = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=2, sort_keys=True))

    try:
        return _written_whole(path, write)
    finally:
        for _ in pending:  # (a failed write must not leave the other ranks in a gather)
            pass


def _written_whole(path: str | Path, write: Callable[[Path], object]) -> Path:
    """``write(tmp)`` fills a temporary sibling of ``path``, renamed to ``path`` once whole (replacing an older)."""
    final = Path(path)
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    final.parent.mkdir(parents=True, exist_ok=True)
    write(tmp)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


class DiskWeightSync:
    """Pushes the trainer's weights to a server that speaks SGLang's ``update_weights_from_disk``.

    directory: where each version is written (``v000003``...), a folder the server can read at the same path.
    keep: version directories kept; older ones are deleted after the server reports a newer version.
    timeout_s: how long the server may take to load one version (a 7B checkpoint takes tens of seconds).
    """

    def __init__(
        self, base_url: str, directory: str | Path, *, keep: int = 1, timeout_s: float = 1800.0, client: Any = None
    ):
        import httpx

        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.base_url = base_url.rstrip("/")
        self.directory = Path(directory)
        self.keep = keep
        self.client = client or httpx.Client(timeout=timeout_s)

    def served_version(self) -> int | None:
        """The version the server reports now (None: none, or not a number)."""
        import httpx

        try:
            return served_weight_version(self.client, self.base_url)
        except httpx.TransportError as err:
            raise WeightSyncError(f"{self.base_url} is unreachable ({type(err).__name__}: {err})") from None

    def push(
        self, model: torch.nn.Module, version: int, parts: Iterable[dict[str, torch.Tensor]] | None = None
    ) -> SyncResult:
        """Write ``model``'s weights as version ``version`` and have the server load them; returns once the server
        reports that version (``WeightSyncError`` otherwise). ``parts``: the weights assembled a part at a time
        (a sharded model's, ``save_weight_parts``) instead of ``model``'s own tensors."""
        start = time.perf_counter()
        path = self.directory / f"{VERSION_PREFIX}{version:06d}"
        path = save_weights(model, path) if parts is None else save_weight_parts(model, parts, path)
        written = time.perf_counter()
        self._request_load(path, version)
        reported = self.served_version()
        if reported != version:
            why = (
                "it reports no numeric weight version (an SGLang too old for weight_version?)"
                if reported is None
                else "is another trainer pushing weights to the same server?"
            )
            raise WeightSyncError(
                f"{self.base_url} loaded {path} but reports weight version {reported}, not {version}: {why}"
            )
        self._prune(path)
        return SyncResult(version, path, written - start, time.perf_counter() - written)

    def close(self) -> None:
        self.client.close()

    def _request_load(self, path: Path, version: int) -> None:
        import httpx

        url = self.base_url + UPDATE_PATH
        body = {"model_path": str(path.resolve()), "weight_version": str(version)}
        try:
            response = self.client.post(url, json=body)
        except httpx.TransportError as err:
            raise WeightSyncError(f"{url} is unreachable ({type(err).__name__}: {err})") from None
        try:
            answer = response.json()
        except ValueError:
            answer = None
        message = answer.get("message") if isinstance(answer, dict) else response.text[:500]
        if response.status_code == 404:
            raise WeightSyncError(
                f"{url}: no such endpoint (HTTP 404); the server does not load weights from disk (SGLang and "
                "CompletionServer do; vLLM is not supported yet)"
            )
        if response.status_code != 200 or not isinstance(answer, dict) or answer.get("success") is not True:
            raise WeightSyncError(f"{url} refused {path} (HTTP {response.status_code}): {message}")

    def _prune(self, current: Path) -> None:
        """Delete the version directories older than the newest ``keep`` (``current`` is always kept)."""
        versions = sorted(p for p in self.directory.glob(f"{VERSION_PREFIX}[0-9]*") if p.is_dir() and p != current)
        for old in versions[: max(0, len(versions) - (self.keep - 1))]:
            shutil.rmtree(old, ignore_errors=True)


# --- the server side ------------------------------------------------------------------------------------------------


def load_weights(model: torch.nn.Module, directory: str | Path) -> None:
    """Copy the weights saved in ``directory`` (``save_pretrained``: ``config.json`` and ``model.safetensors`` or a
    sharded index) into ``model``, in place. ``FileNotFoundError`` when there is nothing to load; ``WeightsMismatch``,
    naming what differs, when the directory holds another architecture (then ``model`` is unchanged)."""
    folder = Path(directory)
    if not folder.exists():
        raise FileNotFoundError(f"model_path: no directory at {folder}")
    if not folder.is_dir():
        raise FileNotFoundError(f"model_path: {folder} is a file, not a model directory")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"model_path: {folder} has no config.json (not a save_pretrained directory)")
    tensors = read_safetensors(folder)
    differences = config_differences(_config_dict(model), json.loads(config_file.read_text()))
    differences += tensor_differences(model, tensors)
    if differences:
        shown = "; ".join(differences[:8]) + (f"; and {len(differences) - 8} more" if len(differences) > 8 else "")
        raise WeightsMismatch(f"model_path: {folder} is not of the served model's architecture: {shown}")
    with torch.no_grad():
        model.load_state_dict(tensors, strict=False)  # the missing names are tied aliases (tensor_differences)


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of ``folder``: ``model.safetensors``, or the shards that ``model.safetensors.index.json`` lists."""
    from safetensors.torch import load_file

    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return load_file(single)
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return {name: tensor for shard in shards for name, tensor in load_file(folder / shard).items()}
    raise FileNotFoundError(
        f"model_path: {folder} holds no model.safetensors nor model.safetensors.index.json (save with save_pretrained)"
    )


def config_differences(served: dict[str, Any], saved: dict[str, Any], prefix: str = "") -> list[str]:
    """The architecture fields (``ARCHITECTURE_FIELDS``, and those of a ``text_config``) on which two configs differ,
    as ``"field: X in the directory, Y served"``."""
    out = []
    for field in ARCHITECTURE_FIELDS:
        if field in served or field in saved:
            mine, theirs = served.get(field), saved.get(field)
            if json.dumps(mine, sort_keys=True) != json.dumps(theirs, sort_keys=True):
                out.append(f"{prefix}{field}: {theirs!r} in the directory, {mine!r} served")
    if isinstance(served.get("text_config"), dict) or isinstance(saved.get("text_config"), dict):
        out += config_differences(served.get("text_config") or {}, saved.get("text_config") or {}, "text_config.")
    return out


def tensor_differences(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names missing from or unknown to ``model`` and shapes that differ. Tied weights (one tensor under several
    names, e.g. embeddings and lm_head) need one of their names only: ``save_pretrained`` writes one."""
    state = model.state_dict()
    tied: dict[tuple[int, tuple[int, ...]], list[str]] = {}
    for name, tensor in state.items():
        tied.setdefault((tensor.data_ptr(), tuple(tensor.shape)), []).append(name)
    out = [f"{name}: not a tensor of the served model" for name in tensors if name not in state]
    for names in tied.values():
        if not any(name in tensors for name in names):
            out.append(f"{names[0]}: missing from the directory")
    for name, tensor in tensors.items():
        if name in state and tuple(tensor.shape) != tuple(state[name].shape):
            out.append(f"{name}: shape {list(tensor.shape)} in the directory, {list(state[name].shape)} served")
    return out


def _config_dict(model: torch.nn.Module) -> dict[str, Any]:
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError("load_weights needs a transformers model (with a .config)")
    return config.to_dict()
