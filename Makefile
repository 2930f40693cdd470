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
# with its dependencies; it runs on CPU).
TORCH_NEW ?= torch==2.15.0
VENV_NEW  ?= .venv-torch-new
# The oldest supported torch, the GPU hosts' (`make test-torch-old`, CI's third leg): PyPI's build (CUDA, about 3 GB
# with its dependencies; it runs on CPU), with torchtitan; it runs the tests that trace (compile, single and
# 4-process) and the torchtitan tests, where torch versions differ most.
TORCH_OLD ?= torch==2.11.0
VENV_OLD  ?= .venv-torch-old
OLD_SINGLE ?= tests/test_compile.py tests/test_compile_moe.py tests/test_torchtitan.py tests/test_docs_torchtitan.py \
	tests/test_transformers.py tests/test_docs_porting.py \
	tests/test_benchmark_smoke.py::test_torchtitan_parallelize_benchmark_smoke \
	tests/test_benchmark_smoke.py::test_torchtitan_parallelize_compiled_blocks_benchmark_smoke
OLD_DIST   ?= tests/distributed/test_compile_moe.py tests/distributed/test_compile_ep.py tests/distributed/test_grad_overlap.py \
	tests/distributed/test_symmetric.py::test_compiled_matches_eager \
	tests/distributed/test_torchtitan.py tests/distributed/test_transformers.py
# torchtitan for the swap tests (tests/test_torchtitan.py; Python >= 3.11), without its training-only dependencies
TORCHTITAN ?= torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.0
TORCHTITAN_INSTALL = if $(VENV)/bin/python -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then \
	$(VENV)/bin/pip install -q --no-deps $(TORCHTITAN); else echo "Python < 3.11: the torchtitan tests skip"; fi
# transformers for the swap tests (tests/test_transformers.py): what importing its models, save_pretrained and
# from_pretrained need, without its tokenizers and hub CLI dependencies
TRANSFORMERS ?= transformers==5.24.0 huggingface_hub==1.33.0 regex==2026.11.19 pyyaml==6.0.4 safetensors==0.8.0 \
	tqdm==4.70.1 httpx==0.28.1 httpcore==1.0.9 h11==0.16.0 idna==3.20 certifi==2026.10.19.post1 packaging
# pytest-xdist workers for the single-process suite: one a core, at most 8 (each imports torch)
JOBS     ?= $(shell $(PYTHON) -c 'import os; print(min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))')
PY       := $(VENV)/bin/python
TORCHRUN := $(VENV)/bin/torchrun
PYTEST   := -m pytest -q -p no:cacheprovider

.PHONY: demo test test-single test-dist test-bench test-compile test-torch-new test-torch-old clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)")
	$(VENV)/bin/pip install -q -e ".[test]"
	$(if $(TORCHTITAN),$(TORCHTITAN_INSTALL))
	$(if $(TRANSFORMERS),$(VENV)/bin/pip install -q --no-deps $(TRANSFORMERS))
	touch $@

demo: $(VENV)/.installed
	$(TORCHRUN) --nproc-per-node $(NPROC) examples/train_moe.py

test: test-single test-dist

test-single: $(VENV)/.installed
	$(PY) $(PYTEST) -n $(JOBS) --dist worksteal

test-dist: $(VENV)/.installed
	$(TORCHRUN) --nproc-per-node 4 $(PYTEST) tests/distributed

# The benchmarks' --smoke runs (marker bench: whole benchmarks in subprocesses, minutes on 2 cores), which plain
# pytest deselects; CI runs them once, on this venv's torch.
test-bench: $(VENV)/.installed
	$(PY) $(PYTEST) -m bench tests/test_benchmark_smoke.py

# The whole 4-process compiled-vs-eager matrix (marker compile_matrix: every plan and transport, torch's default
# shapes; plain pytest keeps one case per transport): minutes on 2 cores. CI runs it in the torch-2.11 leg.
test-compile: $(VENV)/.installed
	$(PY) $(PYTEST) -m compile_matrix tests/test_compile_moe.py
	$(TORCHRUN) --nproc-per-node 4 $(PYTEST) -m compile_matrix tests/distributed

# The single-process suite (the examples' clean exit included) on the newest supported torch, in its own venv.
test-torch-new:
	$(MAKE) test-single VENV=$(VENV_NEW) TORCH="$(TORCH_NEW)" TORCHTITAN=

# The tests that trace, and the torchtitan tests, on the oldest supported torch, in its own venv.
test-torch-old:
	$(MAKE) $(VENV_OLD)/.installed VENV=$(VENV_OLD) TORCH="$(TORCH_OLD)"
	$(VENV_OLD)/bin/python $(PYTEST) -n $(JOBS) -m "" $(OLD_SINGLE)
	$(VENV_OLD)/bin/torchrun --nproc-per-node 4 $(PYTEST) -m "not bench" $(OLD_DIST)

clean:
	rm -rf $(VENV) $(VENV_NEW) $(VENV_OLD) build *.egg-info
