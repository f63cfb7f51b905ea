# Set-up and the two main commands. Idempotent: the venv is (re)built only when the
# dependency files change. CPU-only machines get the CPU build of torch (constraints-cpu.txt).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTHON ?= python3
# Install extras: the tests exercise TensorBoard and an offline wandb run for real, and Megatron-Core (interop).
EXTRAS ?= test,plot,tensorboard,wandb,interop
# Megatron-Core, the reference of its checkpoint format in the tests: --no-deps (its requirements are CUDA's).
MCORE ?= megatron-core==0.16.1

.PHONY: setup demo test

$(STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  $(VENV)/bin/pip install -q -e '.[$(EXTRAS)]'; \
	else \
	  $(VENV)/bin/pip install -q -c constraints-cpu.txt -e '.[$(EXTRAS)]'; \
	fi
	$(VENV)/bin/pip install -q --no-deps '$(MCORE)'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	PYTHON=$(PY) bash scripts/demo.sh

# transformers 5 no longer ships its Megatron-LM checkpoint converters; the export tests run the
# 4.40.2 release's own scripts (taken from its wheel, not copied into the project) as the reference.
CONVERTERS := $(VENV)/hf_megatron_converters
$(CONVERTERS)/.stamp: $(STAMP)
	rm -rf $(CONVERTERS) && mkdir -p $(CONVERTERS)/wheel
	$(VENV)/bin/pip download -q --no-deps transformers==4.40.2 -d $(CONVERTERS)/wheel
	$(PY) -c "import glob, os, zipfile; z = zipfile.ZipFile(glob.glob('$(CONVERTERS)/wheel/*.whl')[0]); \
	  [open(os.path.join('$(CONVERTERS)', os.path.basename(n)), 'wb').write(z.read(n)) for n in z.namelist() \
	   if os.path.basename(n) in ('convert_megatron_gpt2_checkpoint.py', 'convert_megatron_bert_checkpoint.py')]"
	rm -rf $(CONVERTERS)/wheel
	touch $@

test: $(STAMP) $(CONVERTERS)/.stamp
	$(VENV)/bin/ruff check .
	HF_MEGATRON_CONVERTERS=$(abspath $(CONVERTERS)) $(PY) -m pytest --durations=15
