#!/usr/bin/env bash
# The accelerator check of issue 20, as one prepared script (about 8 minutes on one GPU): the
# inner step of lm_125m and lm_1b in bfloat16 (tokens/s, MFU, framework vs bare jax.jit) and a
# short decoupled run of 2 learners of lm_125m with the syncer on the host CPU; appends its
# section to benchmarks/results/gpu.md (each part is written as it ends; a part that fails is a
# row saying why). Everything comes from the checkout and pip; nothing is downloaded by the check.
#   bash tools/device_check.sh                      # on the GPU machine, from the repository root
#   bash tools/device_check.sh --out=/tmp/gpu.md    # flags after the defaults override them
# Where jax's GPU build is missing it runs `pip install -e '.[cuda]'`. A machine without a
# package index can be handed wheels of the missing packages in $WHEELS (default .whl/, cp312
# wheels for the image's Python): they are installed into /tmp/dd_site and put first on
# PYTHONPATH for the check and every process it starts (docs/deploy.md, "GPUs").
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
WHEELS=${WHEELS:-.whl}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  rm -rf /tmp/dd_site  # (what an earlier check left there would shadow the image)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/dd_site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/dd_site${PYTHONPATH:+:$PYTHONPATH}
fi
# DEVICE_CHECK_ON_CPU=1: run on whatever jax has (a CPU machine), installing nothing.
if [ -z "${DEVICE_CHECK_ON_CPU:-}" ] \
  && ! "$PY" -c "import jax; assert jax.default_backend() == 'gpu'" 2>/dev/null; then
  "$PY" -m pip install --quiet -e '.[cuda]' || exit 1
fi
export PYTHONUNBUFFERED=1
# The 1B step with cuDNN's attention (model.attention "auto" on a GPU) and with XLA's.
timeout "${DEVICE_CHECK_TIMEOUT_S:-480}" "$PY" -m tools.device_check --sizes=1b,1b:xla,125m \
  --run_size=125m --batch_size=16 --steps=10 --run_steps=40 --out=benchmarks/results/gpu.md "$@"
