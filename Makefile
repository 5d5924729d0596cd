# Two commands (see README):
#   make demo   set up .venv with what the demo needs and run the main job (a 4-rank Mixtral-shaped
#               MoE layer through comet's ops). How long it takes: README, "Two commands" (the
#               download of about 3 GB, then minutes of build: each step says how many).
#   make test   set up .venv with everything and run the whole test suite (C++ unit tests + pytest)
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
export CUDA_HOME ?= /usr/local/cuda
export MAX_JOBS ?= 2

# What building comet._C and running the demo need: torch 2.14.1 (its CUDA 13.0 build: nvcc 13.0
# compiles the kernels against it, it runs on CPU too) and pyproject.toml's build requirements;
# for the CUDA kernels (nvcc present, COMET_CUDA not 0) also the CUTLASS headers (nvidia-cutlass
# wheel) and NVSHMEM (torch's own pin).
BUILD_DEPS := torch==2.14.1 numpy ninja pybind11 setuptools wheel
CUDA_DEPS  := nvidia-cutlass==4.2.0.0 nvidia-nvshmem-cu13==3.4.5
# What the rest needs (make setup / make test): tests, matplotlib for the benchmark plots,
# megatron-core (newest for Python 3.11) for comet.megatron, transformers 5.23.0 for comet.hf (its
# pluggable "experts implementation" interface, new in 5.x).
EXTRA_DEPS := pytest pytest-timeout hypothesis matplotlib megatron-core==0.16.1 transformers==5.23.0
DEPS := $(BUILD_DEPS) $(CUDA_DEPS) $(EXTRA_DEPS)
WITH_NVCC := $(if $(filter 0,$(COMET_CUDA)),,$(shell command -v nvcc || ls $(CUDA_HOME)/bin/nvcc 2>/dev/null))

.PHONY: setup build build-demo demo test test-cpp test-tsan test-py test-py-nodes test-cuda-static \
	test-gpu test-gpu-sim test-mutants mutants bench docs docs-check clean

# Each depends on the Makefile, so that an existing .venv picks up a changed DEPS line.
$(VENV)/.build-deps: Makefile
	@echo "make: installing torch 2.14.1 and the build tools into $(VENV): a download of about 3 GB, then 1-2 min"
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(BUILD_DEPS) $(if $(WITH_NVCC),$(CUDA_DEPS))
	touch $@

$(VENV)/.deps: $(VENV)/.build-deps
	$(PIP) install -q $(DEPS)
	touch $@

# Builds comet._C in place (incremental with ninja): the CPU backend always, the CUDA kernels when
# nvcc is present (COMET_CUDA=0 skips them). The same pip line as README's: torch is installed
# first and the extension compiles against it (--no-build-isolation, see pyproject.toml).
BUILD_EXT = @echo "make: building comet._C, $(if $(WITH_NVCC),with the CUDA kernels (nvcc found; COMET_CUDA=0 skips them): \
	5.5 min on 2 idle cores,the CPU backend: 2.5 min on 2 idle cores), up to 4x that on a busy machine; a rebuild only \
	compiles what changed"; $(PIP) install -q --no-build-isolation --no-deps -e .

build: $(VENV)/.deps
	$(BUILD_EXT)

# What the demo needs only (no test, plotting or integration packages).
build-demo: $(VENV)/.build-deps
	$(BUILD_EXT)

setup: build

demo: build-demo
	$(PY) -m comet.demo --world 4

test-cpp:
	cmake -S . -B cbuild -G Ninja -DCMAKE_BUILD_TYPE=Release > /dev/null
	cmake --build cbuild -j2
	ctest --test-dir cbuild --output-on-failure

# ThreadSanitizer build of the C++ tests (the prologue programs and the fused layers on thread
# teams); any race report fails the run.
test-tsan:
	cmake -S . -B cbuild-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCOMET_TSAN=ON > /dev/null
	cmake --build cbuild-tsan -j2
	TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" ctest --test-dir cbuild-tsan --output-on-failure

test-py: setup
	$(PY) -m pytest tests -q -p no:cacheprovider

# The op suites again with every rank on a node of its own (the CPU analog of a multi-node group:
# every peer reached only through the link proxy, 20 us per put).
OP_SUITES = tests/test_ops_sim.py tests/test_ops_dist.py tests/test_op_options.py \
	tests/test_autograd.py tests/test_thread_teams.py tests/test_nn.py tests/test_cuda_rules.py \
	tests/test_partials_precision.py
test-py-nodes: setup
	COMET_CPU_RANKS_PER_NODE=1 COMET_CPU_LINK_LATENCY_US=20 $(PY) -m pytest $(OP_SUITES) -q -p no:cacheprovider

# Static checks of the CUDA kernels (no GPU needed): every .cu compiled for sm_80 and sm_90a with
# ptxas -v; fails on spills in GEMM kernels or serialized-wgmma / ignored-setmaxnreg warnings.
test-cuda-static: $(VENV)/.deps
	@if command -v nvcc >/dev/null || [ -x "$(CUDA_HOME)/bin/nvcc" ]; then \
		$(PY) tools/check_ptxas.py --jobs $(MAX_JOBS); \
	else echo "nvcc not found: CUDA static checks skipped"; fi

# Mutation check (tools/mutants.py): plausible one-line bugs applied to a copy of the repository,
# each of which must make its tests fail. CI runs the Python mutants (no rebuild, a few minutes);
# `make mutants` runs them all, the C++ ones relinking a CPU-only build (COMET_CUDA=0) with the
# mutated objects recompiled.
test-mutants: setup
	$(PY) tools/mutants.py --python-only

mutants: $(VENV)/.deps
	COMET_CUDA=0 $(PY) setup.py build_ext --inplace -q
	$(PY) tools/mutants.py

test: test-cpp test-tsan test-cuda-static test-py test-py-nodes test-mutants

# GPU tests: skip without a GPU; on a machine with N GPUs: make test-gpu NGPU=N
NGPU ?= 1
test-gpu: setup
	$(VENV)/bin/torchrun --nproc-per-node $(NGPU) -m pytest tests/gpu -q -s

# CPU benchmarks (all eight scripts, full size, 9.6 min + decode 40 s measured on 2 busy cores, bench/README.md;
# `python -m bench --smoke` for the CI size): tables + ./bench-results/*.json/png
# The multi-rank GPU cases on ONE GPU: W = 2 and 4 ranks as threads of one process, each with its
# own stream and share of the SMs (comet.Buffer.simulated_world(W, device="cuda"); docs/gpu.md,
# "Several ranks on one GPU"). Skips without a GPU.
test-gpu-sim: setup
	CUDA_MODULE_LOADING=EAGER $(PY) -m pytest tests/gpu/test_cuda_sim.py -q -s -p no:cacheprovider

bench: setup
	$(PY) -m bench

# The README's samples against what the code prints now (the demo's deterministic columns, the
# benchmark table's single home): fails when a sample goes stale.
# Rewrite every generated figure of the docs (the demo sample, the model tables) from the code;
# docs-check only compares (the test suite runs the same check).
docs: setup
	$(PY) tools/doc_figures.py

docs-check: setup
	$(PY) -m pytest tests/test_docs.py -q -p no:cacheprovider

clean:
	rm -rf build cbuild comet/_C*.so *.egg-info
