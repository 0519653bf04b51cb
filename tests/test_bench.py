"""The benchmarks run end to end at toy sizes (their figures are measured by `make bench`, not asserted here)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def run_module(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_engine_bench_prints_ratios_per_family_and_shape(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    families = ["llama", "qwen3_5", "glm_moe_dsa"]
    args = ["--quick", "--rounds", "1", "--no-profile", "--out", str(out)]
    stdout = run_module("bench.engine", "--families", *families, "--shapes", "base", "wide", *args)
    assert "append/cache" in stdout and "capture/HF" in stdout and "append ms by turn index" in stdout
    results = json.loads(out.read_text())["results"]
    for family in families:
        assert sorted(results[family]) == ["base", "wide"]
        for r in results[family].values():
            assert len(r["append_ms"]) == len(r["dynamic_cache_ms"]) == 4
            assert r["append_vs_dynamic_cache"] > 0 and r["capture_vs_transformers"] > 0
            assert abs(r["bytes_ratio"] - 1.0) < 1e-9  # measured state bytes/token == analytic


def test_engine_bench_profiles_every_contender(tmp_path: Path) -> None:
    """One family and shape (the profiler's overhead on thousands of tiny operators is most of a toy run)."""
    out = tmp_path / "engine.json"
    stdout = run_module(
        "bench.engine", "--families", "glm_moe_dsa", "--shapes", "wide", "--quick", "--rounds", "1", "--out", str(out)
    )
    assert "top 6 operators by self CPU time" in stdout
    profile = json.loads(out.read_text())["results"]["glm_moe_dsa"]["wide"]["profile"]
    assert sorted(profile) == ["append", "capture", "dynamic_cache", "transformers_forward"]
    assert all(len(ops) == 6 and ops[0]["ms"] >= ops[-1]["ms"] > 0 for ops in profile.values())


def test_ablation_shows_detached_mode_dropping_part_of_the_gradient() -> None:
    """Even an 8-token prompt carries a share of the gradient detached mode drops (measured: cosine 0.886, relative
    L2 0.465): the two gradients point the same way but are not equal."""
    stdout = run_module("bench.ablation", "--lengths", "8", "--groups", "1")
    length, cosine, distance = stdout.strip().splitlines()[-1].split()
    assert length == "8"
    assert 0.5 < float(cosine) < 0.99 and 0.1 < float(distance) < 1.0


def test_trainer_bench_quick_measures_the_real_peers(tmp_path: Path) -> None:
    """Structure of the printed tables and the JSON, and the real PrefixGrouper's gradient against exact mode's
    (timings are printed, never asserted). One torch thread: pytest may run in parallel on the same cores."""
    stdout = run_module("bench.trainer", "--quick", "--threads", "1", "--out", str(tmp_path))
    contenders = ["naive", "detached", "exact", "prefix_grouper", "prefix_grouper_logits", "per_member_sdpa"]
    timed = ["exact", "detached", "prefix_grouper", "prefix_grouper_logits", "per_member_sdpa"]
    for heading in ("1) the setting", "2) peak tracked MiB vs prompt length", "3) peak tracked MiB vs G"):
        assert heading in stdout
    assert "gradient vs exact mode (relative L2)" in stdout and "targets (ratios at or below" in stdout
    assert "WARNING" not in stdout  # the tracker saw the peers' fused SDPA kernels
    table = stdout.split("1) the setting")[1].splitlines()
    assert table[1].split() == ["contender", "step", "s", "peak", "MiB", "time", "/", "PG", "peak", "/", "PG"]
    assert [row.split()[0] for row in table[2:7]] == timed

    text = (tmp_path / "trainer_quick.json").read_text()
    assert str(tmp_path) not in text and str(ROOT) not in text  # no machine paths
    results = json.loads(text)
    setting = results["setting"]
    assert sorted(setting["step_seconds"]) == sorted(timed) and sorted(setting["peak_bytes"]) == sorted(timed)
    grad_rel = setting["grad_rel_vs_exact"]
    for peer in ("prefix_grouper", "prefix_grouper_logits", "per_member_sdpa"):
        assert grad_rel[peer] < 1e-5, (peer, grad_rel[peer])  # same gradient as exact mode (fp32)
        calls = setting["sdpa_kernel_calls_tracked"][peer]
        assert calls["forward"] > 0 and calls["backward"] > 0
    assert grad_rel["detached"] > 1e-3  # the prefix gradient is dropped: the check can tell gradients apart
    by_prompt = results["memory_vs_prompt"]
    assert sorted(by_prompt["peak_bytes"]) == sorted(contenders)
    assert all(len(peaks) == len(by_prompt["lengths"]) > 1 for peaks in by_prompt["peak_bytes"].values())
    assert by_prompt["state_bytes_per_token"] > 0 and by_prompt["exact_growth_bytes_per_token"] > 0
    assert sorted(results["longest_within_budget"]["longest"]) == sorted(contenders)
    by_group = results["memory_vs_group"]
    assert all(len(peaks) == len(by_group["groups"]) for peaks in by_group["peak_bytes"].values())
    assert {entry["target"] for entry in results["targets"].values()} == {1.4, 0.6, 0.25, 2.5, 0.5}
    assert (tmp_path / "trainer_memory_quick.png").stat().st_size > 0


def test_rollout_bench_quick_compares_batched_and_per_member_decoding(tmp_path: Path) -> None:
    """Both contenders run (the bench itself checks that they generate the same tokens); tables and JSON have
    their rows. One torch thread: pytest may run in parallel on the same cores."""
    stdout = run_module("bench.rollout", "--quick", "--threads", "1", "--out", str(tmp_path))
    for heading in ("1a) rollout tokens/s", "1b) rollout tokens/s", "2) ms per generated token vs prompt length"):
        assert heading in stdout
    results = json.loads((tmp_path / "rollout_quick.json").read_text())
    for table in (results["one_group"], results["demo_step"]["rows"]):
        assert sorted(table) == ["1", "4"]
        for row in table.values():
            assert row["batched_tok_s"] > 0 and row["per_member_tok_s"] > 0 and row["tokens"] > 0
            assert row["speedup"] == row["batched_tok_s"] / row["per_member_tok_s"]
    by_length = results["prompt_length"]
    assert len(by_length["lengths"]) == len(by_length["ms_per_token"]["batched"]) == 2
    assert by_length["target_ratio"] == 1 / by_length["group"]


def test_capture_reuse_bench_measures_drift_per_step(tmp_path: Path) -> None:
    """Step 0 reuses what it just captured (no drift); later steps drift (the prefix is from older weights)."""
    out = tmp_path / "capture_reuse.json"
    args = ["--prompt", "64", "--group", "2", "--completion", "4", "--mu", "3", "--hidden", "64", "--layers", "2"]
    stdout = run_module("bench.capture_reuse", *args, "--lr", "1e-4", "--out", str(out))
    assert "grad drift" in stdout and "saved of" in stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["grad_drift"] == 0.0 and rows[0]["loss_drift"] == 0.0
    assert all(r["grad_drift"] > 0.0 for r in rows[1:])


def test_compaction_bench_trains_the_forest_and_the_per_sequence_baseline_to_one_gradient(tmp_path: Path) -> None:
    """Both strategies edit, the forest evaluates fewer tokens than the physical sequences hold, and the baseline
    (transformers' forward per sequence) reaches the forest's gradient."""
    out = tmp_path / "compaction.json"
    stdout = run_module("bench.compaction", "--quick", "--group", "3", "--threads", "1", "--out", str(out))
    assert "| strategy | logged tokens |" in stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["strategy"] for r in rows] == ["evict", "summary"]
    for r in rows:
        assert r["edits"] > 0 and r["sequences"] > r["episodes"]
        assert r["forest_tokens"] < r["sequence_tokens"] and r["logged_tokens"] > json.loads(out.read_text())["budget"]
        assert r["gradient_distance"] < 1e-4


@pytest.fixture(scope="module")
def timing_quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict, dict, Path]:
    """``bench.timing --quick``: it runs ``bench.gpu`` at toy sizes on the CPU (its phases and each family's
    micro-benchmarks) and models every row: its output, the phases' record, the timing record, the folder."""
    folder = tmp_path_factory.mktemp("timing")
    stdout = run_module("bench.timing", "--quick", "--out", str(folder / "timing.json"))
    phases = json.loads((folder / "phases_cpu.json").read_text())
    return stdout, phases, json.loads((folder / "timing.json").read_text()), folder


def test_gpu_bench_quick_times_every_phase_of_every_family(timing_quick) -> None:
    """On the CPU at toy sizes: one printed and one JSON row per (family, positions, phase), whole steps and the
    walk at the ``--exact-at`` lengths; the walk is the difference it says it is; states as ``state_size``
    predicts."""
    stdout, record, _, _ = timing_quick
    assert record["device"] == "cpu" and sorted(record["versions"]) == ["cuda", "fla", "torch", "transformers"]
    assert sorted(record["setup"]) == ["dense", "hybrid", "mla"]
    rows = record["rows"]
    measuring = stdout[: stdout.index("wrote ")]  # bench.gpu's output (then bench.timing's report)
    printed = [line.split() for line in measuring.splitlines()]  # one table line per row, as it is measured
    table = [(line[0], int(line[2]), line[3]) for line in printed if line[0] in record["setup"]]
    assert table == [(r["family"], r["positions"], r["phase"] + ("*" if r["difference_of"] else "")) for r in rows]
    phases = ["capture", "scoring", "replay", "decode", "decode_eager"]
    for family in ("hybrid", "dense", "mla"):
        at = {n: {r["phase"]: r for r in rows if r["family"] == family and r["positions"] == n} for n in (256, 512)}
        assert list(at[256]) == [*phases, "detached_step", "exact_step", "walk"] and list(at[512]) == phases
        assert at[256]["detached_step"]["tokens"] == at[256]["exact_step"]["tokens"] == 256 + 2 * 8
        for n, by_phase in at.items():
            assert {r["parameters"] for r in by_phase.values()} == {by_phase["capture"]["parameters"]} != {0}
            assert by_phase["capture"]["tokens"] == n
            assert by_phase["scoring"]["tokens"] == by_phase["replay"]["tokens"] == 2 * 8  # G completions of 8
            assert by_phase["decode"]["tokens"] == by_phase["decode_eager"]["tokens"] == 2 * 4  # G members, 4 steps
            for r in by_phase.values():
                assert r["state_bytes"] == r["state_bytes_analytic"] > 0 and r["peak_bytes"] is None
        measured = [r for r in at[256].values() if r["difference_of"] is None]
        assert len(measured) == 7 and all(r["seconds"] > 0 and r["tokens_per_s"] > 0 for r in measured)
        walk = at[256]["walk"]
        assert walk["difference_of"] == ["exact_step", "detached_step"]
        assert walk["seconds"] == at[256]["exact_step"]["seconds"] - at[256]["detached_step"]["seconds"]


@pytest.mark.distributed
def test_distributed_bench_measures_the_wavefront(tmp_path: Path) -> None:
    """cp = 2 on 2 gloo processes: state halves, rows move exactly what the schedule says (the minimum and the
    recomputed layer's once more), the walk is timed; the trainer's step on the same mesh counts its collectives
    and measures each rank's peak beside the plan."""
    out = tmp_path / "distributed.json"
    args = ["--prompt", "64", "--chunk", "16", "--layers", "3", "--group", "2", "--ranks", "1", "2"]
    stdout = run_module("bench.distributed", *args, "--out", str(out))
    assert "path steps" in stdout
    one, two = json.loads(out.read_text())["rows"]
    assert two["state_ratio_to_share"] == 1.0
    # 3 layers: layer 0 recomputed. The schedule counts the state / N a rank; a rank's share is within a position of
    # it (63 positions: 31 and 32), and each message also carries its runs' positions (16 bytes a run)
    assert 0.97 * two["row_schedule_bytes"] <= two["rows_bytes_max"] <= 1.01 * two["row_schedule_bytes"]
    assert two["row_schedule_bytes"] > two["row_minimum_bytes"]
    assert two["critical_path_steps"] > 0 and 0 <= two["idle_max"] < 1
    # the capture, cut balanced and in rank order (exact mode's), each timed with the time its ranks waited
    assert two["capture"] > 0 and two["capture_in_order"] > 0 and "in rank order" in stdout
    assert 0 <= two["capture_idle"] < 1 and 0 <= two["capture_in_order_idle"] < 1
    assert two["wavefront_steps"] == 3 + 3 - 1 and two["naive_steps"] == 3 * 3  # (3 runs: the walk is balanced)
    assert two["exact_in_order"] > 0 and 0 <= two["idle_in_order_max"] < 1
    # the training step with FSDP2 over both ranks: no fewer gathers and reductions than FSDP's forward, backward
    # and one reduction each; each rank's peak within 10 % of the plan for its cp rank
    (sharded,) = json.loads(out.read_text())["sharded"]
    assert "all-gather MiB (x min)" in stdout
    for rank in sharded["ranks"]:
        for kind in ("allgather", "reduce_scatter"):
            assert rank["sent"][kind] >= sharded["minimum"][kind] > 0
        assert abs(rank["peak"] - rank["planned"]) <= 0.10 * rank["peak"]


def test_experts_bench_times_the_capture_replicated_and_dispatched(tmp_path: Path) -> None:
    """cp = 2 on 2 gloo processes: expert parallelism's capture both ways, each with the bytes its ranks sent — the
    replicated one all-reduces the experts' shares and gathers every layer for every chunk, the dispatched one
    sends all-to-alls and the rows a sharded capture moves, and gathers each layer once per wave of runs."""
    out = tmp_path / "experts.json"
    stdout = run_module(
        "bench.experts", "--prompt", "128", "--chunk", "32", "--hidden", "32", "--ranks", "2", "--out", str(out)
    )
    assert "dispatched" in stdout and "replicated" in stdout
    result = json.loads(out.read_text())
    replicated, dispatched = result["rows"]
    assert result["one_process_s"] > 0 and replicated["seconds"] > 0 and dispatched["seconds"] > 0
    assert set(replicated["sent"]) == {"allgather", "allreduce"}
    assert {"alltoall", "send", "allgather"} <= set(dispatched["sent"]) and "allreduce" not in dispatched["sent"]
    assert dispatched["sent"]["allgather"] < replicated["sent"]["allgather"]


@pytest.mark.slow  # ~20 s: three tasks x two modes, each a start, evaluations, GRPO steps and the geometry
def test_learning_ablation_quick_writes_both_modes_curves_and_plot(tmp_path: Path) -> None:
    """Every task has a curve per mode and seed, held-out rewards in [0, 1] at the same steps, both modes starting
    from the same weights (the same held-out reward before GRPO), a paired gap, timings, memory (naive's too) and
    the plot; the key-value tasks the gradient geometry of three policies at each prompt length.
    Two tasks at once, a process each with one torch thread (pytest may run in parallel on the same cores)."""
    from bench.common import VANISHING

    stdout = run_module("bench.ablation_learning", "--quick", "--jobs", "2", "--out", str(tmp_path))
    assert "(exact - detached, paired by seed)" in stdout
    text = (tmp_path / "ablation_learning_quick.json").read_text()
    assert str(tmp_path) not in text and str(ROOT) not in text  # no machine paths
    results = json.loads(text)
    assert sorted(results["tasks"]) == ["calculator", "key_value_format_only", "key_value_retrieval"]
    seeds = results["settings"]["seeds"]
    for task in results["tasks"].values():
        modes = task["modes"]
        assert sorted(modes) == ["detached", "exact"]
        for row in modes.values():
            assert [curve["seed"] for curve in row["curves"]] == seeds
            for curve in row["curves"]:
                settings = results["settings"]
                assert curve["steps"] == list(range(0, settings["steps"] + 1, settings["eval_every"]))
                assert all(0.0 <= reward <= 1.0 for reward in curve["reward"])
                assert curve["seconds"] == sorted(curve["seconds"]) and curve["seconds"][0] == 0.0
            assert 0.0 <= row["final_reward_mean"] <= 1.0 and row["step_seconds_mean"] > 0
            assert row["peak_bytes"] > 0
        for detached, exact in zip(modes["detached"]["curves"], modes["exact"]["curves"], strict=True):
            assert detached["reward"][0] == exact["reward"][0]  # the same init, the same held-out samples
        assert modes["exact"]["peak_bytes"] > modes["detached"]["peak_bytes"]  # exact holds the prefix's gradient
        naive = task["naive"]  # exact mode's gradient: a cost row, no curve
        assert naive["step_seconds_mean"] > 0 and naive["peak_bytes"] > modes["exact"]["peak_bytes"]
        gap = task["final_gap_exact_minus_detached"]
        assert len(gap["per_seed"]) == len(seeds) and -1.0 <= gap["mean"] <= 1.0
    assert results["tasks"]["calculator"]["geometry"] == []  # no prompt length to stretch
    for name in ("key_value_format_only", "key_value_retrieval"):
        geometry = results["tasks"][name]["geometry"]
        assert [g["policy"] for g in geometry] == ["warm start", "after detached GRPO", "after exact GRPO"]
        assert None not in geometry[0]["cosine"]  # a warm start samples unlike answers: a gradient to compare
        for row in geometry:
            assert row["prompt_tokens"] == settings["geometry_lengths"] and all(n > 0 for n in row["exact_norm"])
            for cosine, distance, norm in zip(row["cosine"], row["relative_l2"], row["exact_norm"], strict=True):
                assert (cosine is None) == (distance is None) == (norm <= VANISHING)
                assert cosine is None or (-1.0 <= cosine < 1.0 and distance > 0)
            assert all(0 <= own <= row["groups"] for own in row["groups_with_own_rewards"])
    assert "cosine (relative L2) by prompt tokens" in stdout
    assert (tmp_path / "ablation_learning_quick.png").stat().st_size > 0


def _facts(text: str, count: int, filler: bool) -> dict[str, str]:
    """The ``key = value`` lines after ``Facts:`` (up to the first question): ``count`` of them, among filler lines
    (sentences of filler words) or alone."""
    lines = text.split("Facts:\n", 1)[1].split("What is the value of")[0].splitlines()
    facts = [m.groups() for line in lines if (m := re.fullmatch(r"( [a-z]+) =( [a-z]+)", line))]
    assert len(facts) == count and (len(lines) > count) == filler
    return dict(facts)


@pytest.mark.parametrize(
    ("name", "filler"),
    [("drill_document", False), ("short_conversation_document", False), ("conversation_document", True)],
)
def test_pretraining_documents_ask_about_their_own_facts(name: str, filler: bool) -> None:
    """Every answer (the only loss tokens) is the value of the key its question asks, as the oracle writes it; a
    document's facts are its rng's (two draws differ), among the task's filler lines or alone; other environments
    are refused."""
    import gymnasium
    import numpy as np

    import bench.ablation_learning as bench
    from longstraw_agents.envs.answers import ANSWER_CLOSE, ANSWER_OPEN

    make = getattr(bench, name)
    env = gymnasium.make("LongStraw/KeyValueRecall-v0", **bench.KEY_VALUE_KWARGS)
    first, again, other = (make(env, np.random.default_rng(seed), 5) for seed in (7, 7, 8))
    assert first.token_ids().tolist() == again.token_ids().tolist() != other.token_ids().tolist()
    answers = [s for s in first.segments if s.role == "assistant"]
    assert len(answers) == 5 and all(s.loss_mask.all() for s in answers)
    assert not any(s.loss_mask.any() for s in first.segments if s.role != "assistant")
    text = "".join(s.text or env.unwrapped.tokenizer.decode(s.token_ids.tolist()) for s in first.segments)
    facts = _facts(text, bench.KEY_VALUE_KWARGS["num_facts"], filler)
    asked = re.findall(r"What is the value of( [a-z]+)\?", text)
    answered = re.findall(f"{re.escape(ANSWER_OPEN)}( [a-z]+){re.escape(ANSWER_CLOSE)}", text)
    assert len(asked) == 5 and answered == [facts[key] for key in asked]
    with pytest.raises(TypeError, match=f"{name} reads KeyValueRecallEnv tasks, got CalculatorEnv"):
        make(gymnasium.make("LongStraw/Calculator-v0"), np.random.default_rng(0), 1)


def test_conversation_document_has_the_episodes_chat_layout() -> None:
    """The episode's system prompt, then its user message (facts and the first question) and the answers and
    further questions as chat turns; a drill puts each answer right after its question."""
    import gymnasium
    import numpy as np

    from bench.ablation_learning import KEY_VALUE_KWARGS, conversation_document, drill_document
    from longstraw_agents.envs.answers import ANSWER_CLOSE, ANSWER_OPEN

    env = gymnasium.make("LongStraw/KeyValueRecall-v0", **KEY_VALUE_KWARGS)
    conversation = conversation_document(env, np.random.default_rng(0), 3)
    system, *turns = conversation.segments
    assert env.reset(seed=0)[0].tolist()[: len(system.token_ids)] == system.token_ids.tolist()
    assert system.role == "system" and [t.role for t in turns] == ["user", "assistant"] * 3
    assert all("<|im_start|>user\n" in t.text for t in turns[0::2])
    drill = drill_document(env, np.random.default_rng(0), 3)
    tokenizer = env.unwrapped.tokenizer
    assert "<|im_start|>" not in tokenizer.decode(drill.token_ids().tolist())
    # the answer marks are the tokens a policy writes (the episodes' own), not their spelling as plain text
    marks = [tokenizer.special_token_id(mark) for mark in (ANSWER_OPEN, ANSWER_CLOSE)]
    assert [drill.token_ids().tolist().count(mark) for mark in marks] == [3, 3]
    assert [conversation.token_ids().tolist().count(mark) for mark in marks] == [3, 3]


def test_mixture_rehearses_its_share_of_an_earlier_stage() -> None:
    """A mixed stage draws each document from the rehearsed maker with its probability, from the same rng (so the
    same seed gives the same documents), and names both makers in its progress label."""
    import gymnasium
    import numpy as np

    from bench.ablation_learning import KEY_VALUE_KWARGS, Mixture, drill_document, short_conversation_document

    env = gymnasium.make("LongStraw/KeyValueRecall-v0", **KEY_VALUE_KWARGS)
    tokenizer = env.unwrapped.tokenizer

    def drills(mixture: Mixture, seed: int = 0) -> list[bool]:
        rng = np.random.default_rng(seed)
        documents = [mixture(env, rng, 2) for _ in range(24)]
        return ["<|im_start|>" not in tokenizer.decode(d.token_ids().tolist()) for d in documents]

    assert not any(drills(Mixture(short_conversation_document, drill_document, rehearsal=0.0)))
    assert all(drills(Mixture(short_conversation_document, drill_document, rehearsal=1.0)))
    half = Mixture(short_conversation_document, drill_document, rehearsal=0.5)
    assert 6 <= sum(drills(half)) <= 18 and drills(half, seed=3) == drills(half, seed=3)
    assert half.__name__ == "short_conversation_document + 50% drill_document"
    with pytest.raises(ValueError, match="Mixture.rehearsal is a probability, between 0 and 1; got 1.5"):
        Mixture(short_conversation_document, drill_document, rehearsal=1.5)


def test_geometry_compares_only_gradients_that_do_not_vanish() -> None:
    """A policy certain of every sampled token has a gradient of rounding errors: no cosine is taken from it."""
    import torch

    from bench.common import VANISHING, compare

    exact = torch.tensor([3.0, 4.0], dtype=torch.float64)
    cosine, distance = compare(torch.tensor([3.0, 0.0], dtype=torch.float64), exact)  # type: ignore[misc]
    assert cosine == pytest.approx(0.6) and distance == pytest.approx(0.8)
    assert compare(exact, exact) == (pytest.approx(1.0), 0.0)
    assert compare(torch.tensor([1e-17, 0.0]), torch.tensor([0.0, VANISHING / 2])) is None


def test_learning_ablation_runs_a_prefix_of_its_fixed_seeds() -> None:
    from bench.ablation_learning import FULL, first_seeds

    assert first_seeds(FULL, 2).seeds == FULL.seeds[:2] and first_seeds(FULL, 2).steps == FULL.steps
    with pytest.raises(ValueError, match=f"--first-seeds must be between 1 and {len(FULL.seeds)}, got 0"):
        first_seeds(FULL, 0)


def test_timing_bench_quick_models_every_row_from_micro_benchmarks(timing_quick) -> None:
    """Every row gets the time model's seconds from its family's micro-benchmarked profile, none fitted to a
    phase."""
    stdout, _, record, folder = timing_quick
    rows = record["rows"]
    assert {r["family"] for r in rows} == set(record["profiles"]) == {"dense", "hybrid", "mla"}
    assert {r["positions"] for r in rows} == {256, 512} and all(r["held_out"] for r in rows)
    assert all(r["predicted_s"] > 0 and r["ratio"] == r["predicted_s"] / r["seconds"] for r in rows)
    for family, profile in record["profiles"].items():
        assert "micro-benchmarks" in profile["measured_on"], family
        assert profile["launch_s"] > 0 and profile["branch_call_s"] > 0 and profile["decode_call_s"] > 0
    assert record["profiles"]["mla"]["selection_s"] > 0 and record["profiles"]["mla"]["gather_s"] > 0
    assert record["profiles"]["dense"]["selection_s"] == 0
    steps = [r for r in rows if r["phase"] in ("detached_step", "exact_step")]
    assert record["summary"]["held_out_steps"] == len(steps) == 6
    assert "held-out one-process steps: model/measured" in stdout


@pytest.mark.distributed
def test_timing_bench_cp_sets_each_phase_share_beside_the_model(tmp_path: Path) -> None:
    """cp = 2 on two gloo processes at toy sizes: the capture, replay and walk of an exact step, measured and
    modelled (the link's bandwidth measured), their shares each summing to one."""
    out = tmp_path / "cp.json"
    stdout = run_module("bench.timing", "--cp", "2", "--quick", "--families", "dense", "--out", str(out))
    (result,) = json.loads(out.read_text())["results"]
    assert result["family"] == "dense" and result["cp"] == 2 and result["link_bytes_per_s"] > 0
    phases = result["phases"]
    assert list(phases) == ["capture", "replay", "walk"]
    assert sum(p["measured_share"] for p in phases.values()) == pytest.approx(1.0)
    assert sum(p["modelled_share"] for p in phases.values()) == pytest.approx(1.0)
    assert all(p["modelled_s"] > 0 for p in phases.values()) and phases["capture"]["comm_s"] > 0
    assert "dense    2 walk" in stdout


def test_demo_bench_reads_a_finished_demo_run_and_refuses_an_unfinished_one(tmp_path: Path) -> None:
    """bench/demo.py takes README's demo figures from the run's metrics: the warm start, the held-out rewards before
    and after GRPO, the steps between."""
    from bench.demo import run_figures
    from longstraw_agents.app.records import EvalRecord, WarmStartRecord

    warm_start = WarmStartRecord(episodes=512, steps=700, loss_first=7.5, loss_last=0.002, seconds=300.0)
    before = EvalRecord(step=0, reward_mean=0.25, episodes=128, policy_version=0)
    after = EvalRecord(step=2, reward_mean=0.75, episodes=128, policy_version=2)
    steps = [json.dumps({"phase": "grpo", "step": k}) for k in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("\n".join([warm_start.to_json(), before.to_json(), *steps]) + "\n")
    with pytest.raises(ValueError, match="not a finished demo run"):
        run_figures(tmp_path)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write(after.to_json() + "\n")
    figures = run_figures(tmp_path)
    assert figures["warm_start"] == {"steps": 700, "loss_first": 7.5, "loss_last": 0.002, "seconds": 300.0}
    assert (figures["reward_before"], figures["reward_after"], figures["rise"]) == (0.25, 0.75, 0.5)
    assert figures["grpo_steps"] == 2 and figures["eval_episodes"] == 128
