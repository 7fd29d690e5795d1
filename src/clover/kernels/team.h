/* Kernels as bodies run by an OpenMP team, so one parallel region can run many of them (steps.c walks
 * a step's ops in one region) and each kernel's own entry point is that region around one body: one
 * implementation of the arithmetic either way.
 *
 * Rules every body keeps, because threads of one team must meet the same barriers in the same order:
 *   - it is called by every thread of the team; work is split with orphaned worksharing (`omp for`,
 *     `omp single`), which binds to the enclosing team (a team of one outside any region);
 *   - it returns early only on what every thread sees alike (its arguments, a value shared through
 *     the Team); a failure one thread meets alone (its own scratch allocation) makes that thread skip
 *     its share of the work and return the error after meeting every barrier;
 *   - its last statement is a worksharing construct with its implicit barrier, so the next body may
 *     read what it wrote.
 * Buffers that the whole team reads (packed inputs, the MoE's scratch) are thread 0's — the caller's
 * thread, as when each kernel opened its own region — handed to the others through a Team slot
 * (`team_share`). Each slot belongs to one kind of kernel, and every body meets a barrier between two
 * shares of its slot, so no thread can still be reading a slot thread 0 writes again. */
#ifndef CLOVER_TEAM_H
#define CLOVER_TEAM_H
#include <omp.h>
#include <stdint.h>

#include "weights.h"

typedef struct {
    void *gemm, *qgemm, *gdn, *moe;     /* thread 0's buffer for the body in progress, per kernel kind */
} Team;

/* Thread 0's `mine` (evaluated there only) for every thread of the team; a barrier. */
#define team_share(team, slot, mine)                                                             \
    ({                                                                                           \
        if (omp_get_thread_num() == 0) (team)->slot = (mine);                                    \
        _Pragma("omp barrier")                                                                   \
        (team)->slot;                                                                            \
    })

/* A kernel's own entry point is one region around its body:
 *     Team team = {0};
 *     int status = 0;
 *     #pragma omp parallel num_threads(threads) reduction(min:status)
 *     status = team_min(status, body(&team, ...));
 * its status the lowest any thread returned (statuses are 0 or negative). */
static inline int team_min(int a, int b) { return a < b ? a : b; }

void add_rmsnorm_in_team(int N, int H, const uint16_t *h, long ldh, const uint16_t *delta, long ldd,
                         const float *scale, float eps, uint16_t *out_h, uint16_t *out_x);
int panel_gemm_in_team(Team *team, const void *A, long lda, int a_bf16, int M, int K, const uint16_t *W, int N,
                       void *C, long ldc, int c_fp32);
int panel_gemm_grouped_in_team(Team *team, const void *A, long lda, int a_bf16, int G, const int64_t *offsets,
                               const int64_t *ids, const int64_t *a_rows, int K, const uint16_t *W, long wstride,
                               int N, void *C, long ldc, int c_fp32, int swiglu, const float *scale);
int weights_gemm_in_team(Team *team, const Weights *w, const void *A, long lda, int a_bf16, int M, int K, int N,
                         void *C, long ldc, int c_fp32);
int weights_gemm_grouped_in_team(Team *team, const Weights *w, const void *A, long lda, int a_bf16, int G,
                                 const int64_t *offsets, const int64_t *ids, const int64_t *a_rows, int K, int N,
                                 void *C, long ldc, int c_fp32, int swiglu, const float *scale);
int gdn_short_in_team(Team *team, int B, int T, int P, int Hk, int Hv, int dk, int dv, int K, int Kr,
                      const uint16_t *u, long ldu, long ldtu, const uint16_t *z, long ldz, long ldtz,
                      const uint16_t *b_in, const uint16_t *a_in, long ldba, long ldtba,
                      const int64_t *tails, const int64_t *new_tails, const float *conv_wt, const float *right_wt,
                      const float *A_log, const float *dt_bias, const float *mix,
                      const int64_t *states, const int64_t *new_states,
                      const float *norm_w, float norm_eps, float q_scale, uint16_t *out, long ldo, long ldto);
int attention_cached_in_team(int Hq, int Hkv, int D, int R, int T, int P, const uint16_t *qg, long ldq,
                             const uint16_t *k, const uint16_t *v, long ldk, long ldv, const float *q_scale,
                             const float *k_scale, float eps, const uint16_t *cos, const uint16_t *sin, uint16_t *Kc,
                             uint16_t *Vc, const int32_t *pages, int page, long start, uint16_t *out, long ldo,
                             int stepwise);
int moe_block_in_team(Team *team, int B, int T, int block_len, const float *top_p, int min_experts, int H, int E,
                      int e_first, int e_count, int k, int I, int Is, const uint16_t *x, const uint16_t *h,
                      const Weights *w_in, const Weights *shared_in, const Weights *gate_up, const Weights *down,
                      const Weights *shared_down, uint16_t *out_h, int64_t *distinct);

#endif
