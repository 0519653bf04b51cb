#!/usr/bin/env bash
# One GPU measurement in one command, about 6 minutes on one H100 or H200, installs and CUDA tests included:
#   1. installs the wheels in .whl/ (`make gpu-wheels` fetches them where there is a network: flash-linear-attention,
#      fla-core, einops, transformers at the project's pin) and the project without its dependencies;
#   2. runs the suite's CUDA tests (`pytest -m gpu`, the files that have them) with a JUnit record, gpu_tests.xml;
#   3. switches off every kernel whose parity test failed (bench/gpu_tests.py maps test ids to switches) and runs
#      bench/gpu.py in what is left of the budget: every phase of three ~1B families beside transformers' own model
#      on the same GPU, with FLOP rates and the time model's predictions; gpu.json is written row by row, so a
#      timeout loses nothing measured, and rows the budget leaves out are listed as skipped.
# Extra arguments go to bench/gpu.py (e.g. --families dense hybrid, --lengths 32768).
#
# The switches a failed GPU test turns on (the names are the contract with the modules that read them):
#   LONGSTRAW_DELTA_RULE=triton   fla's delta-rule forward failed: GatedDeltaNet runs the Triton scan everywhere
#   LONGSTRAW_DELTA_RULE=torch    the delta rule's Triton scan failed: GatedDeltaNet runs its torch scan
#   EngineConfig.attention        a fused CUDA attention backend failed (cuda: flash or cuDNN tuned per shape;
#                                 cuda-flash; cuda-cudnn): the next of cuda-flash, cuda-cudnn, eager
#                                 (bench/gpu.py --attention)
#   LONGSTRAW_DSA_KERNELS=0       DSA's Triton kernels failed: the indexer and sparse attention run in torch
#   LONGSTRAW_DECODE_GRAPHS=0     the CUDA-graph decoding step failed: batched decoding runs the eager step
#
# Environment: GPU_RECORDS (where gpu.json, gpu_tests.xml and the log go; default bench/results), GPU_TOTAL_S (the
# whole script's budget, default 345 s), GPU_TESTS_S (the CUDA tests' share, default 120 s), PYTHON.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
TOTAL=${GPU_TOTAL_S:-345}
RECORDS=${GPU_RECORDS:-bench/results}
PY=${PYTHON:-python3}
mkdir -p "$RECORDS"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

# 1. the wheels this machine lacks (it reaches no package index), then the project
if compgen -G ".whl/*.whl" >/dev/null; then
  SITE=/tmp/longstraw-wheels
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || { echo "installing .whl/*.whl failed"; exit 1; }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PY" -m pip install -q --no-deps --no-build-isolation -e . 2>/dev/null; then
  "$PY" scripts/package_view.py >/dev/null  # builds .package_view/longstraw_agents from links
  export PYTHONPATH="$PWD/.package_view${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"

# 2. the CUDA tests: only the files that have some (collecting the whole suite costs time and modules this machine
# may lack); a test that hangs fails alone (pytest-timeout), and SIGINT at the share's end still writes the record
XML="$RECORDS/gpu_tests.xml"
rm -f "$XML"
mapfile -t FILES < <(grep -rlE "mark\.gpu" tests --include='*.py' | sort)
echo "== CUDA tests: pytest -m gpu (${#FILES[@]} files, at most ${GPU_TESTS_S:-120} s) =="
PER_TEST=()
"$PY" -c "import pytest_timeout" 2>/dev/null && PER_TEST=(--timeout 90)
timeout -s INT -k 15 "${GPU_TESTS_S:-120}" "$PY" -m pytest -q -m gpu -p no:cacheprovider "${PER_TEST[@]}" \
  --continue-on-collection-errors --junitxml="$XML" "${FILES[@]}"
echo "== CUDA tests: exit $? ($((SECONDS - START)) s so far) =="
"$PY" -m bench.gpu_tests summary "$XML"
eval "$("$PY" -m bench.gpu_tests env "$XML")"  # a failed kernel's environment switch, before Python reads it

# 3. the bench, in what is left: it starts no phase after $UNTIL (a phase takes up to ~20 s: the margin), nor a
# family's set-up within 30 s of it, and the timeout is the backstop
LEFT=$((TOTAL - (SECONDS - START)))
UNTIL=$(($(date +%s) + LEFT - 25))
echo "== bench/gpu.py: $((LEFT - 25)) s to start phases in =="
timeout "$LEFT" "$PY" -m bench.gpu --gpu-tests "$XML" --until "$UNTIL" --out "$RECORDS/gpu.json" \
  --mla-lengths 32768 --mla-exact-at "$@" 2>&1 | tee "$RECORDS/gpu.log"
status=${PIPESTATUS[0]}
echo "== done in $((SECONDS - START)) s (bench exit $status); $RECORDS/gpu.json =="
exit "$status"
