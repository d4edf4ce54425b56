#!/usr/bin/env bash
# Wheels of what the GPU machine's image lacks for `python -m framework.run` (its python3 is CPython 3.12 with
# torch, triton, transformers, pytest and most of this project's needs; no network there). Run here, where pip
# works; carry the folder to the device (the device tool's `carry: [".whl"]`), where experiments/gpu_check.sh
# installs them. Usage: bash experiments/gpu_wheels.sh [DIR]   (default .whl, added to .git/info/exclude)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
mkdir -p "$DIR"
case $DIR in /*) ;; *) grep -qxF "/$DIR/" .git/info/exclude 2>/dev/null || echo "/$DIR/" >>.git/info/exclude ;; esac
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$DIR" hydra-core==1.3.2 omegaconf==2.3.0 orjson
# omegaconf's parser runtime is published as a source archive only: built here (pure Python).
python3 -m pip wheel -q --no-deps -w "$DIR" antlr4-python3-runtime==4.9.3
ls "$DIR"
