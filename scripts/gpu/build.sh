#!/usr/bin/env bash
# Build temper with `--features cuda` on a machine with no GPU and no CUDA
# install, for a GPU machine that has the driver, CUDA 13 and PyTorch but no
# Rust and no network (issue 37; run the result with scripts/gpu/run.sh).
#
#   scripts/gpu/build.sh [OUT_DIR]     # default: .gpu (git-ignored)
#
# The CUDA 13.0 compiler, headers and libraries come from PyPI's NVIDIA wheels
# (cached in ~/.cache/temper/cuda). candle links the driver API dynamically
# (cudarc's `dynamic-linking`), and libcuda.so ships with the driver, not
# with any wheel: the link here uses a stub whose soname is libcuda.so.1, so
# the GPU machine's driver library is the one loaded at run time. Kernels are
# built for compute capability 9.0 (H100/H200; CUDA_COMPUTE_CAP overrides).
# OUT_DIR receives temper.xz, the stripped binary compressed to stay under
# the device's 64 MiB limit for what travels.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
out="${1:-$repo/.gpu}"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/temper/cuda"
cuda="$cache/root/nvidia/cu13"
# nvcc + its front end (nvvm's cicc) + headers (crt, runtime, cccl's libcu++) + the
# libraries candle links (nvrtc, curand, cublas).
wheels=("nvidia-cuda-nvcc==13.0.88" "nvidia-nvvm==13.0.88" "nvidia-cuda-crt==13.0.88"
        "nvidia-cuda-runtime==13.0.96" "nvidia-cuda-cccl==13.0.85" "nvidia-cuda-nvrtc==13.0.88"
        "nvidia-curand==10.4.5.25" "nvidia-cublas==13.0.2.14")
if [ ! -x "$cuda/nvvm/bin/cicc" ] || [ ! -e "$cuda/include/cccl/nv/target" ] || [ ! -e "$cuda/lib64/libcuda.so" ]; then
    echo "== CUDA 13.0 toolkit from PyPI wheels -> $cache (once; ~900 MB download)"
    mkdir -p "$cache/whl" "$cache/root"
    python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$cache/whl" "${wheels[@]}"
    for w in "$cache"/whl/*.whl; do python3 -m zipfile -e "$w" "$cache/root"; done
    chmod +x "$cuda"/bin/* "$cuda"/nvvm/bin/* 2>/dev/null || true
    # The linker wants unversioned names; the wheels ship only versioned ones.
    mkdir -p "$cuda/lib64"
    for l in cublas cublasLt curand nvrtc cudart; do
        so=$(ls "$cuda"/lib/lib$l.so.* | grep -v alt | head -1)
        ln -sf "$so" "$cuda/lib64/lib$l.so"
    done
    # libcuda.so stub: every driver function cudarc binds, each answering
    # CUDA_ERROR_NO_DEVICE (100), so the binary also runs here, on the CPU.
    cudarc=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.10 2>/dev/null | head -1)
    if [ -z "$cudarc" ]; then (cd "$repo" && cargo fetch --quiet); cudarc=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.10 | head -1); fi
    grep -o '^pub unsafe fn cu[A-Za-z0-9_]*' "$cudarc/src/driver/sys/mod.rs" | awk '{print "int " $4 "(void) { return 100; }"}' \
        | sort -u > "$cache/libcuda_stub.c"
    cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$cuda/lib64/libcuda.so" "$cache/libcuda_stub.c"
    ln -sf libcuda.so "$cuda/lib64/libcuda.so.1"
fi
export PATH="$cuda/bin:$PATH" CUDA_ROOT="$cuda" CUDA_HOME="$cuda"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}" CARGO_TARGET_DIR="$repo/target/cuda"
export CARGO_INCREMENTAL=0
echo "== cargo build --release --features cuda (nvcc $(nvcc --version | grep -o 'release [0-9.]*'), sm_$CUDA_COMPUTE_CAP)"
(cd "$repo" && cargo build --release --features cuda -p temper)
mkdir -p "$out"
# Stripped it is ~85 MB (candle's kernels for sm_90 inside), over the 64 MiB
# that travels to the GPU machine: it travels xz-compressed (~15 MB) and
# scripts/gpu/run.sh unpacks it with Python's lzma.
strip -o "$out/temper" "$CARGO_TARGET_DIR/release/temper"
xz -T0 -6 -c "$out/temper" > "$out/temper.xz"
rm "$out/temper"
echo "built $out/temper.xz ($(du -h "$out/temper.xz" | cut -f1)); here it runs on the CPU with"
echo "  LD_LIBRARY_PATH=$cuda/lib64:$cuda/lib (the driver stub answers: no CUDA device)"
