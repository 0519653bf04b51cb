#!/usr/bin/env bash
# One short run on a GPU machine: first the suite's CUDA tests (pytest -m gpu, at most 90 s; their result is printed
# and the bench runs whatever it is), then each single-GPU phase of a GRPO step (capture, scoring, replay, decode,
# detached and exact steps) of three ~1B model families (bench/gpu.py, bench/results/gpu.json) at 32K and 128K
# positions, whole steps at 32K; the bench itself should take 3 to 4 minutes on one H200, most of it the MLA family's.
# Arguments go to bench/gpu.py.
# The machine has torch + CUDA and transformers but nothing downloadable: the project is installed without its
# dependencies (or, where pip cannot build it offline, imported from a view of its package tree), and wheels put in
# .whl/ (flash-linear-attention and fla-core, a newer transformers) are installed first.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install --quiet --no-deps .whl/*.whl
fi
if ! "$PY" -m pip install --quiet --no-deps --no-build-isolation -e . 2>/dev/null; then
  "$PY" scripts/package_view.py >/dev/null  # builds .package_view/longstraw_agents from links
  export PYTHONPATH="$PWD/.package_view${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
# every test module is collected (modules whose dependencies this machine lacks are reported, not fatal); -m gpu
# runs only the CUDA tests (pyproject's "gpu" marker), the rest are deselected
echo "== CUDA tests: pytest -m gpu =="
if timeout 90 "$PY" -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors tests; then
  echo "== CUDA tests passed =="
else
  echo "== CUDA tests FAILED or timed out (exit $?); the bench runs anyway =="
fi
timeout "${GPU_BENCH_TIMEOUT:-270}" "$PY" -m bench.gpu "$@"
