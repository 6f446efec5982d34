# The two commands of the README: `make demo` and `make test`. Both build .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build, pinned: a bare `torch` requirement would pull the multi-GB CUDA wheels.
TORCH ?= torch==2.13.0
# The TensorFlow path's tests run everywhere (CI included): the CPU build (~1.45 GB), and
# tf-keras (Keras 2, whose model.fit works under MultiWorkerMirroredStrategy) with --no-deps,
# because its requirement on the full `tensorflow` would install that next to tensorflow-cpu.
TF ?= tensorflow-cpu==2.21.0
TF_KERAS ?= tf-keras==2.21.0
DEMO_ARGS ?=

.PHONY: setup demo test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[test,plot,tensorflow]' "$(TF)"
	$(PY) -m pip install -q --no-deps "$(TF_KERAS)"
	touch $@

demo: setup
	$(VENV)/bin/disttrain run -n 2 examples/mnist_convnet.py $(DEMO_ARGS)

test: setup
	-bash tests/rig_setup.sh  # openssh/iproute2/iptables for the multi-node rig (needs root; else those tests skip)
	$(PY) -m pytest

bench: setup
	$(PY) bench/overhead.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
