# The two commands of the README: each creates the virtualenv if it is missing, installs as CI
# does (torch pinned first, so no CUDA build is ever pulled), then runs its job.
#   make train   the main job: a tiny fine-tune with NxDTrainer under torchrun (tp=2)
#   make test    the tests (multi-process gloo on CPU); .ci/run calls it in a fresh virtualenv
#   make test-gpu  the GPU lane (every test marked cuda: 2-4 ranks on one GPU through cuda:gloo,
#                one-rank nccl, the examples under torchrun, Liger's kernels); on a machine with a GPU
#                and torch for CUDA (bench/gpu_lane.sh runs it on the lent GPU machine)
#   make test-xla  the XLA lane (tests marked xla) on one torch-xla device on the CPU (PJRT_DEVICE=CPU),
#                in its own virtualenv .venv-xla: torch-xla 2.9.0 needs torch 2.9.0 (docs/xla.md)
VENV ?= .venv
PYTHON := $(VENV)/bin/python

.PHONY: train test test-gpu test-xla install

install: $(VENV)/.installed

# --no-compile: byte-compiling every module of torch and transformers at install was more than half
# of the install's CPU time. Instead the bytecode of what every run imports is written once, by
# importing it (also where the environment sets PYTHONDONTWRITEBYTECODE: each new interpreter of the
# tests, torchrun's ranks among them, would compile torch and transformers again, ~10 s each).
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install -q --no-compile torch==2.13.0
	$(PYTHON) -m pip install -q --no-compile -e ".[test,trl,lightning,kernel-tests,hf-examples]"
	PYTHONDONTWRITEBYTECODE= $(PYTHON) -c "import torch.distributed.run, transformers.trainer, peft, trl, pytorch_lightning, lightning, pytest, xdist.plugin, execnet, nxd_hf"
	touch $@

train: install
	$(PYTHON) -m torch.distributed.run --nproc_per_node 2 examples/finetune_causal_lm.py

# Two pytest workers, each file on one (pytest-xdist, --dist loadfile: a file's tests share its
# rank pool): on 2 cores one worker left 16-20% of the CPU idle (spawns, imports, a rank waiting
# on its peer, the pytest process computing a reference alone) and the other worker fills it.
TEST_WORKERS ?= 2
test: install
	$(PYTHON) -m pytest tests -q -n $(TEST_WORKERS) --dist loadfile

# not through `install`: that pins the CPU build of torch; use the environment's CUDA torch
GPU_PYTHON ?= python3
# every file holding a cuda-marked test (collecting the whole suite would import what the GPU image may lack)
GPU_TESTS = $(shell grep -rl --include='test_*.py' 'mark\.cuda' tests)
test-gpu:
	PYTHONPATH=$(CURDIR):$$PYTHONPATH $(GPU_PYTHON) -m pytest -m cuda $(GPU_TESTS) -q

# torch 2.9.0 from PyPI is the CUDA build (its nvidia-* wheels come along; it runs on the CPU). uv installs
# them: pip took ~140 s of CPU unpacking those wheels, uv ~50 s. nxd_hf itself is not installed there
# (its dependencies and the test extra are, read from pyproject.toml): the lane imports it from this tree,
# so it never writes the tree and can run while `make install` does (.ci/run).
XLA_VENV ?= .venv-xla
XLA_PINS := torch==2.9.0 torch-xla==2.9.0 transformers==5.23.0 peft==0.21.2

$(XLA_VENV)/.installed: pyproject.toml
	python3 -m venv $(XLA_VENV)
	$(XLA_VENV)/bin/python -m pip install -q --no-compile uv
	$(XLA_VENV)/bin/uv pip install -q --python $(XLA_VENV)/bin/python -r pyproject.toml --extra test $(XLA_PINS)
	touch $@

test-xla: $(XLA_VENV)/.installed
	PJRT_DEVICE=CPU PYTHONPATH=$(CURDIR) $(XLA_VENV)/bin/python -m pytest -p no:cacheprovider -m xla tests/distributed/test_xla.py -q
