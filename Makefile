# The two commands a newcomer needs (see README): `make pipeline` and `make test`.
PY ?= python3
VENV ?= .venv
# torch is pinned here only: 2.13.0 is the version this project is tested with. pip takes it from PyPI, whose
# Linux x86_64 wheel is the CUDA build (with NVIDIA's libraries, several GB to download); macOS gets a CPU wheel.
# TORCH_INDEX: the index torch alone comes from, e.g. the CPU-only build (about 200 MB) on a machine without a GPU:
#   make install TORCH_INDEX=https://download.pytorch.org/whl/cpu
# Another version: TORCH=torch (whatever pip resolves) or TORCH=torch==X.Y.Z.
TORCH ?= torch==2.13.0
TORCH_INDEX ?=

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(if $(TORCH_INDEX),$(VENV)/bin/pip install -q "$(TORCH)" --index-url "$(TORCH_INDEX)")
	$(VENV)/bin/pip install -q "$(TORCH)" -e ".[dev]"
	touch $@

install: $(VENV)/.installed

# The stages call `mtpipe` and `python`: put the venv first on PATH (no need to activate it).
pipeline: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/dvc repro

# `dvc exp show` compares experiments with the commit they start from: commit the pipeline's result (dvc.lock,
# params.yaml and the two metrics files, all small text) once, so that the table has a baseline row.
baseline:
	git add dvc.lock params.yaml metrics/score.json artifacts/train/live/metrics.json
	git commit -m "mtpipe baseline: dvc.lock, params and metrics"

# `dvc exp show` in ~90 columns: step, valid ppl, BLEU and chrF, and only the params that differ between rows
# (every loss detail, sacreBLEU's internals, the signatures and the dependency hashes dropped).
EXP_DROP = Created|.*/|train\.(loss|nll|ppl|lr|grad_norm|tgt_tokens_per_s|tokens_per_s)$$|valid\.(loss|nll)$$|epoch$$|ter$$|n$$|bp$$|ratio$$|.*_len$$|p[1-4]$$|signatures|inputs|gate
exps: install
	$(VENV)/bin/dvc exp show --only-changed --precision 3 --drop '$(EXP_DROP)'

# --durations: the slowest tests in every CI log (the suite has a 10-minute budget on CI's two cores).
test: install
	MTPIPE_NO_SKIPS=1 $(VENV)/bin/python -m pytest -q -rs -n 2 --dist loadfile --durations=15 tests

# The generated documentation: docs/environment.md, docs/configuration.md, docs/cli.md, and the tables rendered from
# bench/results/*.json into README.md and docs/ (tools/docs.py; tests/test_docs.py checks they are current).
docs: install
	$(VENV)/bin/python -m mtpipe.env --markdown > docs/environment.md
	$(VENV)/bin/python tools/docs.py

.PHONY: install pipeline test baseline exps docs
