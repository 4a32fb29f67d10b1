# tessera — top-level entry points. `make help` lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help

.PHONY: bench-fleet
# Fleet utilization, live (issues 24 and 39): any Azure-format CSV (TRACE, TIMESTAMP,ContextTokens,GeneratedTokens;
# default the conversation trace; gen:low / gen:bursty are generated) replayed on the real node with Prometheus,
# KEDA, the HPA, kube-scheduler and tessera's burstable shares in the loop, under the offline model's sized
# burstable policy (e2e/k8s/e2etest/fleet_sized_test.go): every real-node GPU MPS-shared, services starting on
# the model's initial size, re-sized by `kubectl tessera rightsize` against the run's Prometheus on the model's
# schedule (compressed); the offline model (e2e/k8s/internal/fleetsim) on the same slice beside it, in
# e2e/bench/results/fleet-live.md. Everything but the trace is fixed in code (fleetsim.LiveSizedConfig).
# REAL_NODE_GPUS (6) sets the real node's GPUs, at most 32 (the simulated driver's limit): half as many services (32: 16).
# FLEET_SIZED=0 runs the agreement scenario `make e2e` runs (3 services on fixed 50 % shares) on TRACE instead;
# FLEET_POLICIES=whole-peak,whole-hpa,shares-hpa,shares-hpa@0.85/0.1 the superseded batch-slot model's policies
# (e2e/k8s/internal/fleet; fleet.md's history).
FLEET_MINUTES ?= 60
FLEET_COMPRESS ?= 6
FLEET_POLICIES ?=
FLEET_SIZED ?= 1
FLEET_OUT ?= $(CURDIR)/e2e/bench/results/fleet-live.md
bench-fleet: ## The sized burstable policy live (rightsize in the loop) against the offline model on any trace (TRACE=<Azure-format CSV>|gen:low|gen:bursty; ~15 min at 60 minutes; root)
	e2e/scripts/node-packages.sh --install
	FLEET_TRACE='$(TRACE)' FLEET_MINUTES=$(FLEET_MINUTES) FLEET_COMPRESS=$(FLEET_COMPRESS) FLEET_POLICIES='$(FLEET_POLICIES)' FLEET_OUT='$(FLEET_OUT)' \
		FLEET_SIZED=$(FLEET_SIZED) $(if $(REAL_NODE_GPUS),REAL_NODE_GPUS=$(REAL_NODE_GPUS)) \
		E2E_RUN='^TestFleetBench' E2E_TIMEOUT=90m e2e/scripts/e2e.sh

.PHONY: bench-fleet-offline
# The fleet policies without a cluster (e2e/k8s/internal/fleetsim): any Azure-format CSV, or gen:low / gen:bursty
# (generated with a fixed seed). Every parameter is fixed in code; prints the markdown table, writes the plot.
TRACE ?= $(abspath $(CURDIR)/../shared/data/azure-llm-2023/AzureLLMInferenceTrace_conv.csv)
FLEET_SVG ?= $(CURDIR)/bench-results/fleet-offline.svg
bench-fleet-offline: ## The fleet policies offline, no cluster (TRACE=<Azure-format CSV>|gen:low|gen:bursty; ~1 min on 2 cores; a model, no GPU)
	mkdir -p $(dir $(FLEET_SVG))
	cd e2e/k8s && GOTOOLCHAIN=local GOFLAGS=-mod=mod go run ./cmd/fleet-offline -trace '$(TRACE)' -svg '$(FLEET_SVG)'

.PHONY: help build test test-unit test-bench test-sample lint up down e2e bench-packing bench-scheduler test-faults bench-scheduler-rate bench-coldstart

help: ## List the targets
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  %-16s %s\n", $$1, $$2}'

build: ## Build every Rust binary (debug)
	cargo build --workspace --bins

test: ## The README's test command: unit and integration tests, the e2e suite on a real local cluster, the scheduler check, the fault suite and benchmarks at a small size, the chart and the image
	$(MAKE) test-unit
	$(MAKE) test-bench
	$(MAKE) e2e
	$(MAKE) test-sample
	$(MAKE) test-faults FAULT_ROUNDS=5
	$(MAKE) bench-smoke
	$(MAKE) chart-lint
	$(MAKE) image-test IMAGE_PROFILE=debug

test-unit: ## Rust unit and integration tests (no cluster)
	cargo build --workspace --all-targets
	cargo test --workspace

# e2e/bench/dcgmjoin runs the real Prometheus over the chart's DCGM recording rules, and controller/tests/rightsize.rs
# reads a known load back through it: the add-on's build
# (Prometheus and KEDA, relinked only when their sources change) runs here, before `make e2e`, whose own
# call then finds them up to date; TESSERA_REQUIRE_PROMETHEUS turns the test's skip without it into a failure.
test-bench: ## The benchmarks' and e2e tools' own Go tests (packing counts on a fixed slice of the trace, the fleet model, 1.38's iptables stand-in, the DCGM recording rules and kubectl tessera rightsize in a real Prometheus; no timing)
	e2e/scripts/build-autoscaling.sh
	cd e2e/bench && TESSERA_REQUIRE_PROMETHEUS=1 GOTOOLCHAIN=local go test -count=1 ./...
	TESSERA_REQUIRE_PROMETHEUS=1 cargo test -p tessera-controller --test rightsize
	cd e2e/k8s && GOTOOLCHAIN=local GOFLAGS=-mod=mod go test -count=1 ./internal/fleet/ ./internal/fleetsim/ ./internal/liveresize/
	cd e2e/tools/iptables-wrappers && GOTOOLCHAIN=local go test -count=1 ./...

# Import circles between the files of every crate of the workspace (the tool lives beside the project, in
# ../shared/tools; CI runs it before the tests).
MODULE_CYCLES ?= $(abspath $(CURDIR)/../shared/tools/rust-module-cycles)
CRATE_SRCS = $(sort $(dir $(wildcard */src/lib.rs */src/main.rs */*/src/lib.rs */*/src/main.rs */*/*/src/lib.rs */*/*/src/main.rs)))
.PHONY: check-cycles
check-cycles: ## No import circle between the files of any crate (../shared/tools/rust-module-cycles)
	$(MODULE_CYCLES) $(filter-out third_party/% e2e/%,$(CRATE_SRCS))

lint: ## rustfmt and clippy, as CI would want them
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings

# As root (these machines, CI), tessera is installed the way users install it: `helm install` of the chart
# onto a real node (upstream kubelet + containerd), beside the stand-in nodes. Without root, or with
# INSTALL=host, the controller runs as a host process and no real node comes up.
INSTALL ?= $(if $(filter 0,$(shell id -u)),chart,host)
up: ## Local Kubernetes 1.37 cluster without Docker + tessera, installed by its Helm chart onto a real node as root (INSTALL=host: host processes; ADDONS=autoscaling,kueue: Prometheus + KEDA, Kueue; NODES=2 GPUS=8 MODEL=H100-SXM5-80GB; K8S_VERSION=1.36); see e2e/README.md
	@if [ "$(INSTALL)" = chart ]; then e2e/scripts/node-packages.sh --install; fi
	INSTALL=$(INSTALL) ADDONS=$(ADDONS) e2e/scripts/up.sh

down: ## Stop everything `make up` started and remove its state (logs stay in .run/logs)
	e2e/scripts/down.sh

# The real node (e2e/scripts/real-node.sh): kubelet, containerd, runc, CNI plugins, pause and busybox images.
.PHONY: build-node
build-node: ## Build the real node's kubelet, containerd, runc, CNI plugins and images (cached; e2e/bin/node)
	e2e/scripts/build-node.sh

e2e: ## End-to-end scenarios on a fresh local cluster with a real node (builds control plane, node, harness and Rust binaries)
	e2e/scripts/node-packages.sh --install
	e2e/scripts/e2e.sh

# Fault suite (issue 16): plugin kill -9 in prepare/unprepare, foreign-boot and corrupted checkpoints with
# pods running, API server restarts during a pod burst, controller kills during policy changes and node
# joins/leaves; on the real node with the chart (issue 27), kubelet and containerd kill -9 during a burst, the
# plugin container killed mid-prepare, the MPS supervisor deleted, helm uninstall + reinstall under running
# pods; prints leak/overlap/lost-device/slice-gap counts. `make test` runs it small:
# `make test-faults FAULT_ROUNDS=5` (~9 min); the full run (100 rounds) writes e2e/bench/results/faults.md
# (FAULTS_RUN=TestFaultsRealNode re-measures only the real-node rows, keeping the others).
FAULT_ROUNDS ?= 100
test-faults: ## Fault suite on a fresh local cluster, counts per scenario (FAULT_ROUNDS=100; 5 in make test)
	FAULT_ROUNDS=$(FAULT_ROUNDS) e2e/scripts/faults.sh

# Cold starts (issue 25): whole-GPU, MIG and MPS Deployments on the real node scaled 0 → N → 0 → N, cold
# and with warm partitions, under hardware-like latencies (e2e/bench/hardware-like-latencies.yaml, estimates).
# The table goes to e2e/bench/results/coldstart.md. `make e2e` runs the same scenario at 2 replicas without
# latencies (counts asserted, times printed).
COLDSTART_REPLICAS ?= 4
bench-coldstart: ## Time from scale-up to each replica's first CUDA context, cold vs warm, on the real node (~8 min; root)
	e2e/scripts/node-packages.sh --install
	COLDSTART_REPLICAS=$(COLDSTART_REPLICAS) e2e/scripts/bench-coldstart.sh

# Packing benchmark (e2e/bench/README.md). BENCH_GPU=h100|a100|h200|mix; results in bench-results/.
BENCH_OPENB_DIR ?= $(abspath $(CURDIR)/../shared/data/openb)
bench-packing: ## Replay the openb GPU trace through the structured allocator per tessera policy (bench-results/)
	cargo build -p tessera-controller -p tessera-kubelet-plugin
	cd e2e/bench && GOTOOLCHAIN=local go run . -out $(CURDIR)/bench-results $(BENCH_ARGS)

# The same benchmark through the real kube-scheduler: a stratified 1-in-N sample of the trace's nodes and
# pods on a control plane of its own (e2e/scripts/bench-scheduler.sh), every scheduling decision checked
# against the structured allocator. Exits non-zero on any disagreement.
BENCH_SAMPLE_EVERY ?= 10
BENCH_ARGS = -openb-dir $(BENCH_OPENB_DIR) -controller $(CURDIR)/target/debug/tessera-controller \
	-plugin $(CURDIR)/target/debug/tessera-kubelet-plugin
bench-scheduler: ## 1 in 10 of the trace through the real kube-scheduler, checked against the allocator (~35 min on 2 cores)
	cargo build -p tessera-controller -p tessera-kubelet-plugin
	e2e/scripts/bench-scheduler.sh -skip-full -sample-every $(BENCH_SAMPLE_EVERY) -out $(CURDIR)/bench-results $(BENCH_ARGS)

test-sample: ## The scheduler check in `make test`: 1 in 100 of the trace (committed) through the real kube-scheduler (~1 min)
	cargo build -p tessera-controller -p tessera-kubelet-plugin
	e2e/scripts/bench-scheduler.sh -skip-full -sample-every 1 -openb-dir $(CURDIR)/e2e/bench/testdata/openb-1in100 \
		-controller $(CURDIR)/target/debug/tessera-controller -plugin $(CURDIR)/target/debug/tessera-kubelet-plugin \
		-out $(CURDIR)/bench-results/test-sample

# kube-scheduler's pods/s per policy on 100, 300 and 1,000 fake nodes, 1.37.2 and 1.38 side by side
# (e2e/scripts/bench-scheduler-rate.sh: RATE_VERSIONS, RATE_NODES, RATE_POLICIES, RATE_TIME_BOX).
bench-scheduler-rate: ## Scheduler throughput, 1.37 vs 1.38, whole / dynamic MIG / lean-mig on 100-1,000 nodes (RATE_VERSIONS="1.37 1.38:hints-off 1.38:counter-cache"; ~45 min)
	cargo build -p tessera-controller -p tessera-kubelet-plugin
	e2e/scripts/bench-scheduler-rate.sh

# Performance budget (issue 15): prepare latency and the plugin's footprint (kubelet's own DRA manager
# driving the plugin's socket), and the controller with 1,000 nodes on a real API server. Tables in
# e2e/bench/results/{prepare,footprint,controller}.md. Not pass/fail: they exit non-zero only when the
# benchmark itself breaks, never on a timing. `make bench-smoke` runs both small (what `make test` runs).
.PHONY: bench-prepare bench-controller bench-smoke
BENCH_PREPARE_ARGS ?= -claims 1000 -concurrency 1,8 -footprint-prepares 100
BENCH_CONTROLLER_ARGS ?= -nodes 1000 -shapes h100,h200,mix -steady 5m
# The full runs measure the release binaries (what ships); bench-smoke uses the debug ones `make test` built.
BENCH_RELEASE = PLUGIN_BIN=$(CURDIR)/target/release/tessera-kubelet-plugin CONTROLLER_BIN=$(CURDIR)/target/release/tessera-controller
bench-prepare: ## Prepare/unprepare latency via kubelet's DRA manager (1,000 claims per kind) and the plugin's RSS
	cargo build --release -p tessera-kubelet-plugin -p tessera-controller
	$(BENCH_RELEASE) e2e/scripts/bench-prepare.sh $(BENCH_PREPARE_ARGS) -out $(CURDIR)/e2e/bench/results/prepare.md \
		-footprint-out $(CURDIR)/e2e/bench/results/footprint.md
bench-controller: ## The controller with 1,000 nodes (8 H100 / 8 H200 / mix) on a real API server: convergence, writes, RSS
	cargo build --release -p tessera-kubelet-plugin -p tessera-controller
	$(BENCH_RELEASE) e2e/scripts/bench-controller.sh $(BENCH_CONTROLLER_ARGS) -out $(CURDIR)/e2e/bench/results/controller.md
bench-smoke: ## Both benchmarks at a small size (20 claims, 10 nodes) so they cannot rot; tables in bench-results/smoke/
	cargo build -p tessera-kubelet-plugin -p tessera-controller
	e2e/scripts/bench-prepare.sh -claims 20 -concurrency 1,8 -footprint-prepares 20 \
		-out $(CURDIR)/bench-results/smoke/prepare.md -footprint-out $(CURDIR)/bench-results/smoke/footprint.md
	e2e/scripts/bench-controller.sh -nodes 10 -shapes h100,mix -steady 10s -settle 5s -heartbeat-interval 2s \
		-timeout 90s -out $(CURDIR)/bench-results/smoke/controller.md

# Read-only GPU check (issue 21) for a node with a real NVIDIA GPU: discovery and the CDI spec through the nvml
# backend, the MIG UUID check, the NEEDED entries of the real libnvidia-ml.so.1, and the CUDA probe started
# with the generated spec; then (issue 38, section 7) the simulator's rules against this driver, as a table of
# CONFIRMED / CONTRADICTED / NOT SEEN with the rules to change in the simulator: the GPU-instance profile
# calls V and v1 with MIG off (N6), the compute and MPS process lists and the utilization samples' PIDs
# under a running MPS share (N7), nvmlDeviceGetHandleByUUID under concurrent scrapes (N8), fabric info (N3),
# the hook directory's noexec mount and the host's ldconfig (N1); the NVML facts come from
# kubelet-plugin/examples/driver_facts.rs. Changes no MIG mode, compute mode or time-slice, starts no MPS
# daemon, resets nothing. Output and files in
# bench-results/gpu-check/ (GPU_CHECK_ROOT=<driver root> to name it; found otherwise).
.PHONY: gpu-check
gpu-check: ## Read-only check of the nvml path on a real GPU node, and which simulator rules it confirms (changes no GPU setting); bench-results/gpu-check/
	cargo build -p tessera-kubelet-plugin --bin tessera-kubelet-plugin --example driver_facts
	e2e/scripts/gpu-check.sh $(GPU_CHECK_ROOT)

# Image and Helm chart (issue 11). `make image` writes target/image/tessera.tar, an OCI image archive
# (no Docker, no registry) of the release binaries and exactly the libraries they load; the same layout as
# deployments/container/Dockerfile. `make image-test` also checks its digests and config and runs both
# binaries from the unpacked rootfs in a chroot. `make chart-lint`: helm lint (Helm built from Go modules,
# e2e/tools/helm) for both backends; the chart's server-side dry run is the e2e scenario TestTheChart*.
.PHONY: image image-test chart-lint
image: ## OCI image archive of both release binaries and the simulated driver (/usr/lib/tessera-sim), daemonless (target/image/tessera.tar)
	e2e/scripts/build-image.sh
# `make test` checks the archive built from the debug binaries it already has (IMAGE_PROFILE=debug): the
# builder and the layout are what is tested, and a second, release, build would cost it minutes.
image-test: ## make image, then check the archive (digests, config) and run the binaries from its rootfs
	e2e/scripts/build-image.sh --test
chart-lint: ## helm lint --strict of deployments/helm/tessera for the nvml (driverRoot default and /) and simulated backends
	e2e/scripts/build-helm.sh
	@for l in crds files/classes files/policies files/prometheus; do test -L deployments/helm/tessera/$$l || \
		{ echo "deployments/helm/tessera/$$l must be a link into deployments/ (one source)"; exit 1; }; done
	e2e/bin/helm lint --strict deployments/helm/tessera --set backend=nvml
	e2e/bin/helm lint --strict deployments/helm/tessera --set backend=nvml --set driverRoot=/
	e2e/bin/helm lint --strict deployments/helm/tessera --set backend=simulated --set gpuPolicy.preset=mixed

# Admission webhook latency (issue 14): AdmissionReviews of a typical share claim over HTTPS on 127.0.0.1
# to the webhook's own server, p50/p90/p99 printed, never asserted; recorded in e2e/bench/results/webhook.md.
.PHONY: bench-webhook
bench-webhook: ## Webhook latency over HTTPS on 127.0.0.1 (2,000 AdmissionReviews of a typical claim; release build)
	cargo run --release -p tessera-controller --example webhook_bench -- 2000
