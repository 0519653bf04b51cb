#!/usr/bin/env bash
# One short run on a GPU machine (<= 5 minutes in all): capture, a detached GRPO step and an exact step of a
# scaled-up hybrid model (bench/gpu.py) at 128K and 512K positions; pass "--lengths 131072 524288 1048576" for 1M.
# The machine has torch + CUDA and transformers but nothing downloadable: the project is installed without its
# dependencies (or, where pip cannot build it offline, imported from a view of its package tree), and wheels put in
# .whl/ (flash-linear-attention, a newer transformers) are installed first.
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
timeout "${GPU_BENCH_TIMEOUT:-270}" "$PY" -m bench.gpu "$@"
