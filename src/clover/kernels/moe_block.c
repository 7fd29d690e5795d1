/* A sparse MoE block over N rows in one call, routing included: router, softmax, block expert
 * selection (SPEC §6), restricted top-k, the grouped experts, the shared expert and its gate, the sum
 * of each row's experts and the residual add. clover/layers/moe.py and layers/expert_selection.py
 * are the definitions; tests/test_kernels.py compares against them.
 *
 * Why: around its four matrix calls a block step's MoE layer ran ~60 small tensor ops (softmax,
 * top-k with tie-breaking keys, the selection's mass / sort / cumsum, the restricted top-k, the sort by
 * expert, bincount, index_add, the distinct count): ~1 ms per layer on 32 rows, as much as the experts'
 * arithmetic on the small bench model. Here that bookkeeping is a few microseconds of scalar code.
 *
 * Roundings follow the PyTorch path (built with -ffp-contract=off): softmax in fp32 (exp16, then a
 * multiply by the inverse sum, as torch's CPU softmax does), weights p/Σp in fp32 rounded to bf16,
 * each slot's bf16(bf16(y)·w) summed in fp32 in ascending expert order and rounded once (what
 * index_add_ does on bf16 rows), then the shared expert and residual in bf16 steps. The selection's
 * expert mass is summed in fp64 and rounded to fp32 (the PyTorch path does the same, so the order of
 * the 32 terms cannot matter in practice), the prefix sums run in fp64 with each prefix rounded to
 * fp32, as torch.cumsum does on CPU.
 *
 * A tensor-parallel shard (clover/distributed/layers.py, ExpertShard) holds experts e_first … e_first +
 * e_count − 1 of the E the router scores: routing, selection and the distinct count see all E, only the
 * slots routed to the shard's experts are computed (gate_up / down hold e_count experts), and the
 * output is this rank's partial sum (its experts and its shared-expert columns; no residual then), which
 * the caller all-reduces. One process: e_first 0, e_count E. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#include "team.h"
#include "weights.h"

#define MAX_TOP_K 64

/* Softmax of E bf16 logits in fp32 (torch.softmax on the widened logits). */
static void softmax_row(int E, const uint16_t *logits, float *probs) {
    float mx = -INFINITY;
    for (int e = 0; e < E; e++) mx = fmaxf(mx, bf16_to_f32(logits[e]));
    __m512 vsum = _mm512_setzero_ps();
    for (int e = 0; e < E; e += 16) {
        __mmask16 m = lanes(E - e);
        __m512 p = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(load_bf16_16(logits + e, m), _mm512_set1_ps(mx))));
        _mm512_mask_storeu_ps(probs + e, m, p);
        vsum = _mm512_add_ps(vsum, p);
    }
    float inv = 1.0f / _mm512_reduce_add_ps(vsum);
    for (int e = 0; e < E; e++) probs[e] *= inv;
}

/* The (at most) k largest v[e] with allowed[e] (allowed NULL: every e), descending, ties to the lower
 * index (a later equal value never passes an earlier one). Returns how many were found. Whatever the
 * values (NaN included), every index written is a valid expert. */
static int top_k(int E, int k, const float *v, const uint8_t *allowed, int *ids) {
    float best[MAX_TOP_K];
    int n = 0;
    for (int e = 0; e < E; e++) {
        if (allowed && !allowed[e]) continue;
        float x = v[e];
        int i;
        if (n < k) i = n++;
        else if (x > best[k - 1]) i = k - 1;
        else continue;
        for (; i > 0 && best[i - 1] < x; i--) {
            best[i] = best[i - 1];
            ids[i] = ids[i - 1];
        }
        best[i] = x;
        ids[i] = e;
    }
    return n;
}

typedef struct { float mass; int expert; } Ranked;

static int by_mass(const void *a, const void *b) {          /* descending mass, ties to the lower index */
    const Ranked *x = a, *y = b;
    if (x->mass > y->mass) return -1;
    if (x->mass < y->mass) return 1;
    return x->expert - y->expert;
}

/* Block expert selection for one sequence's L block rows of probabilities (SPEC §6): keep[e] = 1 for
 * the shortest prefix of experts ranked by top-k mass whose mass reaches p of the total, at least
 * n_min of them. */
static void select_experts(int E, int k, int L, const float *probs, float p, int n_min, uint8_t *keep,
                           Ranked *ranked, double *mass) {
    int cand[MAX_TOP_K];
    for (int e = 0; e < E; e++) mass[e] = 0.0;
    for (int t = 0; t < L; t++) {
        int n = top_k(E, k, probs + (long)t * E, 0, cand);
        for (int j = 0; j < n; j++) mass[cand[j]] += (double)probs[(long)t * E + cand[j]];
    }
    for (int e = 0; e < E; e++) ranked[e] = (Ranked){(float)mass[e], e};
    qsort(ranked, (size_t)E, sizeof(Ranked), by_mass);
    double cum = 0.0;
    for (int r = 0; r < E; r++) cum += (double)ranked[r].mass;
    float threshold = p * (float)cum;                 /* p · total, total the last prefix sum */
    float before = 0.0f;
    cum = 0.0;
    for (int r = 0; r < E; r++) {
        keep[ranked[r].expert] = before < threshold || r < n_min;
        cum += (double)ranked[r].mass;
        before = (float)cum;
    }
}

/* out[i] = bf16(bf16(silu(gate[i])) · up[i]) for n values: F.silu(gate) * up on bf16 tensors */
static void swiglu(int n, const uint16_t *gate, const uint16_t *up, uint16_t *out) {
    for (int j = 0; j < n; j += 16) {
        __mmask16 m = lanes(n - j);
        __m512 s = round_bf16_16(silu16(load_bf16_16(gate + j, m)));
        store_bf16_16(out + j, m, _mm512_mul_ps(s, load_bf16_16(up + j, m)));
    }
}

static __thread void *scratch;
static __thread size_t scratch_bytes;

static void *reserve(size_t bytes) {
    if (bytes > scratch_bytes) {
        free(scratch);
        scratch = malloc(bytes);
        scratch_bytes = scratch ? bytes : 0;
    }
    return scratch;
}

/* The next `bytes` of the scratch area, 64-byte aligned. */
static void *carve(char **at, size_t bytes) {
    void *p = *at;
    *at += (bytes + 63) / 64 * 64;
    return p;
}

/* One call's sizes and its scratch (thread 0's, carved alike by every thread of the team). */
typedef struct {
    long N, S;
    int B, T, P, block_len, E, e_first, e_count, k, n_in, n_min, Is;
    const float *top_p;
    float *probs;
    uint16_t *y_in;                       /* columns: router logits E, shared output gate 1, shared gate Is, up Is */
    uint8_t *keep, *hit;
    Ranked *ranked;
    double *mass;
    int *slot_expert;                     /* row n's slots n·k…: ascending expert, then −1 */
    float *slot_weight;
    int *position;                        /* a row slot's place among the grouped slots */
    int64_t *first, *next, *group_ids, *offsets;
    int64_t *a_rows;                      /* grouped slots: the row, its routing weight */
    float *scale;
    uint16_t *act, *ys, *act_s, *shared;
    int *groups;                          /* how many experts the rows route to (G), for every thread */
} Moe;

/* Each sequence's block experts: those its selection keeps, or all of them. */
static void select_blocks(const Moe *m) {
    for (int b = 0; b < m->B; b++) {
        if (m->top_p && m->block_len && m->top_p[b] < 1.0f)
            select_experts(m->E, m->k, m->block_len, m->probs + ((long)b * m->T + m->P) * m->E, m->top_p[b], m->n_min,
                           m->keep + (long)b * m->E, m->ranked, m->mass);
        else
            memset(m->keep + (long)b * m->E, 1, (size_t)m->E);
    }
}

/* Row n's top-k among its allowed experts, weights renormalised over the found slots and rounded to
 * bf16; slots of weight 0 (a row allowing fewer than k experts) would add exact zeros and are dropped.
 * Also the shared expert's SwiGLU of the row. */
static void route_row(const Moe *m, long n) {
    int E = m->E, k = m->k;
    const float *pr = m->probs + n * E;
    int ids[MAX_TOP_K];
    int found = top_k(E, k, pr, n % m->T >= m->P ? m->keep + (n / m->T) * E : 0, ids);
    float total = 0.0f;
    for (int j = 0; j < found; j++) total += pr[ids[j]];
    int *se = m->slot_expert + n * k, c = 0;
    float *sw = m->slot_weight + n * k;
    for (int j = 0; j < found; j++) {
        float w = round_bf16(total > 0.0f ? pr[ids[j]] / total : 0.0f);
        if (w == 0.0f) continue;
        int e = ids[j], i = c++;
        for (; i > 0 && se[i - 1] > e; i--) {
            se[i] = se[i - 1];
            sw[i] = sw[i - 1];
        }
        se[i] = e;
        sw[i] = w;
    }
    for (int j = c; j < k; j++) se[j] = -1;
    const uint16_t *y = m->y_in + n * m->n_in + E + 1;
    swiglu(m->Is, y, y + m->Is, m->act_s + n * m->Is);
}

/* Group the slots of this shard's experts by expert, rows ascending within each (a counting sort);
 * group ids and `position` index the shard's experts, −1: a slot another rank computes. Returns the
 * number of groups G; counts each sequence's distinct block experts into `distinct` (nullable). */
static int group_slots(const Moe *m, int64_t *distinct) {
    int E = m->E, k = m->k, e_first = m->e_first, e_count = m->e_count;
    int64_t *first = m->first, *next = m->next;
    memset(first, 0, sizeof(int64_t) * (E + 1));
    for (long s = 0; s < m->S; s++) {
        int e = m->slot_expert[s] - e_first;
        if (m->slot_expert[s] >= 0 && e >= 0 && e < e_count) first[e + 1]++;
    }
    for (int e = 0; e < e_count; e++) first[e + 1] += first[e];
    int G = 0;
    for (int e = 0; e < e_count; e++) {
        next[e] = first[e];
        if (first[e + 1] > first[e]) {
            m->group_ids[G] = e;
            m->offsets[G++] = first[e];
        }
    }
    m->offsets[G] = first[e_count];
    for (long s = 0; s < m->S; s++) {
        int e = m->slot_expert[s] - e_first;
        m->position[s] = -1;
        if (m->slot_expert[s] < 0 || e < 0 || e >= e_count) continue;
        long pos = next[e]++;
        m->a_rows[pos] = s / k;
        m->scale[pos] = m->slot_weight[s];
        m->position[s] = (int)pos;
    }
    if (distinct)
        for (int b = 0; b < m->B; b++) {
            memset(m->hit, 0, (size_t)E);
            int d = 0;
            for (long s = ((long)b * m->T + m->P) * k; s < ((long)b + 1) * m->T * k; s++)
                if (m->slot_expert[s] >= 0 && m->slot_weight[s] > 0.0f && !m->hit[m->slot_expert[s]]) {
                    m->hit[m->slot_expert[s]] = 1;
                    d++;
                }
            distinct[b] = m->block_len ? d : 0;
        }
    return G;
}

/* Rows x [N, H] (bf16, normalised) through the MoE block, added to the residual h [N, H]:
 *   out_h = h + (Σ_j w_j·expert_j(x) + sigmoid(g·x)·shared(x))   (h NULL: the block's output alone)
 * The rows are B sequences of T; the last block_len rows of sequence b are a noisy block, routed among
 * the experts its selection keeps when top_p[b] < 1 (top_p NULL: no selection). distinct (nullable,
 * [B]): how many experts sequence b's block rows route to with a positive weight.
 * w_in: the stacked input maps [router E | shared output gate 1 | shared gate Is | shared up Is] × H, or
 * only the first two when shared_in (nullable) holds the other two (a quantized shared expert beside
 * the bf16 router); gate_up / down: the experts' stacks (gate_up interleaved for the SwiGLU epilogue,
 * intermediate I padded to 16); shared_down: [H, Is]. Any precision weights.h describes.
 * The matrix products split across the team (team.h); the routing's bookkeeping runs on one of its
 * threads, its per-row loops across the team from 64 rows on (for fewer a loop costs more than it
 * saves). Returns 0, -1 out of memory, -2 bad shape or setting. */
int moe_block_in_team(Team *team, int B, int T, int block_len, const float *top_p, int min_experts, int H, int E,
                      int e_first, int e_count, int k, int I, int Is, const uint16_t *x, const uint16_t *h,
                      const Weights *w_in, const Weights *shared_in, const Weights *gate_up, const Weights *down,
                      const Weights *shared_down, uint16_t *out_h, int64_t *distinct) {
    if (k < 1 || k > MAX_TOP_K || k > E || B < 1 || T < 1 || block_len < 0 || block_len > T) return -2;
    if (e_first < 0 || e_count < 0 || e_first + e_count > E) return -3;
    long N = (long)B * T, S = N * k;
    int n_in = E + 2 * Is + 1;
    size_t bytes = 64 * 21 + sizeof(float) * N * E + 2 * N * n_in + (size_t)B * E + E + sizeof(Ranked) * E
                   + sizeof(double) * E + sizeof(int64_t) * (4 * E + 2) + (2 * sizeof(int) + 2 * sizeof(float)
                   + sizeof(int64_t)) * S + 2 * (S * I + S * H + N * Is + N * H);
    char *at = team_share(team, moe, reserve(bytes));
    if (!at) return -1;
    Moe m = {.N = N, .S = S, .B = B, .T = T, .P = T - block_len, .block_len = block_len, .E = E, .e_first = e_first,
             .e_count = e_count, .k = k, .n_in = n_in, .n_min = min_experts < 1 ? 1 : min_experts > E ? E : min_experts,
             .Is = Is, .top_p = top_p};
    m.probs = carve(&at, sizeof(float) * N * E);
    m.y_in = carve(&at, 2 * N * n_in);
    m.keep = carve(&at, (size_t)B * E), m.hit = carve(&at, (size_t)E);
    m.ranked = carve(&at, sizeof(Ranked) * E);
    m.mass = carve(&at, sizeof(double) * E);
    m.slot_expert = carve(&at, sizeof(int) * S);
    m.slot_weight = carve(&at, sizeof(float) * S);
    m.position = carve(&at, sizeof(int) * S);
    m.first = carve(&at, sizeof(int64_t) * (E + 1)), m.next = carve(&at, sizeof(int64_t) * E);
    m.group_ids = carve(&at, sizeof(int64_t) * E), m.offsets = carve(&at, sizeof(int64_t) * (E + 1));
    m.a_rows = carve(&at, sizeof(int64_t) * S);
    m.scale = carve(&at, sizeof(float) * S);
    m.act = carve(&at, 2 * S * I), m.ys = carve(&at, 2 * S * H);
    m.act_s = carve(&at, 2 * N * Is), m.shared = carve(&at, 2 * N * H);
    m.groups = carve(&at, sizeof(int));

    int failed = weights_gemm_in_team(team, w_in, x, H, 1, (int)N, H, shared_in ? E + 1 : n_in, m.y_in, n_in, 0);
    if (shared_in)
        failed |= weights_gemm_in_team(team, shared_in, x, H, 1, (int)N, H, 2 * Is, m.y_in + E + 1, n_in, 0);
    int par = N >= 64;                                    /* a block step's 32 rows: a parallel loop costs more */
    if (par) {
        #pragma omp for schedule(static)
        for (long n = 0; n < N; n++) softmax_row(E, m.y_in + n * n_in, m.probs + n * E);
        #pragma omp single
        select_blocks(&m);
        #pragma omp for schedule(static)
        for (long n = 0; n < N; n++) route_row(&m, n);
    }
    #pragma omp single
    {
        if (!par) {
            for (long n = 0; n < N; n++) softmax_row(E, m.y_in + n * n_in, m.probs + n * E);
            select_blocks(&m);
            for (long n = 0; n < N; n++) route_row(&m, n);
        }
        *m.groups = group_slots(&m, distinct);
    }
    int G = *m.groups;

    /* the experts' SwiGLU and routing weights happen in the grouped kernels' epilogues */
    if (G)
        failed |= weights_gemm_grouped_in_team(team, gate_up, x, H, 1, G, m.offsets, m.group_ids, m.a_rows, H, 2 * I,
                                               m.act, I, 0, 1, 0);
    if (G)
        failed |= weights_gemm_grouped_in_team(team, down, m.act, I, 1, G, m.offsets, m.group_ids, 0, I, H, m.ys, H, 0, 0,
                                               m.scale);
    failed |= weights_gemm_in_team(team, shared_down, m.act_s, Is, 1, (int)N, Is, H, m.shared, H, 0);

    #pragma omp for schedule(static)
    for (long n = 0; n < N; n++) {
        float g = bf16_to_f32(m.y_in[n * n_in + E]);
        __m512 gate = _mm512_set1_ps(round_bf16(1.0f / (1.0f + expf(-g))));    /* torch.sigmoid on bf16 */
        const int *se = m.slot_expert + n * k, *pos = m.position + n * k;
        for (int c = 0; c < H; c += 16) {
            __mmask16 mask = lanes(H - c);
            __m512 acc = _mm512_setzero_ps();               /* Σ_j bf16(y_j · w_j) in ascending expert, then bf16 */
            for (int j = 0; j < k && se[j] >= 0; j++)
                if (pos[j] >= 0) acc = _mm512_add_ps(acc, load_bf16_16(m.ys + (long)pos[j] * H + c, mask));
            __m512 routed = round_bf16_16(acc);
            __m512 sh = round_bf16_16(_mm512_mul_ps(gate, load_bf16_16(m.shared + n * H + c, mask)));
            __m512 moe = round_bf16_16(_mm512_add_ps(routed, sh));
            store_bf16_16(out_h + n * H + c, mask, h ? _mm512_add_ps(load_bf16_16(h + n * H + c, mask), moe) : moe);
        }
    }
    return failed ? -1 : 0;
}

int clover_moe_block(int B, int T, int block_len, const float *top_p, int min_experts, int H, int E, int e_first,
                     int e_count, int k, int I, int Is, const uint16_t *x, const uint16_t *h, const Weights *w_in,
                     const Weights *shared_in, const Weights *gate_up, const Weights *down, const Weights *shared_down,
                     uint16_t *out_h, int64_t *distinct, int threads) {
    Team team = {0};
    int status = 0;
    #pragma omp parallel num_threads(threads) reduction(min:status)
    status = team_min(status, moe_block_in_team(&team, B, T, block_len, top_p, min_experts, H, E, e_first, e_count, k, I,
                                                Is, x, h, w_in, shared_in, gate_up, down, shared_down, out_h, distinct));
    return status;
}
