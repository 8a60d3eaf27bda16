# Every target creates .venv from requirements.txt when it is missing, so a fresh clone needs only make.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: test test-fast lint format study study-full study-frontier study-horizon study-anneal bench bench-host gpu-check gpu-workloads gpu-anneal clean-venv

$(STAMP): requirements.txt setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -r requirements.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	@command -v ip >/dev/null && command -v tc >/dev/null || \
		echo "note: the emulated cluster (experiments.cluster) needs iproute2: apt-get install iproute2"
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -rs tests

# The edit-test loop: the tests declared to run in one process (tests/conftest.py: the
# markers, and the guard that fails an unmarked test that starts a process).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not processes and not slow" tests

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	@# the import arrows (pyproject.toml's [tool.importlinter] contracts; docs/architecture.md)
	$(BIN)/lint-imports --no-logo

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

study: $(STAMP)
	$(BIN)/python -m experiments.study --config experiments/configs/study_offline.toml

# The FDSL-32 study of issue 24 (report/fdsl32-study.md); it regenerates that page's tables and
# figures. About 158 runs, 3-4 hours on 2 cores: complete runs are skipped, so it can be stopped and
# run again, or run in seed blocks (docs/study.md).
study-full: $(STAMP)
	$(BIN)/python -m experiments.study --config experiments/configs/study_fdsl32.toml --update-report

# Issue 35's study: freezing against the budget frontier, gradient compression and the clock on
# FDSL-32 (docs/frontier.md); 155 runs on 2 cores, resumable, in seed blocks with --seeds N. Its
# tables go to report/frontier-study.md.
study-frontier: $(STAMP)
	$(BIN)/python -m experiments.study --config experiments/configs/study_frontier.toml --update-report

# issue 37: horizon at 4x the frontier study's horizon (its 1x runs give the horizons table). With
# --from-rows it runs only what runs/ and the committed report/per-seed/ rows lack, so on a fresh clone
# it regenerates the page from the rows, training nothing (docs/study.md, "From the committed rows").
study-horizon: $(STAMP)
	$(BIN)/python -m experiments.study --config experiments/configs/study_horizon.toml --from-rows --update-report

# issue 46: annealed freezing and FreezeOut as published against the budget frontier at 4x (docs/anneal-study.md)
study-anneal: $(STAMP)
	$(BIN)/python -m experiments.study --config experiments/configs/study_anneal.toml --update-report

bench: $(STAMP)
	$(BIN)/python -m experiments.bench
	@# BERT-base rows (engine with and without the activation cache, static limit, control): their own section
	$(BIN)/python -m experiments.bench --model bert-base
	@# the cluster part exits 2 with one line where namespaces cannot be built (no root, no iproute2)
	$(BIN)/python -m experiments.bench_cluster || test $$? -eq 2

# The prepared GPU check (experiments/gpu_check.py, docs/benchmarks.md): CUDA claims, the sync audit,
# the engine bench on CUDA and a one-GPU fine-tune, into $(OUT) (default report/gpu). It builds no
# .venv: it runs .venv's python where one exists, else $(PYTHON) as it is (the GPU machine's python3,
# which has torch), with the checkout on PYTHONPATH. Without a GPU it says so and runs the CPU variants.
OUT ?= report/gpu
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
gpu-check:
	PYTHONPATH=. $(GPU_PYTHON) -m experiments.gpu_check --out $(OUT)
# The realistic workloads (ResNet-50, ViT-B/16, BERT-base) and the engine bench in a window of their own.
gpu-workloads:
	PYTHONPATH=. $(GPU_PYTHON) -m experiments.gpu_check --out $(OUT) --budget-s 360 \
		--parts bench,workload-resnet50,workload-vit_b_16,workload-bert-base
# Issue 46's contrast at 10x the annealing study's steps (study_anneal_gpu.toml): a seed block's runs
# in turn took 350 s on an H200; side by side on the GPU (now) a window should finish about 3 (not yet
# measured). Seed 0 ran (report/gpu/6-anneal); the next window runs 1-3.
ANNEAL_SEEDS ?= 1,2,3
gpu-anneal:
	PYTHONPATH=. $(GPU_PYTHON) -m experiments.gpu_check --out $(OUT) --budget-s 560 \
		--parts anneal-contrast --anneal-seeds $(ANNEAL_SEEDS)

# Host time per step (experiments/bench_host.py): the engine's host work against the static limit on a
# model whose compute is negligible, into report/host/; run it alone on the machine.
bench-host: $(STAMP)
	$(BIN)/python -m experiments.bench_host

clean-venv:
	rm -rf $(VENV)
