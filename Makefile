# Two commands do all set-up on a fresh machine (the venv is created on first use):
#   make demo   run the main job on 4 processes (CPU/gloo by default)
#   make test   single-process tests, then the 4-process suite
VENV   ?= .venv
PYTHON ?= python3
NPROC  ?= 4
# The CPU build of torch 2.13.0 lies on local disk on the project's CPU machines; elsewhere pip takes PyPI's build
# (on Linux the CUDA one, about 3 GB with its dependencies) unless TORCH_INDEX names another index, e.g.
# `make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu` for the CPU build.
TORCH  ?= torch==2.13.0
TORCH_INDEX ?=
# The newest supported torch, for `make test-torch-new` (CI's second leg): PyPI's build (CUDA, about 3 GB
# with its dependencies; it runs on CPU). It runs the single-process files where torch versions differ most: its
# private APIs, its compiler, custom ops and autograd Functions, FP8, the transformers swap, the processes' exit. The
# rest (the README's blocks, the examples' 4-process runs, the kernels' numerics) is the same code on the same public
# APIs: `make test` runs it on 2.13, the GPU run on 2.11.
TORCH_NEW ?= torch==2.15.0
VENV_NEW  ?= .venv-torch-new
NEW_SINGLE ?= tests/test_private_apis.py tests/test_public_api.py tests/test_kernel_op.py tests/test_compile.py \
	tests/test_compile_moe.py tests/test_fp8.py tests/test_fp8_two_forwards.py tests/test_moe.py tests/test_tensor.py \
	tests/test_agreement.py tests/test_host_reads.py tests/test_clip.py tests/test_transformers.py tests/test_shutdown.py
# The oldest supported torch, the GPU hosts' (`make test-torch-old`, CI's third leg): PyPI's build (CUDA, about 3 GB
# with its dependencies; it runs on CPU), with torchtitan; it runs the tests that trace (compile, single and
# 4-process), the torchtitan and transformers tests, where torch versions differ most, and the benchmarks' smoke runs
# (the GPU hosts run the benchmarks on this torch). Of the 4-process compile matrix (`make test-compile`: 8 minutes
# here) it takes the cases whose paths the default pair does not cover: EP on the SP axis sync-free, gather x EP,
# torch's default dynamic shapes, the symmetric transport, sync-free EP compiled from its first call without
# max_tokens (the default pair's sync-free EP case on this torch), the compiled gradient-overlap block (and on one
# rank only) and the symmetric transport's checkpointing policy. It also runs
# the training runs that `make test` leaves out (marker training_run: the transformers load-balancing run, 150 steps
# of a small Qwen3-MoE on 4 processes; the porting guide's transformers block; half a minute each).
TORCH_OLD ?= torch==2.11.0
VENV_OLD  ?= .venv-torch-old
OLD_SINGLE ?= tests/test_compile.py tests/test_compile_moe.py tests/test_torchtitan.py tests/test_docs_torchtitan.py \
	tests/test_transformers.py tests/test_docs_porting.py
COMPILED_LAYER := tests/distributed/test_compile_moe.py::test_compiled_layer_matches_eager_with_one_graph
OLD_DIST   ?= $(COMPILED_LAYER)[sp_x_ep] $(COMPILED_LAYER)[sp_ep-sync_free] \
	$(COMPILED_LAYER)[gather_ep] tests/distributed/test_compile_ep.py::test_compiled_ep_with_torchs_default_shapes[sync] \
	tests/distributed/test_symmetric.py::test_compiled_matches_eager[ep] \
	tests/distributed/test_grad_overlap.py::test_compiled_block_fullgraph \
	tests/distributed/test_grad_overlap.py::test_compiled_on_one_rank_eager_on_the_others \
	tests/distributed/test_symmetric.py::test_compiled_checkpointing_with_the_policy \
	tests/distributed/test_compile_moe.py::test_compiled_sync_free_without_max_tokens[ep] \
	tests/distributed/test_torchtitan.py tests/distributed/test_transformers.py
# torchtitan for the swap tests (tests/test_torchtitan.py; Python >= 3.11), without its training-only dependencies
TORCHTITAN ?= torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.0
TORCHTITAN_INSTALL = if $(VENV)/bin/python -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then \
	$(VENV)/bin/pip install -q --no-compile --no-deps $(TORCHTITAN); else echo "Python < 3.11: the torchtitan tests skip"; fi
# transformers for the swap tests (tests/test_transformers.py): what importing its models, save_pretrained and
# from_pretrained need, without its tokenizers and hub CLI dependencies
TRANSFORMERS ?= transformers==5.24.0 huggingface_hub==1.33.0 regex==2026.11.19 pyyaml==6.0.4 safetensors==0.8.0 \
	tqdm==4.70.1 httpx==0.28.1 httpcore==1.0.9 h11==0.16.0 idna==3.20 certifi==2026.10.19.post1 packaging
# pytest-xdist workers for the single-process suite: one a core, at most 8 (each imports torch)
JOBS     ?= $(shell $(PYTHON) -c 'import os; print(min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))')
PY       := $(VENV)/bin/python
TORCHRUN := $(VENV)/bin/torchrun
PYTEST   := -m pytest -q -p no:cacheprovider

.PHONY: demo venv test test-single test-dist test-bench test-compile venv-torch-new venv-torch-old test-torch-new \
	test-torch-old clean

# pip installs without compiling the packages' bytecode (it compiles one file at a time); compileall then does it on
# every core, as pip would have: about 50 s less of the venv's 2 minutes on 2 cores. (torch's py312_intrinsics.py
# is Python 3.12 syntax: pip skips it silently.)
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q --no-compile "$(TORCH)" $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)")
	$(VENV)/bin/pip install -q --no-compile -e ".[test]"
	$(if $(TORCHTITAN),$(TORCHTITAN_INSTALL))
	$(if $(TRANSFORMERS),$(VENV)/bin/pip install -q --no-compile --no-deps $(TRANSFORMERS))
	$(VENV)/bin/python -m compileall -q -j 0 -x py312_intrinsics \
		"$$($(VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
	touch $@

venv: $(VENV)/.installed

demo: $(VENV)/.installed
	$(TORCHRUN) --nproc-per-node $(NPROC) examples/train_moe.py

test: test-single test-dist

test-single: $(VENV)/.installed
	$(PY) $(PYTEST) -n $(JOBS) --dist worksteal

test-dist: $(VENV)/.installed
	$(TORCHRUN) --nproc-per-node 4 $(PYTEST) tests/distributed

# The benchmarks' --smoke runs (marker bench: whole benchmarks in subprocesses, minutes on 2 cores), which plain
# pytest deselects; CI runs them once, in the torch-2.11 leg (the GPU hosts' torch). JOBS at once: much of a smoke
# run is one process tracing or importing on one core.
test-bench: $(VENV)/.installed
	$(PY) $(PYTEST) -n $(JOBS) --dist worksteal -m bench tests/test_benchmark_smoke.py

# The whole 4-process compiled-vs-eager matrix (marker compile_matrix: every plan and transport, torch's default
# shapes; plain pytest keeps one case per transport): minutes on 2 cores. CI runs it in the torch-2.11 leg.
test-compile: $(VENV)/.installed
	$(PY) $(PYTEST) -m compile_matrix tests/test_compile_moe.py
	$(TORCHRUN) --nproc-per-node 4 $(PYTEST) -m compile_matrix tests/distributed

# The venvs of the newest and the oldest supported torch (CI builds them while `make test` runs: they are downloads)
venv-torch-new:
	$(MAKE) $(VENV_NEW)/.installed VENV=$(VENV_NEW) TORCH="$(TORCH_NEW)" TORCHTITAN=

venv-torch-old:
	$(MAKE) $(VENV_OLD)/.installed VENV=$(VENV_OLD) TORCH="$(TORCH_OLD)"

# The single-process files where torch versions differ most (NEW_SINGLE) on the newest supported torch, in its own venv.
test-torch-new: venv-torch-new
	$(VENV_NEW)/bin/python $(PYTEST) -n $(JOBS) --dist worksteal $(NEW_SINGLE)

# The tests that trace, the torchtitan and transformers tests and the benchmarks' smoke runs on the oldest supported
# torch, in its own venv.
test-torch-old: venv-torch-old
	$(VENV_OLD)/bin/python $(PYTEST) -n $(JOBS) -m "" $(OLD_SINGLE)
	$(VENV_OLD)/bin/torchrun --nproc-per-node 4 $(PYTEST) -m "not bench" $(OLD_DIST)
	$(MAKE) test-bench VENV=$(VENV_OLD) TORCH="$(TORCH_OLD)"

clean:
	rm -rf $(VENV) $(VENV_NEW) $(VENV_OLD) build *.egg-info
