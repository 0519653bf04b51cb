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
    """Both strategies edit; the baseline (transformers' forward per sequence) reaches the forest's gradient; the
    tokens each side evaluates are counted at the embedding (exact mode's own count agrees, the baseline recomputes
    nothing, the forest's shared prefixes run forward once and its reverse walk recomputes); both peaks are
    measured; rewards are the episodes' own unless they all agree, and then a labelled synthetic one."""
    out = tmp_path / "compaction.json"
    stdout = run_module("bench.compaction", "--quick", "--group", "3", "--threads", "1", "--out", str(out))
    assert "| strategy | logged tokens |" in stdout and "| strategy | per-sequence s |" in stdout
    record = json.loads(out.read_text())
    assert record["command"].startswith("python -m bench.compaction --quick") and record["date"] and record["machine"]
    rows = record["rows"]
    assert [r["strategy"] for r in rows] == ["evict", "summary"]
    for r in rows:
        assert r["edits"] > 0 and r["sequences"] > r["episodes"] and r["logged_tokens"] > record["budget"]
        assert r["forest_positions"] < r["sequence_tokens"]
        assert r["gradient_distance"] < 1e-4
        ours, theirs = r["forest"]["tokens"], r["per_sequence"]["tokens"]
        assert theirs == {
            "forward": r["sequence_tokens"] - r["sequences"],
            "recomputed": 0,
            "backward": theirs["forward"],
        }
        assert ours["forward"] + ours["recomputed"] == r["forest_mode_forward_tokens"]
        assert ours["forward"] < theirs["forward"] and 0 < ours["recomputed"] < ours["forward"]
        assert ours["backward"] == ours["forward"]
        assert 0 < r["forest"]["peak_bytes"] < r["per_sequence"]["peak_bytes"]
        assert r["forest"]["seconds"] > 0 and r["per_sequence"]["seconds"] > 0
        rewards = r["rewards"]
        assert len(set(rewards["trained"])) > 1 and len(rewards["earned"]) == r["episodes"]
        if rewards["synthetic"] is None:
            assert rewards["trained"] == rewards["earned"]
        else:  # every episode earned the same: said, and trained on the synthetic reward
            assert len(set(rewards["earned"])) == 1 and rewards["trained"] == [1.0, 0.0, 1.0]
            assert f"{r['strategy']}: {rewards['synthetic']} (a synthetic reward" in stdout


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
    predicts; beside each phase transformers' time for the same work (its kernels and workarounds said), the
    model FLOP rate against the run's matmul rate and the time model's prediction."""
    stdout, record, _, _ = timing_quick
    assert record["device"] == "cpu" and record["date"] and record["finished"] and record["skipped"] == []
    assert sorted(record["versions"]) == ["cuda", "fla", "python", "torch", "transformers", "triton"]
    assert record["gpu_tests"] is None and record["kernels_off"] == [] and record["matmul_flops_per_s"] > 0
    assert sorted(record["setup"]) == ["dense", "hybrid", "mla"]
    rows = record["rows"]
    measuring = stdout[: stdout.index("wrote ")]  # bench.gpu's output (then bench.timing's report)
    printed = [line.split() for line in measuring.splitlines()]  # one table line per row, as it is measured
    table = [(line[0], int(line[2]), line[3]) for line in printed if line[0] in record["setup"]]
    assert table == [(r["family"], r["positions"], r["phase"] + ("*" if r["difference_of"] else "")) for r in rows]
    phases = ["capture", "scoring", "replay", "decode"]  # (decode_eager: the eager decoder, no peer)
    for family in ("hybrid", "dense", "mla"):
        at = {n: {r["phase"]: r for r in rows if r["family"] == family and r["positions"] == n} for n in (128, 256)}
        assert list(at[128]) == [*phases, "decode_eager", "detached_step", "exact_step", "walk"]
        assert list(at[256]) == [*phases, "decode_eager"]
        assert at[128]["detached_step"]["tokens"] == at[128]["exact_step"]["tokens"] == 128 + 2 * 8
        for n, by_phase in at.items():
            assert {r["parameters"] for r in by_phase.values()} == {by_phase["capture"]["parameters"]} != {0}
            assert by_phase["capture"]["tokens"] == n
            assert by_phase["scoring"]["tokens"] == by_phase["replay"]["tokens"] == 2 * 8  # G completions of 8
            assert by_phase["decode"]["tokens"] == by_phase["decode_eager"]["tokens"] == 2 * 4  # G members, 4 steps
            for r in by_phase.values():
                assert r["state_bytes"] == r["state_bytes_analytic"] > 0 and r["peak_bytes"] is None
                assert r["model_flops"] > 0 and r["predicted_s"] > 0
                if r["seconds"] > 0:  # (the walk, a difference, may not be on a busy machine)
                    assert r["flops_per_s"] == r["model_flops"] / r["seconds"]
                    assert r["of_matmul"] == r["flops_per_s"] / record["matmul_flops_per_s"]
                    assert r["predicted_over_measured"] == r["predicted_s"] / r["seconds"]
                assert r["kernels_off"] == []
                left_out = family == "mla" and r["phase"] == "decode"  # (transformers' cached DSA: other work)
                assert (r["peer_error"] is not None) == left_out
                if left_out:
                    assert "not the same work" in r["peer_error"] and r["peer_s"] is None
                elif r["phase"] in phases:  # transformers beside the engine
                    assert r["peer_s"] > 0 and r["peer_ratio"] == r["seconds"] / r["peer_s"]
                    assert r["peer_impl"].startswith("sdpa") and r["peer_peak_bytes"] is None
                    assert ("2 members per forward" in r["peer_impl"]) == (r["phase"] != "capture")
                else:
                    assert r["peer_s"] is r["peer_ratio"] is r["peer_impl"] is None
        measured = [r for r in at[128].values() if r["difference_of"] is None]
        assert len(measured) == 7 and all(r["seconds"] > 0 and r["tokens_per_s"] > 0 for r in measured)
        walk = at[128]["walk"]
        assert walk["difference_of"] == ["exact_step", "detached_step"]
        assert walk["seconds"] == at[128]["exact_step"]["seconds"] - at[128]["detached_step"]["seconds"]
    replay = {r["family"]: r["peer_impl"] for r in rows if r["phase"] == "replay"}
    assert "delta rule: torch fallback" in replay["hybrid"] and "recurrent state assigned" in replay["hybrid"]
    assert "experts " in replay["mla"] and record["setup"]["mla"]["peer"]["experts"]["eager"] > 0
    rooflines = record["setup"]["mla"]["rooflines"]  # the MLA family's ops against the run's roofline
    assert list(rooflines) == ["indexer", "top-k", "sparse attention", "experts"]
    assert all(r["seconds"] > 0 and r["bytes"] > 0 and r["of_roofline"] > 0 for r in rooflines.values())
    assert record["setup"]["dense"]["rooflines"] is None
    assert record["setup"]["hybrid"]["peer"]["delta_rule"]["backward"] == "torch fallback"  # (no fla on a CPU)
    from bench.gpu import markdown  # README's table of the record

    table = markdown(record).splitlines()
    assert len(table) == 4 + len(rows) and table[4].startswith("| hybrid | 128 | capture | ")


def test_gpu_bench_writes_each_row_as_it_is_measured(tmp_path: Path) -> None:
    """The record on disk after every change (a run killed later keeps it), ``finished`` only at the end."""
    from bench.gpu_record import Record

    path = tmp_path / "gpu.json"
    record = Record(path, {"device": "cpu"})
    on_disk = json.loads(path.read_text())
    assert on_disk["device"] == "cpu" and on_disk["rows"] == [] and on_disk["finished"] is None
    record.add_setup("dense", {"build_s": 1.0})
    record.add_row({"family": "dense", "phase": "capture"})
    record.skip("dense", 128, "scoring", "out of memory")
    on_disk = json.loads(path.read_text())
    assert on_disk["rows"] == [{"family": "dense", "phase": "capture"}] and on_disk["setup"]["dense"]["build_s"] == 1
    assert on_disk["skipped"] == [{"family": "dense", "positions": 128, "phase": "scoring", "reason": "out of memory"}]
    assert on_disk["finished"] is None and record.finish()["finished"] == json.loads(path.read_text())["finished"]
    assert [p.name for p in tmp_path.iterdir()] == ["gpu.json"]  # (written through a temporary file, renamed)


def test_gpu_bench_skips_what_its_budget_leaves_out(tmp_path: Path) -> None:
    """With no time left no family is set up: every planned row is listed as skipped, none measured."""
    import torch

    from bench.gpu import Run, lengths_of, parse_args, planned_phases
    from bench.gpu_record import Deadline, Record

    args = parse_args(["--device", "cpu", "--lengths", "128", "256", "--mla-lengths", "128", "--mla-exact-at"])
    record = Record(tmp_path / "gpu.json", {})
    run = Run(args, torch.device("cpu"), "cpu", record, Deadline.after(0.0), (), None)  # type: ignore[arg-type]
    for family in args.families:
        run.family(family)
    skipped = json.loads((tmp_path / "gpu.json").read_text())["skipped"]
    assert lengths_of("mla", args) == ([128], []) and lengths_of("dense", args) == ([128, 256], [32768])
    assert [(s["family"], s["positions"], s["phase"]) for s in skipped] == [
        (f, n, phase) for f in args.families for n in lengths_of(f, args)[0]
        for phase in planned_phases(n, lengths_of(f, args)[1])
    ]  # fmt: skip
    assert {s["reason"] for s in skipped} == {"time budget spent before the family's set-up"}
    assert record.data["rows"] == []


@pytest.fixture(scope="module")
def peer_models() -> dict:
    """``bench.gpu``'s toy hybrid and dense models in fp64, each with its engine and transformers' peer."""
    import torch

    from bench.gpu import parse_args
    from bench.peers_gpu import Transformers
    from bench.workloads import build, engine_config
    from longstraw_agents.engine import Engine

    args = parse_args(["--quick", "--device", "cpu", "--dtype", "float64"])
    models = {}
    for family in ("hybrid", "dense"):
        model = build(family, args, torch.device("cpu"))
        models[family] = (args, model, Engine(model, engine_config(args)), Transformers.prepare(model, args.chunk))
    return models


@pytest.mark.parametrize("family", ["hybrid", "dense"])
def test_transformers_peer_does_the_engines_work(peer_models: dict, family: str) -> None:
    """The peer's log-probs (transformers' cache of the context, expanded to the G completions) equal the engine's
    scoring (fp64 model; TRL's log-softmax runs in fp32); its replay's gradient is the same twice over the same
    cache (the cache is left as it was: the hybrid's recurrent states are assigned, not copied into); decoding
    runs."""
    import torch

    from bench.peers_gpu import PeerWork
    from bench.workloads import Workload, score

    args, model, engine, peer = peer_models[family]
    work = Workload.random(128, args, torch.device("cpu"))
    with torch.no_grad():
        engine_logprobs = torch.stack(score(engine, work.group(), engine.capture(work.prompt[:-1])))
    peer_work = PeerWork.of(work.prompt, work.completions, work.rewards, 3)
    cache = peer.capture(peer_work)
    torch.testing.assert_close(peer.scoring(cache, peer_work), engine_logprobs.float(), rtol=0, atol=1e-5)
    grads = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        peer.replay(cache, peer_work)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    model.zero_grad(set_to_none=True)
    assert grads[0].abs().sum() > 0 and torch.equal(grads[0], grads[1])
    peer.decode(cache, peer_work)
    torch.testing.assert_close(peer.scoring(cache, peer_work), engine_logprobs.float(), rtol=0, atol=1e-5)


def test_transformers_peer_fits_what_runs_out_of_memory(peer_models: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture that runs out of memory in one forward goes through the cache a chunk at a time (the same cache);
    a phase whose G members run out of memory together runs them in halves; each says so in its label."""
    import torch

    from bench.gpu import Beside
    from bench.peers_gpu import Transformers
    from bench.workloads import Workload

    args, model, _, peer = peer_models["dense"]
    inner = model.model

    class OneChunkAtATime(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: torch.Tensor, **kwargs):
            if input_ids.shape[1] > args.chunk:
                raise torch.OutOfMemoryError("CUDA out of memory (a test's)")
            return self.inner(input_ids, **kwargs)

    logprobs = Transformers._logprobs

    def one_member_at_a_time(self, cache, work, rows, assigned=False):
        if rows.stop - rows.start > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (a test's)")
        return logprobs(self, cache, work, rows, assigned)

    fitted = Transformers(model, args.chunk, setup=dict(peer.setup))
    beside = Beside(model, args, fitted)
    beside.start(Workload.random(3 * args.chunk, args, torch.device("cpu")))
    whole = fitted.scoring(fitted.capture(beside._work), beside._work)
    monkeypatch.setattr(model, "model", OneChunkAtATime())
    monkeypatch.setattr(Transformers, "_logprobs", one_member_at_a_time)
    capture = beside.peer_columns({"phase": "capture", "seconds": 1.0})
    scoring = beside.peer_columns({"phase": "scoring", "seconds": 1.0})
    assert capture["peer_s"] > 0 and "chunked prefill" in capture["peer_impl"] and capture["peer_error"] is None
    assert scoring["peer_s"] > 0 and scoring["peer_impl"].endswith("1 members per forward")
    torch.testing.assert_close(fitted.scoring(beside._cache, beside._work), whole, rtol=0, atol=1e-6)


def test_transformers_peer_takes_a_delta_rule_kernel_only_where_it_agrees_with_the_fallback() -> None:
    """The probe of transformers' resolved GatedDeltaNet functions (flash-linear-attention's where installed): one
    equal to the torch fallback passes forward and backward, one a tenth off or one that raises is refused with
    why; the phases that refuse it run the unwrapped fallbacks, and the module is restored after."""
    import functools
    import importlib
    import inspect

    import torch

    from bench.gpu import parse_args
    from bench.peers_gpu import QWEN3_5, DeltaRule, _agrees
    from bench.workloads import scaled_hybrid

    module = importlib.import_module(QWEN3_5)
    chunk, recurrent = module.torch_chunk_gated_delta_rule, module.torch_recurrent_gated_delta_rule
    fallback = inspect.unwrap(chunk)

    @functools.wraps(fallback)
    def off(*args, **kwargs):
        out, state = fallback(*args, **kwargs)
        return 1.1 * out, state

    @functools.wraps(fallback)
    def failing(*args, **kwargs):
        raise RuntimeError("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results\nmore")

    args = parse_args(["--quick"])
    config, cpu = scaled_hybrid(args.hidden, args.layers, args.vocab), torch.device("cpu")
    assert _agrees(chunk, recurrent, config, cpu, torch.bfloat16, backward=False) is None
    assert _agrees(chunk, recurrent, config, cpu, torch.bfloat16, backward=True) is None
    assert _agrees(off, recurrent, config, cpu, torch.float32, backward=False).startswith(
        "torch_chunk_gated_delta_rule output off by 0.1"
    )
    assert _agrees(failing, recurrent, config, cpu, torch.float32, backward=True) == (
        "RuntimeError: Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results"
    )
    rule = DeltaRule(chunk, recurrent, forward_kernel=True, backward_kernel=False, why="its backward fails")
    assert rule.label("capture") == "flash-linear-attention"
    assert rule.label("replay") == "torch fallback (its backward fails)"
    with rule.running("replay"):
        assert module.torch_chunk_gated_delta_rule is fallback
    assert module.torch_chunk_gated_delta_rule is chunk and module.torch_recurrent_gated_delta_rule is recurrent


HYBRID, FLA = "tests.models.test_hybrid", "test_the_fla_forward_equals_the_torch_scan_where_no_gradient_flows"
JUNIT = f"""<testsuites><testsuite name="pytest">
<testcase classname="{HYBRID}" name="{FLA}[fp32]">
  <failure message="relative error 0.3"/></testcase>
<testcase classname="{HYBRID}" name="{FLA}[bf16]"/>
<testcase classname="tests.kernels.test_delta_scan" name="test_the_compiled_triton_scan_equals_the_torch_scan[150]"/>
<testcase classname="tests.test_attention" name="test_forward_equals_softmax[one-block-cuda-flash-dtype3]"/>
<testcase classname="tests.test_attention" name="test_cudnn_attention_equals_flash_where_cudnn_takes_the_shape[True]">
  <error message="CUDNN_STATUS_NOT_SUPPORTED"/></testcase>
<testcase classname="tests.kernels.test_dsa" name="test_the_compiled_dsa_kernels_equal_the_torch_paths_on_the_gpu"/>
<testcase classname="tests.trainer.test_trainer" name="test_reference_model_follows_the_policy_to_the_gpu">
  <skipped message="needs a CUDA device"/></testcase>
</testsuite></testsuites>"""


def test_gpu_tests_switch_off_each_kernel_whose_parity_test_failed(tmp_path: Path) -> None:
    """A failed or erroring test switches its kernel off (fla's delta-rule forward through the environment, cuDNN
    attention by giving way to flash); a kernel whose tests passed, or that has none, stays on."""
    from bench.gpu_tests import KERNELS, attention_backend, exports, read_junit, switched_off, verdicts

    (tmp_path / "gpu_tests.xml").write_text(JUNIT)
    results = read_junit(tmp_path / "gpu_tests.xml")
    assert [r.outcome for r in results] == ["failed", "passed", "passed", "passed", "failed", "passed", "skipped"]
    found = verdicts(results)
    verdict = {s.kernel: found[s.kernel]["verdict"] for s in KERNELS}
    assert list(verdict.values()) == ["failed", "passed", "not run", "passed", "failed", "passed", "not run"]
    fla, cudnn = KERNELS[0].kernel, KERNELS[4].kernel
    assert found[fla]["failed_tests"] == [f"{HYBRID}::{FLA}[fp32]"]
    off = switched_off(results)
    assert [s.kernel for s in off] == [fla, cudnn]
    assert exports(off) == "export LONGSTRAW_DELTA_RULE=triton\n"
    names = ("auto", "eager", "cpu-flash", "cuda", "cuda-flash", "cuda-cudnn")
    assert attention_backend(off, names) == "cuda-flash" and attention_backend(off, names, "eager") == "eager"
    assert attention_backend(off, ("auto", "eager", "cuda-flash"), "cuda-cudnn") == "cuda-flash"
    assert attention_backend([], names) == "auto"
    assert off[0].applies_to("hybrid", "capture") and not off[0].applies_to("dense", "capture")


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
    # (the system prompt names the marks too: they are vocabulary words wherever they appear, as in Qwen's tokenizer)
    answers = [t for turn in turns for t in turn.token_ids.tolist()]
    assert [answers.count(mark) for mark in marks] == [3, 3]


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
    assert {r["positions"] for r in rows} == {128, 256} and all(r["held_out"] for r in rows)
    assert all(r["predicted_s"] > 0 and r["ratio"] == r["predicted_s"] / r["seconds"] for r in rows)
    for family, profile in record["profiles"].items():
        assert "micro-benchmarks" in profile["measured_on"], family
        assert profile["launch_s"] > 0 and profile["branch_call_s"] > 0 and profile["decode_call_s"] > 0
    assert record["profiles"]["mla"]["selection_s"] > 0 and record["profiles"]["mla"]["gather_s"] > 0
    assert record["profiles"]["hybrid"]["efficiency"]["recurrent_backward"] > 0  # the delta rule's backward, measured
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
    stage = {"stage": "episodes", "steps": 700, "loss_first": 7.5, "loss_last": 0.002, "seconds": 300.0}
    assert figures["warm_start"] == {**stage, "stages": [stage]}
    assert (figures["reward_before"], figures["reward_after"], figures["rise"]) == (0.25, 0.75, 0.5)
    assert figures["grpo_steps"] == 2 and figures["eval_episodes"] == 128


def test_demo_bench_reads_a_staged_warm_start_once_a_restart_left_earlier_stages_behind(tmp_path: Path) -> None:
    """A drill stage's line, then a start stopped in its second stage and started again: the figures are those of
    the last start's stages, their seconds summed, the episodes' stage's losses in front."""
    from bench.demo import run_figures
    from longstraw_agents.app.records import EvalRecord, WarmStartRecord

    def stage(name: str, loss: float, seconds: float) -> str:
        record = WarmStartRecord(
            stage=name, episodes=0, drills=8, steps=4, loss_first=2.0, loss_last=loss, seconds=seconds
        )
        return record.to_json()

    evals = [EvalRecord(step=k, reward_mean=0.5, episodes=4, policy_version=k).to_json() for k in (0, 1)]
    lines = [stage("drill 1", 0.9, 50.0), stage("drill 1", 0.1, 10.0), stage("drill 2", 0.2, 20.0)]
    lines += [stage("episodes", 0.3, 30.0), *evals]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    warm_start = run_figures(tmp_path)["warm_start"]
    assert [s["stage"] for s in warm_start["stages"]] == ["drill 1", "drill 2", "episodes"]
    assert warm_start["stages"][0]["loss_last"] == 0.1  # the restart's drill 1, not the stopped start's
    assert (warm_start["loss_last"], warm_start["seconds"]) == (0.3, 60.0)
