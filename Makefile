# One-command set-up, demo, tests and benchmarks. Everything runs from the project's .venv.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP   = $(VENV)/.installed-cuda$(CUDA)
# the driver's CUDA: 13 (default: requirements.txt, driver R580+) or 12 (requirements-cu12.txt,
# driver R570+); `nvidia-smi` prints the driver and the newest CUDA it runs
CUDA   ?= 13
REQS   := $(if $(filter 12,$(CUDA)),requirements-cu12.txt,requirements.txt)

.PHONY: install demo test bench gpu-check clean

install: $(STAMP)

$(STAMP): $(REQS) requirements-common.txt setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r $(REQS)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation --config-settings editable_mode=compat -e .
	touch $(STAMP)

demo: install
	$(PY) -m cmacc.apps.demo --out runs/demo

test: install
	$(PY) -m pytest tests -q -p no:cacheprovider --durations=15

bench: install
	$(PY) -m pytest bench -q -p no:cacheprovider --benchmark-only --benchmark-columns=min,median,max,rounds
	$(PY) bench/bench_grad_embed.py --sizes 4096 38400
	$(PY) bench/bench_kmeanspp.py --sizes 4096 38400
	$(PY) bench/bench_step.py

# CUDA machines: compiled kernel tests, selection sweep, DALI GPU decode, a short GPU training
# run, each in its own process; each part's figures are appended to bench/RESULTS.md as it ends
# (one part alone: .venv/bin/python bench/gpu_check.py --part kernels|sweep|dali|train)
gpu-check: install
	$(PY) bench/gpu_check.py

clean:
	rm -rf runs/demo .pytest_cache
