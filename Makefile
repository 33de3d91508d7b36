# The two commands a newcomer needs (see README): `make pipeline` and `make test`.
PY ?= python3
VENV ?= .venv
# torch is pinned here only: 2.13.0 is the build this project is tested with (CPU wheel on CPU-only machines).
# Override on GPU machines, e.g. `make pipeline TORCH=torch==2.13.0` from a CUDA index, or TORCH=torch.
TORCH ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q "$(TORCH)" -e ".[dev]"
	touch $@

install: $(VENV)/.installed

# The stages call `mtpipe` and `python`: put the venv first on PATH (no need to activate it).
pipeline: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/dvc repro

test: install
	MTPIPE_NO_SKIPS=1 $(VENV)/bin/python -m pytest -q -rs tests

.PHONY: install pipeline test
