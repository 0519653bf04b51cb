"""A run directory and everything a step needs, assembled in one place.

A run directory holds ``config.json``, ``trajectories.db`` (every episode, token-exact), ``metrics.jsonl`` (one
typed record per line, ``app.records``), ``checkpoint/`` (model, optimizer, RNG states, step counters; written
atomically), ``reference.safetensors`` (the frozen KL reference when beta > 0) and plots; with ``report_to``, the
trackers' logs too (``app.reporting``: ``tensorboard/``, ``wandb/``, ``mlflow.db``), which get every metrics record.

Under ``torchrun`` / ``accelerate launch`` (``config.parallel``, ``app.distributed``) every process builds a ``Run``:
the writer (global rank 0) alone writes the run directory, the store, the metrics and the trackers; every rank runs
the warm start and takes the writer's weights after it; the policy and its KL reference are then placed in one step
(``parallel.parallelize``: sharded with FSDP2, or replicated over the dp ranks). On several nodes every process must
see the run directory (checked first: ``Ranks.share_directory``), and a process that dies or hangs while the run
starts is a ``RankFailure`` on the others, as in a step.

``Run`` checks the configuration before anything is written (unknown env, bad env kwargs, a tokenizer without the chat
tokens, bad preset arguments, a missing model directory, a model vocabulary smaller than the tokenizer's, a prompt over
the model's context raise ``ConfigError`` and leave no run directory), then builds the policy, runs the warm start of
a new run, builds its ``GRPOTrainer`` with the KL reference, and on ``resume`` loads the checkpoint. It is the only
object that joins the agent side (environments, store) with the model side (policy, engine, trainer); the
environments it makes use the run's tokenizer.
"""

from __future__ import annotations

import contextlib
import copy
import json
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from longstraw_agents.app.config import (
    ConfigError,
    ModelSpec,
    TrainConfig,
    check_env,
    check_model,
    check_report_to,
    check_tokenizer,
    check_warm_start,
)
from longstraw_agents.app.distributed import Ranks
from longstraw_agents.app.records import EvalRecord, MetricsRecord
from longstraw_agents.app.reporting import Reporter
from longstraw_agents.app.seeds import sampling_seed, task_seed
from longstraw_agents.app.served import ServedPolicy
from longstraw_agents.app.warm_start import warm_start
from longstraw_agents.engine import Engine
from longstraw_agents.envs import ContextPolicy, unwrap_tool_env
from longstraw_agents.models import context_limit
from longstraw_agents.models.lora import LoraTargetError, apply_lora, lora_layers, merged_copy
from longstraw_agents.models.presets import build_model
from longstraw_agents.parallel import parallelize
from longstraw_agents.parallel.sampling import FollowingSampler, LeadingSampler, SamplerCalls
from longstraw_agents.rollout import RolloutLimits, make_env_factory, reset_prompt
from longstraw_agents.sampler import Sampler
from longstraw_agents.store import Store
from longstraw_agents.torch_sampler import TorchSampler
from longstraw_agents.trainer import GRPOTrainer
from longstraw_agents.trainer.trainer import IncompleteCheckpoint

if TYPE_CHECKING:
    from transformers import PretrainedConfig

CHECKPOINT = "checkpoint"
METRICS = "metrics.jsonl"
STORE = "trajectories.db"
REFERENCE = "reference.safetensors"

OnMetrics = Callable[[MetricsRecord], None]


def build_policy(spec: ModelSpec, config: PretrainedConfig, seed: int) -> torch.nn.Module:
    """The policy: ``spec.path``'s weights, or a random-init model of the preset's ``config`` (from ``check_model``);
    with ``spec.lora``, its LoRA adapters injected (drawn from ``seed``), every other weight frozen."""
    dtype = getattr(torch, spec.dtype)
    if spec.path is not None:
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(spec.path, dtype=dtype, local_files_only=True).eval()
        except OSError as err:  # a config.json without weights, a truncated safetensors file...
            raise ConfigError(f"model.path: cannot load the weights in {spec.path}: {err}") from None
    else:
        model = build_model(config, dtype=dtype, seed=seed)
    if spec.lora is not None:
        with torch.random.fork_rng(devices=[]):  # (PEFT draws A from the global generator)
            torch.manual_seed(seed)
            try:
                apply_lora(model, spec.lora)
            except LoraTargetError as err:
                raise ConfigError(str(err)) from None
    return model


def max_context_of(model: torch.nn.Module, spec: ModelSpec) -> int | None:
    """The longest episode the policy may see: ``spec.max_context`` or the config's limit, capped by a sliding
    window the engine stops at."""
    return context_limit(model.config, spec.max_context)


def has_checkpoint(run_dir: Path) -> bool:
    """True when ``run_dir`` holds a loadable checkpoint (also one whose last save was cut short)."""
    try:
        GRPOTrainer.resolve_checkpoint(run_dir / CHECKPOINT)
    except FileNotFoundError:
        return False
    return True


class Run:
    """One run directory: its store, policy, trainer and environments.

    resume: continue the run in ``config.output_dir`` from its checkpoint (no warm start; the saved reference).
    reference: a KL reference file to use instead of the policy at GRPO start (offline replay reuses its source
        run's reference); it is copied into the run directory.
    on_metrics: called with every record written to ``metrics.jsonl``.

    ``close`` closes the store and finishes the trackers (``report_to``); ``train`` and ``replay`` call it however
    they end (Ctrl-C and errors included).
    """

    def __init__(
        self,
        config: TrainConfig,
        resume: bool = False,
        *,
        reference: Path | None = None,
        on_metrics: OnMetrics | None = None,
    ):
        self.config = config
        self.dir = Path(config.output_dir)
        self.on_metrics = on_metrics
        self.ranks = Ranks.join(config.parallel, "cuda" if torch.cuda.is_available() else "cpu")
        existing = has_checkpoint(self.dir)
        if not resume and existing:
            raise FileExistsError(f"{self.dir} already holds a run; pass --resume or choose another output_dir")
        if resume and not existing:
            raise FileNotFoundError(f"--resume: no checkpoint in {self.dir}")
        if resume:
            _check_same_staleness(self.dir, config)
        if reference is not None and config.trainer.loss.beta > 0.0 and not reference.exists():
            raise FileNotFoundError(f"the run uses a KL penalty (beta > 0) but {reference} is missing")
        # cheap checks first, before any weights are built
        check_report_to(config.report_to)
        self.tokenizer = check_tokenizer(config.tokenizer)
        check_env(config.env, self.tokenizer)
        model_config = check_model(config.model, self.tokenizer.vocab_size)
        self.model = build_policy(config.model, model_config, config.seed)
        self.max_context = max_context_of(self.model, config.model)
        # what every rollout of the run (training, evaluation, replay, the warm start's envs) may take
        self.limits = RolloutLimits(config.sampling.max_new_tokens, self.max_context)
        self.env_factory = make_env_factory(config.env.id, self.env_kwargs(config.env.kwargs), self.limits)
        self.stop_ids = sorted({self.tokenizer.eos_token_id})
        # eviction's edits keep most of the context: the sampler keeps a state at every turn to resume from
        self.keep_marks = self._check_prompt_fits().edits_keep_most_of_the_context
        if not resume:  # (a resumed run has no warm start)
            check_warm_start(config.warm_start, config.env, self.tokenizer, self.max_context)
        # Nothing is written before the configuration is known to run: a config error leaves no run directory, and a
        # resume that cannot load the checkpoint leaves the run's config.json as it was.
        self._store: Store | None = None
        self._reporter: Reporter | None = None
        with self.ranks.failing_clearly(lambda: "starting the run"):
            self.ranks.share_directory(self.dir)  # every node sees it (made by the writer), before any step
            if self.ranks.writes:
                if not resume:
                    self._write_config()
                self._store = Store.open(self.dir / STORE)
            try:
                self._assemble(config, resume, reference)
            except BaseException:
                self.close()
                raise

    def _assemble(self, config: TrainConfig, resume: bool, reference: Path | None) -> None:
        """Trackers, the warm start (new runs), the trainer and its checkpoint, the served policy, and last the run's
        row in the store: a start stopped before it (Ctrl-C in the warm start) leaves no run row behind, and a new
        start in the same directory (there is no checkpoint to resume) records the one run."""
        if self.ranks.writes and config.report_to:  # before the warm start, whose record they get
            self._reporter = Reporter.start(config.report_to, self.dir, config.model_dump(mode="json"))
        if not resume:  # on every rank (a wait for the writer's could outlast a collective's timeout); then its weights
            self._warm_start()
        self.ranks.same_weights(self.model)
        self.trainer = self._trainer(self._reference(resume, reference))
        self.ranks.bound_collectives()  # the trainer's groups (the mesh's, FSDP2's lanes, the cp pairs) are made
        if resume:
            self._load_checkpoint()
        self.served = self._served_policy(resume)
        self.run_id = self.ranks.from_writer(self._run_row(resume) if self.ranks.writes else "")

    def _write_config(self) -> None:
        (self.dir / "config.json").write_text(self.config.model_dump_json(indent=2))

    def _load_checkpoint(self) -> None:
        """Resume from the checkpoint (written on any mesh: DCP reshards it), then record the settings it now runs
        with. A checkpoint missing files is refused naming them; one that does not load naming the settings it was
        written with and these (another model shape), or these alone when they are the same."""
        earlier = self.dir / "config.json"
        before = TrainConfig.model_validate_json(earlier.read_text()) if earlier.is_file() else None
        try:
            self.trainer.load_checkpoint(self.dir / CHECKPOINT)
        except IncompleteCheckpoint as err:
            advice = "restore those files, or start the run over in another output_dir"
            raise IncompleteCheckpoint(f"--resume: {err}; {advice}") from None
        except (RuntimeError, ValueError, KeyError) as err:
            raise ConfigError(f"--resume: {_refusal(self.dir, before, self.config)}: {err}") from None
        if self.ranks.writes:
            self._write_config()

    @property
    def store(self) -> Store:
        """The run's store; only the writer (global rank 0) opens it."""
        if self._store is None:
            raise RuntimeError("only the writer process (global rank 0) opens the store")
        return self._store

    def env_kwargs(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """``gymnasium.make`` kwargs for this run's environments: ``kwargs`` with the run's tokenizer, so that the
        prompts the policy reads and the ids it writes are of the vocabulary it was built for."""
        return {**kwargs, "tokenizer": self.tokenizer}

    def emit(self, record: MetricsRecord) -> None:
        """Append ``record`` to ``metrics.jsonl``, log it to the trackers (at its step, or the trainer's current
        one) and pass it to ``on_metrics`` (the writer; elsewhere nothing)."""
        if not self.ranks.writes:
            return
        with (self.dir / METRICS).open("a") as f:
            f.write(record.to_json() + "\n")
        if self._reporter is not None:
            self._reporter.log(record, record.at_step if record.at_step is not None else self.trainer.step_count)
        if self.on_metrics is not None:
            self.on_metrics(record)

    def evaluated_steps(self) -> set[int]:
        """The steps at which ``metrics.jsonl`` holds a held-out evaluation (the writer's file, on every rank):
        resuming a finished run, or one stopped in its first evaluation, evaluates each step once."""
        return self.ranks.from_writer(_evaluated_steps(self.dir / METRICS) if self.ranks.writes else set())

    def task_seeds(self, step: int) -> list[int]:
        return [task_seed(self.config.seed, step, g) for g in range(self.config.groups_per_step)]

    def sampler(self, step: int | None = None, seed: int | None = None) -> Sampler:
        """The policy's sampler for ``step`` (its seed derived from the run's and the dp rank), or with an explicit
        ``seed``. In process it runs the trainer's engine: with cp > 1 the cp ranks sample together (``sampling``),
        this rank's sampler leading (the first cp rank) or following its calls."""
        if seed is None and step is not None:
            seed = sampling_seed(self.config.seed, step, self.ranks.dp_rank)
        sampling = self.config.sampling if seed is None else self.config.sampling.model_copy(update={"seed": seed})
        if self.served is not None:  # the server, once it serves the trainer's weights
            return self.served.sampler(self.trainer.engine.model, self.trainer.policy_version, self.stop_ids, sampling)
        engine, version, keep = self.trainer.engine, self.trainer.policy_version, self.keep_marks
        mesh = self.ranks.mesh
        if mesh is None or self.ranks.cp == 1:
            return TorchSampler(engine, self.stop_ids, sampling, policy_version=version, keep_marks=keep)
        calls = SamplerCalls(mesh.cp_group, engine.adapter.device)
        role = LeadingSampler if self.ranks.rolls_out else FollowingSampler
        return role(engine, self.stop_ids, sampling, calls=calls, policy_version=version, keep_marks=keep)

    @contextlib.contextmanager
    def sampling(self, step: int | None = None, seed: int | None = None) -> Iterator[Sampler | None]:
        """A block of rollouts, entered by every rank together: the policy's weights (``sampling_weights``) and, on
        the rank that rolls out (``Ranks.rolls_out``), its sampler (``sampler``); elsewhere None. With cp > 1 the
        other cp ranks follow the first's sampler calls (``parallel.sampling``) until its block ends, each holding
        its share of every member's state: they are done when the block starts. A served policy needs no weights
        here: the server is brought up to date first (every rank taking part in assembling a push)."""
        if self.served is not None:  # (the server holds the weights; bringing it up to date takes every rank)
            sampler = self.sampler(step, seed)
            yield sampler if self.ranks.rolls_out else None
            return
        with self.sampling_weights():
            sampler = self.sampler(step, seed)
            if isinstance(sampler, FollowingSampler):
                sampler.follow()
                yield None
                return
            failed = True
            try:
                yield sampler
                failed = False
            finally:
                if isinstance(sampler, LeadingSampler):
                    sampler.close(failed)

    def sampling_weights(self) -> contextlib.AbstractContextManager[Any]:
        """The policy's weights for a block of sampling, entered by every rank together (FSDP2's gathers are
        collectives). Sharded, sampling gathers a layer at a time as the step does — the cp ranks of a dp rank
        sample together, so each joins every gather; a sharded capture gathers ahead, as the step's; at dp > 1 each
        dp rank gathers for itself, served by the others (``parallel.lanes``) — and the root unit is gathered for
        the block: no rank holds the whole model. Not sharded: nothing to gather."""
        weights = self.trainer.sharding.weights
        return _no_grad_around(weights.gathered(None)) if weights is not None else contextlib.nullcontext()

    def push_weights(self) -> None:
        """With a served policy (``policy.served``), have the server load the weights of the step just taken, so that
        the next episodes sample them (in-process sampling runs the trainer's model itself: nothing to do)."""
        if self.served is not None:
            self.served.push(self.trainer.engine.model, self.trainer.policy_version)

    def save_checkpoint(self) -> None:
        """Every process together (the checkpoint is written collectively)."""
        self.trainer.save_checkpoint(self.dir / CHECKPOINT)

    def close(self) -> None:
        """Close the store and finish the trackers (a second call does nothing); the process group stays up
        (``Ranks.close`` ends it)."""
        try:
            if self._store is not None:
                self._store.close()
        finally:
            if self._reporter is not None:
                self._reporter.finish()

    # --- assembly -------------------------------------------------------------------------------------------
    def _served_policy(self, resume: bool) -> ServedPolicy | None:
        """The server of ``policy.served`` (None: sampling in-process); a warm start has changed the weights it was
        started with, so its first sampling gets them pushed."""
        spec = self.config.policy.served
        if spec is None:
            return None
        changed = not resume and self.config.warm_start is not None
        return ServedPolicy(spec, self.dir, weights_changed=changed, ranks=self.ranks)

    def _check_prompt_fits(self) -> ContextPolicy:
        """The first task's prompt fits the env's budget and the model's context (else every rollout fails); returns
        the env's context policy, as the model's context capped it."""
        env = unwrap_tool_env(self.env_factory())
        try:
            reset_prompt(env, self.task_seeds(0)[0], limits=self.limits)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        finally:
            env.close()
        return env.context_policy

    def _run_row(self, resume: bool) -> str:
        runs = self.store.runs()
        if resume and runs:
            return runs[-1].id
        model_id = self.config.model.path or f"preset:{self.config.model.preset}"
        return self.store.add_run(
            config=self.config.model_dump(mode="json"), model=model_id, tokenizer=self.tokenizer.name
        )

    def _trainer(self, ref_model: torch.nn.Module | None) -> GRPOTrainer:
        """The GRPO trainer over the run's mesh, its engine the config's (``engine``): with cp > 1 it spreads each
        group's state over the cp ranks (``parallel.BalancedOwnership``). The policy and its KL reference are placed
        first, in one step (``parallel.parallelize``): with ``parallel.fsdp`` sharded over every rank, in the compute
        dtype ``trainer.mixed_precision`` asks for."""
        mesh, spec = self.ranks.mesh, self.config.parallel
        shards = None
        if mesh is not None and spec.cp > 1:
            shards = mesh.context_parallel(host_staged=spec.host_staged_messages)
        precision = self.config.trainer.mixed_precision
        placement = parallelize(
            Engine(self.model, self.config.engine, shards=shards),
            ref_model,
            mesh=mesh,
            fsdp=spec.fsdp,
            compute_dtype=None if precision is None else precision.dtype,
            offload=spec.offload,
            expert_parallel=spec.expert_parallel,
        )
        return GRPOTrainer(placement, self.config.trainer)

    def _warm_start(self) -> None:
        spec = self.config.warm_start
        if spec is None:
            return
        episodes = self.env_factory
        if spec.env_kwargs:
            kwargs = self.env_kwargs(spec.episode_kwargs(self.config.env.kwargs))
            episodes = make_env_factory(self.config.env.id, kwargs, self.limits)
        warm_start(self.model, spec, episodes, self.emit, progress=self.config.progress and self.ranks.writes)

    def _reference(self, resume: bool, source: Path | None) -> torch.nn.Module | None:
        """The frozen KL reference (beta > 0): the policy as GRPO starts (after the warm start), kept in the run
        directory so that a resumed run uses the same one; or the given ``source`` file's weights."""
        if self.config.trainer.loss.beta == 0.0:
            return None
        from safetensors.torch import load_model, save_model

        # a LoRA policy's reference is its adapter merged in: a plain model, the same whatever the LoRA settings
        policy = merged_copy(self.model) if lora_layers(self.model) else copy.deepcopy(self.model)
        reference = policy.eval().requires_grad_(False)
        path = self.dir / REFERENCE
        if source is not None and self.ranks.writes:
            shutil.copyfile(source, path)
        self.ranks.barrier()
        if resume or source is not None:
            load_model(reference, str(path))
        elif self.ranks.writes:  # the others hold the same weights (same_weights)
            save_model(reference, str(path))
        return reference


def _check_same_staleness(run_dir: Path, now: TrainConfig) -> None:
    """A resumed run keeps the ``max_staleness`` it was started with: the steps it stored ahead of its checkpoint
    (asynchronous GRPO trains them again from the store) were sampled under that bound, and a synchronous run's
    store holds none of them. An asynchronous one keeps the shape of its steps too (groups per step, group size,
    dp ranks), by which it finds them in the store."""
    earlier = run_dir / "config.json"
    if not earlier.is_file():
        return
    started = TrainConfig.model_validate_json(earlier.read_text())
    before = started.max_staleness
    if before != now.max_staleness:
        raise ConfigError(
            f"--resume: the run in {run_dir} was started with max_staleness={before}, this config says "
            f"{now.max_staleness}: resume with max_staleness={before}, or start a new run in another output_dir"
        )
    if before is None:
        return
    # the stored steps are found by their groups' ids (step, dp rank, group): another shape would take a stored step
    # for a missing one and roll it out again, or train a step's stored groups beside those of another shape
    shape = {
        "groups_per_step": lambda c: c.groups_per_step,
        "trainer.group_size": lambda c: c.trainer.group_size,
        "parallel.dp": lambda c: c.parallel.dp,
    }
    for name, of in shape.items():
        if of(started) != of(now):
            raise ConfigError(
                f"--resume: the asynchronous run in {run_dir} stored steps ahead of its checkpoint with {name}="
                f"{of(started)}, this config says {of(now)}: resume with {name}={of(started)}, or start a new run in "
                "another output_dir"
            )


def _evaluated_steps(metrics: Path) -> set[int]:
    """The ``step`` of every evaluation line of ``metrics`` (a line cut short by a kill is no evaluation)."""
    steps: set[int] = set()
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("phase") == EvalRecord.PHASE and isinstance(record.get("step"), int):
            steps.add(record["step"])
    return steps


def _refusal(run_dir: Path, before: TrainConfig | None, now: TrainConfig) -> str:
    """Why a checkpoint did not load: the model and mesh it was written with and the ones it was loaded with (only
    one, when they are the same: the settings are not what differs)."""
    if before is None:
        return f"the checkpoint in {run_dir} (of unknown settings) does not load with {_layout(now)}"
    if _layout(before) == _layout(now):
        return f"the checkpoint in {run_dir} does not load with the model and mesh it was written with ({_layout(now)})"
    return f"the checkpoint in {run_dir} (written with {_layout(before)}) does not load with {_layout(now)}"


def _layout(config: TrainConfig) -> str:
    """A run's model and mesh, as a refused resume names them."""
    model = config.model.path or f"preset {config.model.preset} {config.model.overrides or ''}".rstrip()
    if config.model.lora is not None:
        model += f" with LoRA {config.model.lora.model_dump(mode='json')}"
    parallel = config.parallel
    sharding = f"fsdp={parallel.fsdp} hsdp={parallel.hsdp} offload={parallel.offload}"
    sharding += " expert_parallel=True" if parallel.expert_parallel else ""
    return f"model {model}, parallel dp={parallel.dp} cp={parallel.cp} {sharding}"


@contextlib.contextmanager
def _no_grad_around(block: contextlib.AbstractContextManager[Any]) -> Iterator[None]:
    """``block`` entered under ``torch.no_grad`` (sampling: no gradient may reach a gathered layer)."""
    with torch.no_grad(), block:
        yield
