# The two commands of the README: `make demo` and `make test`. Both build .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
# Every pip call is held to constraints.txt: the pinned CPU build of torch (a bare or ranged `torch`
# requirement, or a resolver backtrack, would otherwise pull the multi-GB CUDA wheels).
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
PIP := $(PY) -m pip install --progress-bar off --disable-pip-version-check
TORCH ?= torch==2.13.0
DEMO_ARGS ?=

.PHONY: setup setup-demo demo test bench compat gpu-check clean

# The demo needs torch and the package alone (~1 min); the test suite adds the extras it exercises.
setup-demo: $(VENV)/.demo
setup: $(VENV)/.test

$(VENV)/.demo: pyproject.toml constraints.txt
	@echo "== creating $(VENV) and installing $(TORCH) (CPU build, ~200 MB) and disttrain"
	python3 -m venv $(VENV)
	$(PIP) -q --upgrade pip
	$(PIP) -q "$(TORCH)"
	$(PIP) -q -e .
	$(PY) tests/install_check.py
	touch $@

# The tensorflow extra is tensorflow + tf-keras (Keras 2, whose model.fit works under
# MultiWorkerMirroredStrategy). A venv made before held tensorflow-cpu, whose files the same
# `tensorflow` folder would share: it goes first.
$(VENV)/.test: $(VENV)/.demo
	@echo "== installing the test extras: pytest, hypothesis, moto + s3fs, matplotlib, tensorflow + tf-keras, MkDocs (~2 GB, 1-3 min)"
	-$(PY) -m pip uninstall -y -q tensorflow-cpu 2>/dev/null
	$(PIP) -q -e '.[test,plot,tensorflow,ui]'
	$(PY) tests/install_check.py
	touch $@

demo: setup-demo
	$(VENV)/bin/disttrain run -n 2 examples/mnist_convnet.py $(DEMO_ARGS)

test: setup
	@echo "== the multi-node rig's system packages (openssh, iproute2, iptables, Slurm; needs root, else those tests skip)"
	-bash tests/rig_setup.sh
	$(PY) -m pytest -n 3 --dist loadfile --no-loadscope-reorder

bench: setup-demo
	$(PY) bench/overhead.py

# The torch range (bench/compat.py): one venv per torch of the matrix under .compat/ (PyPI's CUDA builds,
# ~5 GB each, reused between runs; the pinned version runs in .venv), each running the smoke set.
# COMPAT_ARGS: e.g. "--versions 2.6.0,2.15.0" or "--only hang verdict".
COMPAT_ARGS ?=
compat: setup
	$(PY) bench/compat.py $(COMPAT_ARGS)

# The GPU check (bench/gpu_check.py): no venv and no network, the python that holds the
# machine's own CUDA torch (GPU_PYTHON) with disttrain from src/; log and JSON under $OUT.
# GPU_CHECK_ARGS: e.g. "--only hang" to rerun the steps that failed.
GPU_PYTHON ?= python3
GPU_CHECK_ARGS ?=
gpu-check:
	PYTHONPATH=$(CURDIR)/src$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) bench/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
