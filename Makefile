# weightsync developer entry points. `make demo` and `make test` are the README's two commands.
.DEFAULT_GOAL := help
PY := .venv/bin/python
export PYTHONUNBUFFERED := 1

help:  ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

venv:  ## build .venv with torch 2.13.0, vLLM (CPU build) and the test tools (idempotent)
	@bash tools/setup-env.sh

demo: venv  ## the embedded default: coordinator, 2 vLLM replicas, a GRPO trainer; reward rises as weights sync
	.venv/bin/weightsync demo

sandbox: venv  ## sync a trainer into one real vLLM engine on a generated tiny model and verify it
	.venv/bin/weightsync sandbox

lint: venv  ## ruff (lint + format check) and mypy
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

format: venv  ## apply ruff's formatting and fixes
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

models: venv  ## generate and cache the tiny test models
	.venv/bin/weightsync models tiny-qwen2 tiny-llama

e2e-tools: ## build (once, cached under ~/.cache/weightsync) the control plane binaries, kubectl and helm
	@bash e2e/cluster.sh tools >/dev/null

node-tools: containers e2e-tools  ## build (once, cached) the real node's kubelet, kube-proxy and CoreDNS
	@bash e2e/node.sh tools >/dev/null

crds: venv  ## regenerate crds/ and the chart's CRD copy from weightsync/resources
	.venv/bin/weightsync crds

proto: venv  ## regenerate the gRPC code in weightsync/coordinator/_proto from proto/
	$(PY) -m weightsync.coordinator.codegen

test: venv lint models e2e-tools node-tools images  ## everything CI runs: lint, type checks, all test tiers (e2e on a real control plane, the images on its real node)
	.venv/bin/weightsync crds --check
	$(PY) -m weightsync.coordinator.codegen --check
	WEIGHTSYNC_E2E=1 WEIGHTSYNC_IMAGES=1 $(PY) -m pytest tests --durations=40

e2e: venv e2e-tools  ## only the e2e tier (starts and stops the local control plane)
	$(PY) -m pytest tests -m e2e

e2e-kueue: venv e2e-tools  ## gang admission by Kueue: 10 jobs on 16 GPUs with real Kueue (builds it once, ~20 min cold)
	bash e2e/cluster.sh kueue-tools >/dev/null
	WEIGHTSYNC_E2E_KUEUE=1 $(PY) -m pytest tests/e2e/test_operator_kueue.py -m e2e

unit: venv  ## only the unit tier (seconds)
	$(PY) -m pytest tests -m unit

integration: venv models  ## only the integration tier (real vLLM, real processes)
	$(PY) -m pytest tests -m integration

faults: venv models  ## the full fault suites on the multi-host fleet (CI runs a representative set); tables in build/
	@mkdir -p build
	WEIGHTSYNC_FAULTS=all WEIGHTSYNC_FAULTS_TABLE=build/faults.md WEIGHTSYNC_ISOLATION_TABLE=build/isolation.md \
		$(PY) -m pytest tests/integration/test_fleet_hosts.py tests/integration/test_fleet_hosts_faults.py \
		tests/integration/test_fleet_hosts_isolation.py \
		tests/integration/test_nccl_exclusion.py

serving: venv models  ## the longer serving runs (MoE models served and in the sandbox, no tokenizer files, the by-hand command, the demo staged and without sync); CI runs a representative set
	WEIGHTSYNC_SERVING=all $(PY) -m pytest tests/integration/test_served_moe.py tests/integration/test_sandbox.py \
		tests/integration/test_by_hand.py tests/integration/test_demo.py

layouts: venv models  ## every architecture's recorded engine layout against vLLM's loaders, trainer layouts on 4 ranks (CI runs a representative set)
	WEIGHTSYNC_LAYOUTS=all $(PY) -m pytest tests/integration/test_engine_layouts.py tests/integration/test_trainer_layouts.py

sharded: venv models  ## the sharded data path: region streams to TP=2 and TP=1 replicas and their faults (a rank killed mid-send and inside the gather; the torn replicas recover), landing against vLLM's loader, the publisher and agents to TP=2 and TP=1 replicas in one version, from 4 ranks, with a flipped byte and a rank killed mid-send, a mixture-of-experts trainer sending each expert from the rank that holds it, a served TP=2 vLLM with its agent and proxy on a host of its own taking its regions (CI runs the publisher's regions to a TP=2 engine)
	WEIGHTSYNC_SHARDED=all $(PY) -m pytest tests/integration/test_region_stream.py tests/integration/test_landing.py \
		tests/integration/test_sharded_engine.py tests/integration/test_sharded_publish.py tests/integration/test_sharded_moe.py \
		tests/integration/test_served_sharded.py

sharded-volume: venv models  ## the sharded volume with real ranks: a TP=2 engine loading it whole, a TP=2 engine behind its agent catching up by region (damaged and truncated rank files refused), the rank faults (CI runs the write, reads and publisher)
	WEIGHTSYNC_SHARDED_VOLUME=all $(PY) -m pytest tests/integration/test_sharded_volume.py

frameworks: venv models  ## every framework integration on a two-replica multi-host fleet (TRL, Atropos, vLLM's factory, verl; make test runs TRL and Atropos on one replica)
	WEIGHTSYNC_FRAMEWORKS=all $(PY) -m pytest tests/integration/test_frameworks.py

extras: venv  ## every component with only its own extra, in clean virtualenvs (trainer, inference: gigabytes)
	WEIGHTSYNC_EXTRAS=all $(PY) -m pytest tests/integration/test_extras.py

container-tests: venv models node-tools images  ## build the images, run each as a container and the chart + examples/rljob.yaml on a real node (make test runs all but the vLLM container's greedy completion)
	WEIGHTSYNC_E2E=1 WEIGHTSYNC_IMAGES=all $(PY) -m pytest -m "e2e or integration" \
		tests/integration/test_image_containers.py tests/e2e/test_containers.py

containers: ## install podman, runc, containerd, the CNI plugins, debootstrap, iptables, socat (apt, once; root)
	@bash tools/setup-containers.sh

images: venv containers  ## build the four images' CPU variant on bases made here, cached by content (~/.cache/weightsync/images)
	@bash images/build.sh cpu

.PHONY: help venv demo sandbox lint format models e2e-tools crds proto test e2e e2e-kueue unit integration faults serving layouts sharded sharded-volume frameworks extras containers node-tools container-tests images
