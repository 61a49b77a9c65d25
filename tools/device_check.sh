#!/usr/bin/env bash
# The accelerator check of issue 20, as one prepared script (about 8 minutes on one GPU):
# installs the CUDA build of jax if it is missing (pip only), then runs tools/device_check.py
# for lm_125m and lm_1b in bfloat16 and a short decoupled run, and appends the results to
# benchmarks/results/gpu.md. Everything else comes from the checkout.
#   bash tools/device_check.sh            # on the device machine, from the repository root
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
if ! "$PY" -c "import jax; assert jax.default_backend() == 'gpu'" 2>/dev/null; then
  "$PY" -m pip install --quiet -e '.[cuda]'
fi
"$PY" -c "import jax; print('devices:', jax.devices())"
timeout 480 "$PY" -m tools.device_check --sizes=125m,1b --batch_size=8 --steps=10 \
  --run_steps=40 --out=benchmarks/results/gpu.md
