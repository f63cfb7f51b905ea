# Set-up and the two main commands. Idempotent: the venv is (re)built only when the
# dependency files change. CPU-only machines get the CPU build of torch (constraints-cpu.txt).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTHON ?= python3
# Install extras: the tests exercise TensorBoard and an offline wandb run for real.
EXTRAS ?= test,plot,tensorboard,wandb

.PHONY: setup demo test

$(STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  $(VENV)/bin/pip install -q -e '.[$(EXTRAS)]'; \
	else \
	  $(VENV)/bin/pip install -q -c constraints-cpu.txt -e '.[$(EXTRAS)]'; \
	fi
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	PYTHON=$(PY) bash scripts/demo.sh

test: $(STAMP)
	$(PY) -m pytest
