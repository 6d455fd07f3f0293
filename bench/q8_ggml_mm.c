/* ggml's own matrix product on one shape, for bench/q8_kernel.py: y = W x with W (n x k) of a GGUF type, quantized
 * by ggml from random values, x (rows x k) float32 -- what llama.cpp's CPU backend computes for a linear layer
 * (ggml_mul_mat: x converted to the type's activation blocks, Q8_0 or Q8_K, then the type's dot products).
 *
 *   cc -O3 -march=native -I <ggml>/include bench/q8_ggml_mm.c <ggml>/build/src/libggml-cpu.a \
 *      <ggml>/build/src/libggml-base.a -lstdc++ -lm -fopenmp -o q8_ggml_mm
 *   q8_ggml_mm TYPE K N ROWS THREADS ITERS      (prints: microseconds per product, the best of ITERS)
 *
 * One threadpool for all calls (made once, as llama.cpp's context does), weights in plain CPU memory (not the CPU
 * backend's repacked buffer types, which llama.cpp uses for Q4_0, IQ4_NL, Q4_K and Q8_0 on some CPUs). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "ggml-cpu.h"
#include "ggml.h"

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

int main(int argc, char **argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: %s TYPE K N ROWS THREADS ITERS\n", argv[0]);
        return 2;
    }
    const int k = atoi(argv[2]), n = atoi(argv[3]), rows = atoi(argv[4]), threads = atoi(argv[5]);
    const int iters = atoi(argv[6]);
    int type = -1;
    for (int t = 0; t < GGML_TYPE_COUNT; t++)
        if (ggml_type_name((enum ggml_type)t) && strcasecmp(ggml_type_name((enum ggml_type)t), argv[1]) == 0) type = t;
    if (type < 0) {
        fprintf(stderr, "unknown type %s\n", argv[1]);
        return 2;
    }
    ggml_cpu_init();
    const size_t bytes = ggml_row_size((enum ggml_type)type, k) * n + (size_t)4 * rows * (k + n) + (64 << 20);
    struct ggml_init_params params = {bytes, NULL, false};
    struct ggml_context *ctx = ggml_init(params);
    struct ggml_tensor *w = ggml_new_tensor_2d(ctx, (enum ggml_type)type, k, n);
    struct ggml_tensor *x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, rows);
    float *values = malloc(sizeof(float) * (size_t)k * n);
    srand(1);
    for (size_t i = 0; i < (size_t)k * n; i++) values[i] = ((float)rand() / RAND_MAX - 0.5f) * 0.1f;
    ggml_quantize_chunk((enum ggml_type)type, values, w->data, 0, n, k, NULL);
    for (size_t i = 0; i < (size_t)k * rows; i++) ((float *)x->data)[i] = (float)rand() / RAND_MAX - 0.5f;
    free(values);
    struct ggml_tensor *y = ggml_mul_mat(ctx, w, x);
    struct ggml_cgraph *graph = ggml_new_graph(ctx);
    ggml_build_forward_expand(graph, y);
    struct ggml_threadpool_params tpp = ggml_threadpool_params_default(threads);
    struct ggml_threadpool *pool = ggml_threadpool_new(&tpp);
    struct ggml_cplan plan = ggml_graph_plan(graph, threads, pool);
    plan.work_data = malloc(plan.work_size + 1);
    ggml_graph_compute(graph, &plan); /* warm-up */
    double best = 1e30;
    for (int i = 0; i < iters; i++) {
        const double start = now_us();
        ggml_graph_compute(graph, &plan);
        const double took = now_us() - start;
        best = took < best ? took : best;
    }
    printf("%.2f\n", best);
    ggml_threadpool_free(pool);
    ggml_free(ctx);
    return 0;
}
