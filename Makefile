# The two commands of the README: `make demo` and `make test`. Both build .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build, pinned: a bare `torch` requirement would pull the multi-GB CUDA wheels.
TORCH ?= torch==2.13.0
DEMO_ARGS ?=

.PHONY: setup demo test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[test,plot]'
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
