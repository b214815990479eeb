# The README's two set-up commands are `make run` and `make test`; both create .venv on demand.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.memexp-installed

.DEFAULT_GOAL := help
.PHONY: help install run train test test-fast lint bench bench-techniques readme-figures check-readme slurm-up slurm-down \
	cuda-estimator clean

help: ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | awk -F'\t' '{printf "  %-10s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: an unpinned torch pulls several GB of CUDA packages. Pinned again
	# beside the extras: for timm's newest torchvision, pip would trade it for 2.14.1's CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,lowbit,timm,lora]' torch==2.13.0
	touch $@

install: $(STAMP) ## create .venv (torch==2.13.0 first) and install memexp into it
	@# memexp's own modules, compiled where they changed: with PYTHONDONTWRITEBYTECODE set (as
	@# on this project's machines) every process compiled them again, 0.2 s of CPU in each of
	@# the suite's 240 or so
	@$(PY) -m compileall -q src

run: install ## the main job: a quick comparison sweep on the embedded defaults (experiment=quick)
	$(PY) train.py -m experiment=quick
	@echo "Next, in this shell (python and memexp below need it): source $(VENV)/bin/activate"
	@echo "then, for example: python train.py model=transformer   (docs/running.md has more)"

readme-figures: install ## rerun what README.md and docs/ quote and write the figures between the markers
	$(PY) scripts/readme_figures.py

check-readme: ## run README.md's shell blocks from a fresh clone of this checkout (long)
	$(PY) scripts/check_readme.py

train: install ## a single run with your overrides, e.g. make train ARGS='precision=fp32'
	$(PY) train.py $(ARGS)

# The tests marked slurm run against a one-node SLURM cluster on this machine: `test` brings one up
# where it can (root, Debian/Ubuntu, the package registry reachable), and stops what it started;
# elsewhere it says why, and pytest skips those tests.
# Two pytest-xdist workers: the tests run one thread each, and most of them one process, so one
# worker left a core idle. A file goes to one worker whole (its tests share module fixtures and
# early work), the files with the most tests first.
TEST_WORKERS ?= 2
test: install ## the whole test suite (what CI runs), with a local SLURM cluster where one can run
	scripts/slurm-local with $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

test-fast: install ## the tests not marked slow
	$(PY) -m pytest -m "not slow"

lint: install ## ruff
	$(VENV)/bin/ruff check src tests bench scripts train.py

bench: install ## the overhead benchmark against a hand-written loop (a few minutes)
	$(PY) bench/overhead.py

bench-techniques: install ## every technique against its baseline (about 20 minutes on 2 cores)
	$(PY) bench/techniques.py

slurm-up: ## a one-node SLURM cluster on this machine (root, Debian/Ubuntu; installs what is missing)
	scripts/slurm-local up

slurm-down: ## stop the daemons slurm-up started
	scripts/slurm-local down

# Opt-in, and apart from the two set-up commands: a second venv with a CUDA build of torch
# (6.3 GB), in which `memexp estimate --target cuda` traces CUDA's own ops on a fake
# device (memexp.cudatrace); the fake device's C sources are built here with gcc.
CUDA_VENV ?= .venv-cuda
CUDA_TORCH ?= torch==2.14.1
CUDA_STAMP := $(CUDA_VENV)/.memexp-installed

$(CUDA_STAMP): pyproject.toml
	test -x $(CUDA_VENV)/bin/python || $(PYTHON) -m venv $(CUDA_VENV)
	$(CUDA_VENV)/bin/python -m pip install --quiet $(CUDA_TORCH)
	# every extra a CUDA run would use, so the trace models that run: peft for adapter=lora,
	# bitsandbytes for adapter=qlora's Linear4bit (backend=auto picks it on CUDA), timm;
	# torch pinned again, or timm's newest torchvision would trade it for another release
	$(CUDA_VENV)/bin/python -m pip install --quiet -e '.[dev,lowbit,lora,qlora-cuda,timm]' $(CUDA_TORCH)
	touch $@

cuda-estimator: $(CUDA_STAMP) ## opt-in: .venv-cuda, a CUDA build of torch for CUDA-faithful estimates (6.3 GB)
	$(CUDA_VENV)/bin/python -c "from pathlib import Path; from memexp import fakecuda; \
	print('fake CUDA device built in', fakecuda.build(Path('$(CUDA_VENV)/memexp-fakecuda')))"

clean: ## remove outputs (keeps .venv)
	rm -rf outputs multirun .pytest_cache
