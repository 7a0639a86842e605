#!/usr/bin/env bash
# Makes bench/.venv-llama, holding llama-cpp-python 0.3.36 built from its sdist for this CPU
# (-DGGML_NATIVE=ON; about 12 minutes on 2 cores), and unpacks the same sdist under
# .cache/llama-cpp/ for the converter it ships (vendor/llama.cpp/convert_hf_to_gguf.py), which
# bench/e2e.py and bench/quality.py run with the project's own Python (it needs torch).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
VERSION=0.3.36
VENV=.venv-llama
SDIST=../.cache/llama-cpp
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
if ! "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null; then
    CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-binary llama-cpp-python \
        numpy "llama-cpp-python==$VERSION"
fi
if ! test -f "$SDIST/llama_cpp_python-$VERSION/vendor/llama.cpp/convert_hf_to_gguf.py"; then
    mkdir -p "$SDIST"
    "$VENV/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
        -d "$SDIST" "llama-cpp-python==$VERSION"
    tar -xzf "$SDIST/llama_cpp_python-$VERSION.tar.gz" -C "$SDIST"
fi
"$VENV/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
