#!/usr/bin/env bash
# Makes bench/.venv-kt, holding kt-kernel 0.7.2, for bench/kernels.py (its rows run in this venv).
# kt-kernel declares torch==2.9.1, which pulls a multi-GB CUDA build; its extension does not link
# libtorch, so a CPU torch plus `--no-deps` is enough. Its wheel is cp311: PYTHON must be 3.11.
# Where PyPI's torch is the CUDA build, point pip at the CPU one first:
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu bench/setup_ktkernel.sh
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
VENV=.venv-kt
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check \
    torch==2.13.0 safetensors numpy gguf typer rich pyyaml httpx packaging
"$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps kt-kernel==0.7.2
"$VENV/bin/python" -c "import kt_kernel; print('kt_kernel', kt_kernel.__cpu_variant__)"
