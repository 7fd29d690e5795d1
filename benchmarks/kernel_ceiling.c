/* The panel kernel's own loop against a whole product, alternating: how close real calls run to the
 * kernel's ceiling in the same minute. Built by benchmarks/kernel_ceiling.py, which includes
 * panel_gemm.c (its static kernels are what the loop calls).
 *
 *   kernel_ceiling THREADS M K N ROUNDS
 *
 * "loop": every thread calls the 12-row kernel on one L1-resident 12 × 256 input block and one
 * 256-line panel, over and over: the k loop alone, nothing to wait for but the FMA ports.
 * "whole": clover_panel_gemm on M × K × N, bf16 in and out, as a prefill's products run.
 * "fma": FMAs alone on registers, the ports' issue limit.
 * One line per round: fma, loop and whole GFLOP/s. Then the whole product's output is checked at a few
 * positions against fp64 sums over the logical weights (exit 4 if wrong), so the rate is that of a
 * correct product. */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define LOOP_K 256
#define LOOP_SECONDS 0.4

static volatile float sink;   /* results written here cannot be optimised away */

/* FMAs alone: 24 independent fp32 accumulators in registers, 16 lanes, per iteration, what the
 * FMA ports can issue. Returns GFLOP/s over all threads. */
static double bf16_value(uint16_t bits) {
    uint32_t u = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Weight (n, k) of the panel layout: column j < 16 of a panel sits in 16-bit slot 2j of each line,
 * column 16 + j in slot 2j + 1 (panel_gemm.c). */
static uint16_t weight_bits(const uint16_t *W, int K, int n, int k) {
    int j = n % PANEL;
    int slot = j < 16 ? 2 * j : 2 * (j - 16) + 1;
    return W[((size_t)(n / PANEL) * K + k) * PANEL + slot];
}

static int check(const uint16_t *A, const uint16_t *W, const uint16_t *C, int M, int K, int N) {
    int rows[3] = {0, M / 2, M - 1}, cols[4] = {0, 17, N / 2, N - 1};
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 4; j++) {
            int m = rows[i], n = cols[j];
            double ref = 0, mag = 0;
            for (int k = 0; k < K; k++) {
                double t = bf16_value(A[(size_t)m * K + k]) * bf16_value(weight_bits(W, K, n, k));
                ref += t;
                mag += fabs(t);
            }
            double got = bf16_value(C[(size_t)m * N + n]);
            if (fabs(got - ref) > fabs(ref) / 128 + mag * 1e-5) {      /* bf16 rounding + fp32 sums */
                fprintf(stderr, "C[%d, %d] = %g, expected %g\n", m, n, got, ref);
                return 0;
            }
        }
    return 1;
}

static double fma_peak(int threads) {
    double flops = 0, t = now();
    #pragma omp parallel num_threads(threads) reduction(+ : flops)
    {
        __m512 acc[24], x = _mm512_set1_ps(0.999f), y = _mm512_set1_ps(0.001f);
        for (int i = 0; i < 24; i++) acc[i] = _mm512_set1_ps((float)i);
        double start = now();
        while (now() - start < LOOP_SECONDS) {
            for (int n = 0; n < 100000; n++) {
                _Pragma("GCC unroll 24")
                for (int i = 0; i < 24; i++) acc[i] = _mm512_fmadd_ps(acc[i], x, y);
            }
            flops += 100000.0 * 24 * 16 * 2;
        }
        __m512 sum = acc[0];
        for (int i = 1; i < 24; i++) sum = _mm512_add_ps(sum, acc[i]);
        sink = _mm512_reduce_add_ps(sum);                      /* the chains' result is used */
    }
    return flops / (now() - t) / 1e9;
}

int main(int argc, char **argv) {
    if (argc != 6 && argc != 7) {
        fprintf(stderr, "usage: %s THREADS M K N ROUNDS [fma|pairs]\n", argv[0]);
        return 2;
    }
    int threads = atoi(argv[1]), M = atoi(argv[2]), K = atoi(argv[3]), N = atoi(argv[4]), rounds = atoi(argv[5]);
    int pairs = argc == 7 && strcmp(argv[6], "pairs") == 0;
    clover_panel_set_pairs(pairs);
    if (threads < 1 || M < 1 || K < 1 || N < 1 || rounds < 1) return 2;
    uint16_t *A = aligned_alloc(64, ((size_t)M * K * 2 + 63) / 64 * 64);
    size_t panels = (N + PANEL - 1) / PANEL;
    uint16_t *W = aligned_alloc(64, panels * K * PANEL * 2), *C = aligned_alloc(64, ((size_t)M * N * 2 + 63) / 64 * 64);
    if (!A || !W || !C) return 3;
    /* bf16 values of either sign around 0.008 (0x3c00 + small mantissa steps; bit 15 the sign) */
    for (size_t i = 0; i < (size_t)M * K; i++) A[i] = (uint16_t)(0x3c00 + i % 13) | (uint16_t)((i % 3 == 0) << 15);
    for (size_t i = 0; i < panels * K * PANEL; i++) W[i] = (uint16_t)(0x3c00 + i % 11) | (uint16_t)((i % 5 == 0) << 15);
    /* enough calls of the whole product for ~0.4 s at 150 GFLOP/s per thread */
    double flops_whole = 2.0 * M * K * N;
    int reps = (int)(LOOP_SECONDS * 150e9 * threads / flops_whole) + 1;
    for (int round = 0; round < rounds; round++) {
        double fma = fma_peak(threads);
        double loop_flops = 0, t = now();
        #pragma omp parallel num_threads(threads) reduction(+ : loop_flops)
        {
            float *a = aligned_alloc(64, MAX_ROWS * LOOP_K * 4);
            uint16_t *w = aligned_alloc(64, LOOP_K * PANEL * 2);
            char c[MAX_ROWS * PANEL * 4];
            kernel_fn volatile kernel = (pairs ? PAIR_KERNELS : KERNELS)[MAX_ROWS];   /* an opaque call: its stores stay */
            for (int i = 0; i < MAX_ROWS * LOOP_K; i++) a[i] = 0.001f * (float)(i % 7);
            for (int i = 0; i < LOOP_K * PANEL; i++) w[i] = 0x3f80 + (uint16_t)(i % 5);
            double start = now();
            while (now() - start < LOOP_SECONDS) {
                for (int i = 0; i < 1000; i++) kernel(a, w, LOOP_K, c, PANEL * 4, PANEL, 1, 0, 1, 0, 0);
                loop_flops += 1000 * 2.0 * MAX_ROWS * PANEL * LOOP_K;
            }
            free(a);
            free(w);
        }
        double loop_s = now() - t;
        t = now();
        for (int r = 0; r < reps; r++)
            if (clover_panel_gemm(A, K, 1, M, K, W, N, C, N, 0, threads)) return 3;
        double whole_s = now() - t;
        printf("%.2f %.2f %.2f\n", fma, loop_flops / loop_s / 1e9, reps * flops_whole / whole_s / 1e9);
        fflush(stdout);
    }
    return check(A, W, C, M, K, N) ? 0 : 4;
}
