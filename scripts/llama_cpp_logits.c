// llama.cpp's side of temper's GGUF golden test (scripts/llama_cpp_golden.sh
// builds and runs it; see docs/guide/gguf.md). Two modes:
//
//   quantize IN OUT FTYPE   llama_model_quantize (what llama-quantize runs),
//                           FTYPE a llama_ftype number, requantizing allowed
//   golden MODEL PROMPT TOPK NGEN
//                           tokenize PROMPT (with the model's BOS), decode
//                           it in one batch with every position's logits,
//                           then NGEN greedy tokens (argmax of the logits,
//                           one token per decode); prints JSON: the prompt
//                           ids, per position the TOPK best (id, logit) and
//                           the log-sum-exp over the vocabulary, and the
//                           greedy ids.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llama.h"

static void quiet(enum ggml_log_level level, const char *text, void *data) {
    (void)data;
    if (level >= GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

static int argmax(const float *x, int n) {
    int best = 0;
    for (int i = 1; i < n; i++) {
        if (x[i] > x[best]) {
            best = i;
        }
    }
    return best;
}

static void print_position(const float *logits, int n_vocab, int topk) {
    double mx = logits[argmax(logits, n_vocab)], sum = 0.0;
    for (int i = 0; i < n_vocab; i++) {
        sum += exp((double)logits[i] - mx);
    }
    int *taken = calloc((size_t)n_vocab, sizeof(int));
    printf("{\"lse\":%.9g,\"top\":[", mx + log(sum));
    for (int k = 0; k < topk; k++) {
        int best = -1;
        for (int i = 0; i < n_vocab; i++) {
            if (!taken[i] && (best < 0 || logits[i] > logits[best])) {
                best = i;
            }
        }
        taken[best] = 1;
        printf("%s[%d,%.9g]", k ? "," : "", best, logits[best]);
    }
    printf("]}");
    free(taken);
}

static int golden(const char *path, const char *prompt, int topk, int ngen) {
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    struct llama_model *model = llama_model_load_from_file(path, mp);
    if (!model) {
        fprintf(stderr, "cannot load %s\n", path);
        return 1;
    }
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    int n_vocab = llama_vocab_n_tokens(vocab);
    llama_token toks[512];
    int n = llama_tokenize(vocab, prompt, (int)strlen(prompt), toks, 512, true, true);
    if (n <= 0 || n + ngen > 512) {
        fprintf(stderr, "prompt: %d tokens\n", n);
        return 1;
    }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 512;
    cp.n_batch = 512;
    cp.n_threads = 2;
    cp.n_threads_batch = 2;
    // An f32 KV cache (llama.cpp's default is f16): the comparison then
    // measures the weights' and activations' rounding only.
    cp.type_k = GGML_TYPE_F32;
    cp.type_v = GGML_TYPE_F32;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    struct llama_batch batch = llama_batch_init(512, 0, 1);
    for (int i = 0; i < n; i++) {
        batch.token[i] = toks[i];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = n;
    if (llama_decode(ctx, batch)) {
        fprintf(stderr, "decode failed\n");
        return 1;
    }
    printf("{\"prompt\":[");
    for (int i = 0; i < n; i++) {
        printf("%s%d", i ? "," : "", toks[i]);
    }
    printf("],\"positions\":[");
    for (int i = 0; i < n; i++) {
        printf("%s", i ? "," : "");
        print_position(llama_get_logits_ith(ctx, i), n_vocab, topk);
    }
    printf("],\"greedy\":[");
    int next = argmax(llama_get_logits_ith(ctx, n - 1), n_vocab);
    for (int g = 0; g < ngen; g++) {
        printf("%s%d", g ? "," : "", next);
        batch.token[0] = next;
        batch.pos[0] = n + g;
        batch.n_seq_id[0] = 1;
        batch.seq_id[0][0] = 0;
        batch.logits[0] = 1;
        batch.n_tokens = 1;
        if (llama_decode(ctx, batch)) {
            fprintf(stderr, "decode failed\n");
            return 1;
        }
        next = argmax(llama_get_logits_ith(ctx, 0), n_vocab);
    }
    printf("]}\n");
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}

int main(int argc, char **argv) {
    llama_log_set(quiet, NULL);
    llama_backend_init();
    if (argc == 5 && strcmp(argv[1], "quantize") == 0) {
        struct llama_model_quantize_params qp = llama_model_quantize_default_params();
        qp.ftype = (enum llama_ftype)atoi(argv[4]);
        qp.allow_requantize = true;
        qp.nthread = 2;
        return llama_model_quantize(argv[2], argv[3], &qp) ? 1 : 0;
    }
    if (argc == 6 && strcmp(argv[1], "golden") == 0) {
        return golden(argv[2], argv[3], atoi(argv[4]), atoi(argv[5]));
    }
    fprintf(stderr,
            "usage: %s quantize IN OUT FTYPE | golden MODEL PROMPT TOPK NGEN\n",
            argv[0]);
    return 2;
}
