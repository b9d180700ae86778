# One-command set-up, demo, tests and benchmarks. Everything runs from the project's .venv.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP   = $(VENV)/.installed-cuda$(CUDA)
# the driver's CUDA: 13 (default: requirements.txt, driver R580+) or 12 (requirements-cu12.txt,
# driver R570+); `nvidia-smi` prints the driver and the newest CUDA it runs. The set installed is
# remembered by its stamp in .venv: every later target without CUDA= keeps it (`make install
# CUDA=12`, then `make test` tests the CUDA 12 set); another CUDA= recreates .venv (the two torch
# and DALI builds cannot share one environment)
CUDA   ?= $(or $(patsubst $(VENV)/.installed-cuda%,%,$(lastword $(wildcard $(VENV)/.installed-cuda*))),13)
REQS   := $(if $(filter 12,$(CUDA)),requirements-cu12.txt,requirements.txt)

.PHONY: install demo test coverage bench gpu-check gpu-session clean

install: $(STAMP)

$(STAMP): $(REQS) requirements-common.txt setup.py
	@for s in $(VENV)/.installed-cuda*; do [ -e "$$s" ] && [ "$$s" != "$(STAMP)" ] && { \
	  echo "$(VENV) holds the CUDA $${s##*cuda} set; CUDA=$(CUDA) asked: recreating $(VENV)"; \
	  rm -rf $(VENV); break; }; done; true
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r $(REQS)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation --config-settings editable_mode=compat -e .
	touch $(STAMP)

demo: install
	$(PY) -m cmacc.apps.demo --out runs/demo

# The suite in two passes, one torch thread per process: the tests that can share the machine
# on JOBS workers (pytest-xdist), then those marked serial (torchrun groups, timed waits) alone.
# A pass that selects nothing (pytest's exit 5) passes; any other failure fails the target.
JOBS   ?= 2
PYTEST := -m pytest tests -q -p no:cacheprovider --durations=15
suite   = OMP_NUM_THREADS=1 $(1) $(PYTEST) -n $(JOBS) --dist worksteal -m "not serial"; a=$$?; \
	  OMP_NUM_THREADS=1 $(1) $(PYTEST) -m serial; b=$$?; \
	  for rc in $$a $$b; do [ $$rc -eq 0 ] || [ $$rc -eq 5 ] || exit $$rc; done

test: install
	$(call suite,$(PY))

# The same suite under coverage, subprocesses included (.coveragerc): report on stdout and in
# runs/coverage/index.html
coverage: install
	rm -f .coverage .coverage.*
	export COVERAGE_FILE=$(CURDIR)/.coverage COVERAGE_RCFILE=$(CURDIR)/.coveragerc; \
	($(call suite,$(PY) -m coverage run)); rc=$$?; \
	$(PY) -m coverage combine -q && $(PY) -m coverage report && \
	$(PY) -m coverage html -q -d runs/coverage && exit $$rc

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

# A lent GPU in one call (<= 9 minutes): every figure as JSON lines in $$OUT/session.jsonl (else
# runs/gpu_session), each part's line written as it ends (docs/GPU.md, "The prepared GPU
# session"). No `install`: it runs with $(PYTHON) (python3: the machine's own, with torch and
# triton; no package index needed); SESSION_ARGS passes options, e.g.
# SESSION_ARGS="--part pairs select --budget-s 300", or "--dry-run" on a CPU
gpu-session:
	$(PYTHON) bench/gpu_session.py $(SESSION_ARGS)

clean:
	rm -rf runs/demo runs/coverage .pytest_cache .coverage .coverage.*
