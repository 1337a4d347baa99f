# `make demo` and `make test` create .venv and install what they need (CPU torch pinned).
VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0

.PHONY: demo test test-fast bench clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]" "$(TORCH)"
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/demo.py

test: $(VENV)/.installed
	$(PY) -m pytest -q -p no:cacheprovider --durations=15

test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow"

bench: $(VENV)/.installed
	$(PY) -m benchmarks.save

clean:
	rm -rf $(VENV) demo_run
