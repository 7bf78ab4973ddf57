#!/usr/bin/env bash
# The wheels the GPU box lacks, into .whl/ (which scripts/device_check.sh's runs carry): the versions this
# checkout's .venv holds, with their dependencies, for the box's CPython 3.12 on x86-64 Linux. The box has
# torch, triton, numpy, safetensors, tokenizers and transformers; these add the server, constrained decoding,
# the block checksums and the GPU tests' clients (~18 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
pip=${PIP:-.venv/bin/pip}
pins=$($pip list --format=freeze | grep -iE "^(llguidance|crc32c|fastapi|uvicorn|jsonschema[-_]rs|openai)==")
platforms="manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64"
# shellcheck disable=SC2046,SC2086
$pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  $(printf -- "--platform %s " $platforms) -d .whl $pins
ls .whl
