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
# On AMX CPUs its AMX int8 path (ggml_backend_amx_mul_mat) segfaults on any batch of 2+ tokens
# of a q8_0 or q4_0 model (seen on a Sapphire Rapids class Xeon): it is compiled out there, which
# leaves llama.cpp its AVX-512 VNNI and repacked paths (GCC's explicit -mno-* win over -march=native).
ARGS="-DGGML_NATIVE=ON"
if grep -qw amx_int8 /proc/cpuinfo; then
    NO_AMX="-mno-amx-int8 -mno-amx-tile -mno-amx-bf16"
    ARGS="$ARGS '-DCMAKE_C_FLAGS=$NO_AMX' '-DCMAKE_CXX_FLAGS=$NO_AMX'"
fi
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
# built again when the flags it was built with (recorded in the venv) differ
if ! "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null || [ "$(cat "$VENV/.cmake-args" 2>/dev/null)" != "$ARGS" ]; then
    CMAKE_ARGS="$ARGS" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir --force-reinstall \
        --no-binary llama-cpp-python numpy "llama-cpp-python==$VERSION"
    echo "$ARGS" > "$VENV/.cmake-args"
fi
if ! test -f "$SDIST/llama_cpp_python-$VERSION/vendor/llama.cpp/convert_hf_to_gguf.py"; then
    mkdir -p "$SDIST"
    "$VENV/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
        -d "$SDIST" "llama-cpp-python==$VERSION"
    tar -xzf "$SDIST/llama_cpp_python-$VERSION.tar.gz" -C "$SDIST"
fi
"$VENV/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
