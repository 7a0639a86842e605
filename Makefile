# Everything a newcomer needs: `make test` sets up .venv, installs, builds and runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NATIVE_STAMP := $(VENV)/.native
NATIVE_SOURCES := $(shell find native -name '*.cpp' -o -name '*.h') setup.py
PROTOS := $(shell find protos -name '*.proto')
PROTO_STAMP := tandem/.generated

.PHONY: test setup native protos serve clean

# `make serve`: the whole stack on this host (MODEL=dir, PORT=8000, FORMAT=bf16|int8|int4, DTYPE=float32|bfloat16)
MODEL ?=
PORT ?= 8000
FORMAT ?=
DTYPE ?=
SERVE_ARGS := $(if $(MODEL),--model $(MODEL)) --port $(PORT) $(if $(FORMAT),--format $(FORMAT)) $(if $(DTYPE),--dtype $(DTYPE))

setup: $(NATIVE_STAMP) $(PROTO_STAMP)

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

# gRPC code is generated from protos/ into tandem/ (importable as tandem.v1) and never edited.
$(PROTO_STAMP): $(STAMP) $(PROTOS)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. $(PROTOS)
	touch $(PROTO_STAMP)

protos: $(PROTO_STAMP)

serve: setup
	$(VENV)/bin/tandem serve $(SERVE_ARGS)

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .cache build *.egg-info tandem_native*.so tandem
