# tessera — top-level entry points. `make help` lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help

.PHONY: help build test test-unit test-bench lint up down e2e bench-packing

help: ## List the targets
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  %-16s %s\n", $$1, $$2}'

build: ## Build every Rust binary (debug)
	cargo build --workspace --bins

test: ## The README's test command: unit and integration tests, then the end-to-end suite on a real local cluster
	$(MAKE) test-unit
	$(MAKE) test-bench
	$(MAKE) e2e

test-unit: ## Rust unit and integration tests (no cluster)
	cargo build --workspace --all-targets
	cargo test --workspace

test-bench: ## The packing benchmark's own tests (allocation counts on a fixed slice of the trace; no timing)
	cd e2e/bench && GOTOOLCHAIN=local go test -count=1 ./...

lint: ## rustfmt and clippy, as CI would want them
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings

up: ## Local Kubernetes 1.36 cluster without Docker + tessera (NODES=2 GPUS=8 MODEL=H100-SXM5-80GB); see e2e/README.md
	e2e/scripts/up.sh

down: ## Stop everything `make up` started and remove its state (logs stay in .run/logs)
	e2e/scripts/down.sh

e2e: ## End-to-end scenarios on a fresh local cluster (builds control plane, harness and Rust binaries)
	e2e/scripts/e2e.sh

# Packing benchmark (e2e/bench/README.md). BENCH_GPU=h100|a100|h200|mix; results in bench-results/.
BENCH_OPENB_DIR ?= $(abspath $(CURDIR)/../shared/data/openb)
bench-packing: ## Replay the openb GPU trace through the structured allocator per tessera policy (bench-results/)
	cargo build -p tessera-controller -p tessera-kubelet-plugin
	cd e2e/bench && GOTOOLCHAIN=local go run . -out $(CURDIR)/bench-results -openb-dir $(BENCH_OPENB_DIR) \
		-controller $(CURDIR)/target/debug/tessera-controller -plugin $(CURDIR)/target/debug/tessera-kubelet-plugin
