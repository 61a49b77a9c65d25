# The README's commands. Everything installs into .venv; nothing is needed but python3, pip, make.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
WORKDIR ?= runs/demo

export JAX_COMPILATION_CACHE_DIR ?= $(CURDIR)/.cache/jax
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS ?= 0
export JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES ?= 0

.PHONY: venv lock wheel demo test lint format bench clean

venv: $(STAMP)

# PYTHONWARNINGS: setuptools' build warnings (editable install) are about packaging, not the user.
# The lock (exact versions, what the tests ran with) constrains pyproject.toml's ranges.
$(STAMP): pyproject.toml setup.cfg requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	PYTHONWARNINGS=ignore $(PY) -m pip install --quiet -c requirements.lock -e '.[dev]'
	touch $(STAMP)

# After a change to pyproject.toml's dependencies: the newest versions in its ranges, locked.
lock:
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	PYTHONWARNINGS=ignore .venv-lock/bin/pip install --quiet -e '.[dev]'
	{ sed -n 1,2p requirements.lock; .venv-lock/bin/pip freeze --exclude-editable; } > requirements.lock.new
	mv requirements.lock.new requirements.lock && rm -rf .venv-lock

# A wheel to install elsewhere (a Colab runtime, a cluster image): dist/decoupled_diloco-*.whl.
wheel: venv
	$(PY) -m pip wheel --quiet --no-deps -w dist .

demo: venv
	$(PY) -m experiments.train --config=experiments/configs/demo.py --workdir=$(WORKDIR)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: venv
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# --maxschedchunk=1: xdist hands out tests one at a time (its default deals each worker a block of
# 47 consecutive tests first, which put every multi-process test on one worker: 7:02 vs 5:40).
# compileall: the bytecode of our own modules, written once; where PYTHONDONTWRITEBYTECODE is
# set (as on CI) every process the tests start would otherwise compile them again (~0.4 s each).
test: lint
	$(PY) -m compileall -q -j 0 decoupled_diloco experiments tools tests
	$(PY) -m pytest -q -n 2 --maxschedchunk=1

# All benchmarks take several hours on 2 cores (the 2,000-step quality runs); `make bench ONLY=throughput,goodput` picks some.
bench: venv
	$(PY) -m tools.run_benchmarks $(if $(ONLY),--only=$(ONLY))

clean:
	rm -rf $(VENV) .cache .pytest_cache .ruff_cache
