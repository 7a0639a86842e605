# Everything a newcomer needs: `make test` sets up .venv, installs, builds and runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NATIVE_STAMP := $(VENV)/.native
NATIVE_SOURCES := $(shell find native -name '*.cpp' -o -name '*.h') setup.py

.PHONY: test setup native clean

setup: $(NATIVE_STAMP)

# Reinstall only when the project's dependency list changes (the install builds native/ too).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

# Rebuild the kernels in place when their sources change.
$(NATIVE_STAMP): $(STAMP) $(NATIVE_SOURCES)
	$(PY) setup.py --quiet build_ext --inplace
	touch $(NATIVE_STAMP)

native: $(NATIVE_STAMP)

test: $(NATIVE_STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .cache build *.egg-info tandem_native*.so
