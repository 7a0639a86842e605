# Everything a newcomer needs: `make test` sets up .venv, installs, builds and runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NATIVE_STAMP := $(VENV)/.native
NATIVE_SOURCES := $(shell find native -name '*.cpp' -o -name '*.h') setup.py
PROTOS := $(shell find protos -name '*.proto')
PROTO_STAMP := tandem/.generated

.PHONY: test setup native protos serve clean grpc-cpp iproute2

# `make serve`: the whole stack on this host (MODEL=dir or file.gguf, GGUF=file, PORT=8000,
# FORMAT=bf16|int8|int4|int4_asym, DENSE_FORMAT=float|bf16|int8|int4|int4_asym, DTYPE=float32|bfloat16,
# TOOL_PARSER=auto|hermes|deepseek|kimi_k2|glm45|harmony, REASONING_PARSER=auto|think|none)
MODEL ?=
PORT ?= 8000
FORMAT ?=
GGUF ?=
DTYPE ?=
DENSE_FORMAT ?=
TOOL_PARSER ?=
REASONING_PARSER ?=
SERVE_ARGS := $(if $(MODEL),--model $(MODEL)) $(if $(GGUF),--gguf $(GGUF)) --port $(PORT) $(if $(FORMAT),--format $(FORMAT)) $(if $(DTYPE),--dtype $(DTYPE)) $(if $(DENSE_FORMAT),--dense-format $(DENSE_FORMAT)) $(if $(TOOL_PARSER),--tool-parser $(TOOL_PARSER)) $(if $(REASONING_PARSER),--reasoning-parser $(REASONING_PARSER))

setup: $(NATIVE_STAMP) $(PROTO_STAMP) iproute2

# Reinstall only when the project's dependency list changes (the install builds native/ too).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

# grpc++ and its code generator, for tandem_grpc (the inline gRPC stream's client and server): installed with
# apt where this runs as root (CI, a fresh box); elsewhere the build leaves tandem_grpc out and the
# inline stream runs on grpcio at both ends.
GRPC_CPP := pkg-config libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
grpc-cpp:
	@(command -v grpc_cpp_plugin && pkg-config --exists grpc++ protobuf) >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(GRPC_CPP) >/dev/null; } || \
	  echo "grpc++ is not installed (needs root and apt-get): building without tandem_grpc"

# iproute2's `ip`, for the test that gives the expert server a network namespace of its own (a
# second host): installed with apt where this runs as root; elsewhere that test skips.
iproute2:
	@command -v ip >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends iproute2 >/dev/null; } || \
	  echo "iproute2 is not installed (needs root and apt-get): the two-host test will skip"

# Rebuild the kernels (and tandem_grpc) in place when their sources change.
$(NATIVE_STAMP): $(STAMP) $(NATIVE_SOURCES) protos/tandem/v1/expert.proto | grpc-cpp
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
	rm -rf $(VENV) .cache build *.egg-info tandem_native*.so tandem_grpc*.so tandem
