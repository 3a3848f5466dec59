#!/usr/bin/env bash
# On the GPU machine (CUDA driver, PyTorch, no Rust, no network): every device
# check of issue 37 in one command, under 8 minutes. Needs .gpu/temper.xz,
# written by scripts/gpu/build.sh (carried with the working tree).
#
#   scripts/gpu/run.sh [OUT_DIR] [checks.py flags...]   # default OUT_DIR: $OUT or runs/gpu
#
# Writes OUT_DIR/checks.json (every number), OUT_DIR/checks.log and
# OUT_DIR/env.log (the GPU, the driver, the libraries the binary resolved).
set -uo pipefail
out="${1:-${OUT:-runs/gpu}}"
[ $# -gt 0 ] && shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# candle links cuBLAS, cuRAND and NVRTC (CUDA 13): PyTorch's wheels carry them.
libs=$(python3 - <<'PY'
import glob, os, sys
print(":".join(sorted({d for p in sys.path for d in glob.glob(os.path.join(p, "nvidia", "*", "lib"))})))
PY
)
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# The binary travels compressed (scripts/gpu/build.sh).
temper=/tmp/temper-gpu
python3 -c 'import lzma, sys; open(sys.argv[2], "wb").write(lzma.open(sys.argv[1]).read())' \
    .gpu/temper.xz "$temper" && chmod +x "$temper" || exit 1
{
    nvidia-smi
    python3 -c 'import torch, transformers, peft; print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__)'
    ldd "$temper" | grep -E "cuda|cublas|curand|nvrtc|not found"
} > "$out/env.log" 2>&1
cat "$out/env.log"
timeout 470 python3 scripts/gpu/checks.py --temper "$temper" --device cuda --out "$out" "$@"
rc=$?
[ $rc = 124 ] && echo "checks.py ran past 470 s: partial results in $out/checks.log"
exit $rc
