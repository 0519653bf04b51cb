"""The application layer: the only place that joins the agent side (environments, tools, store) with the model side
(policy, engine, trainer).

- ``config``: ``TrainConfig`` (a ``job.JobSpec`` with environments, sampling, output and seeds), read from YAML/TOML
  and checked before anything is written;
- ``planning``: the memory plan of a run config's step (``longstraw plan --config``, ``longstraw train --check``);
- ``run``: ``Run``, a run directory with its store, policy, trainer and environments;
- ``training``: the online loop behind ``longstraw train`` (rollout → store → GRPO step → metrics → checkpoint);
- ``replay``: offline GRPO over logged groups, or groups forked from logged turns (``longstraw replay``);
- ``records``: the typed lines of ``metrics.jsonl``; ``plotting``: their curves (``longstraw plot``);
- ``seeds``: every seed of a run, derived from the run's seed;
- ``demo``: ``make demo``.
"""
