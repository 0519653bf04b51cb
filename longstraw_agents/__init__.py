"""longstraw-agents: long-context GRPO post-training for agents.

Core modules (one concept each): ``trajectory`` (token-exact episodes), ``tokenizer`` and ``chat`` (token-in /
token-out formatting), ``segmenter`` (group → prefix tree), ``engine`` (incremental prefill: capture / extend /
logits), ``models`` (one adapter per model family), ``store`` (SQLite), ``memory`` (peak live tensor bytes).
Agent side: ``longstraw_agents.envs`` and ``longstraw_agents.tools``; training: ``longstraw_agents.trainer``.
"""

__version__ = "0.1.0"

try:  # make the LongStraw/... ids known to gymnasium.make (lazy entry points: nothing heavy is imported)
    from longstraw_agents.registration import register_envs as _register_envs

    _register_envs()
except ImportError:  # gymnasium is a dependency; a partial install still imports the model side
    pass
