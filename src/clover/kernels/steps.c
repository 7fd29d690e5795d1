/* A step's kernels in one parallel region: decode steps, block steps and commits of up to 64 tokens.
 * clover/kernels/decode_plan.py binds a step's calls once — norms, matrix products, the GDN and
 * attention kernels, the MoE block, a decode step's lm head — and a step is one call here: the team
 * starts once and walks the list together, each kernel's work split across it (team.h), a barrier
 * between one kernel and the next, instead of a parallel region (fork and join) and a ctypes call per
 * kernel. The arithmetic is the kernels' own: a step's results are bit for bit those of the calls one
 * by one.
 *
 * Waiting at a barrier is libgomp's: a thread spins for a while (OMP_WAIT_POLICY, GOMP_SPINCOUNT;
 * by default 300,000 spins while the threads do not outnumber the CPUs, 100 when they do),
 * then sleeps on a futex until the last thread arrives. Between steps the workers wait the same way
 * in libgomp's pool, so they are not started again. */
#include <stdint.h>
#include <string.h>

#include "team.h"

/* One argument of an op, as decode_plan.py binds it: the kernel's entry-point arguments in order,
 * each in an 8-byte slot (integers and pointers as int64, floats as double; a trailing thread count
 * is not read: the team is the op's). */
typedef union { int64_t i; double f; } Arg;

#define INT(n) ((int)a[n].i)
#define LONG(n) ((long)a[n].i)
#define PTR(n) ((void *)(intptr_t)a[n].i)
#define FLOAT(n) ((float)a[n].f)

static int op_add_rmsnorm(Team *team, const Arg *a) {
    (void)team;
    add_rmsnorm_in_team(INT(0), INT(1), PTR(2), LONG(3), PTR(4), LONG(5), PTR(6), FLOAT(7), PTR(8), PTR(9));
    return 0;
}

static int op_weights_gemm(Team *team, const Arg *a) {
    return weights_gemm_in_team(team, PTR(0), PTR(1), LONG(2), INT(3), INT(4), INT(5), INT(6), PTR(7), LONG(8),
                                INT(9));
}

static int op_gdn_short(Team *team, const Arg *a) {
    return gdn_short_in_team(team, INT(0), INT(1), INT(2), INT(3), INT(4), INT(5), INT(6), INT(7), INT(8), PTR(9),
                             LONG(10), LONG(11), PTR(12), LONG(13), LONG(14), PTR(15), PTR(16), LONG(17), LONG(18),
                             PTR(19), PTR(20), PTR(21), PTR(22), PTR(23), PTR(24), PTR(25), PTR(26), PTR(27), PTR(28),
                             FLOAT(29), FLOAT(30), PTR(31), LONG(32), LONG(33));
}

static int op_attention_cached(Team *team, const Arg *a) {
    (void)team;
    return attention_cached_in_team(INT(0), INT(1), INT(2), INT(3), INT(4), INT(5), PTR(6), LONG(7), PTR(8), PTR(9),
                                    LONG(10), LONG(11), PTR(12), PTR(13), FLOAT(14), PTR(15), PTR(16), PTR(17), PTR(18),
                                    PTR(19), INT(20), LONG(21), PTR(22), LONG(23), INT(24));
}

static int op_moe_block(Team *team, const Arg *a) {
    return moe_block_in_team(team, INT(0), INT(1), INT(2), PTR(3), INT(4), INT(5), INT(6), INT(7), INT(8), INT(9),
                             INT(10), INT(11), PTR(12), PTR(13), PTR(14), PTR(15), PTR(16), PTR(17), PTR(18), PTR(19),
                             PTR(20));
}

static const struct {
    const char *name;                         /* the kernel's own entry point, whose arguments an op holds */
    int (*run)(Team *, const Arg *);
} OPS[] = {
    {"clover_add_rmsnorm", op_add_rmsnorm},
    {"clover_weights_gemm", op_weights_gemm},
    {"clover_gdn_short", op_gdn_short},
    {"clover_attention_cached", op_attention_cached},
    {"clover_moe_block", op_moe_block},
};
#define N_OPS ((int)(sizeof OPS / sizeof OPS[0]))

/* The op kind that runs the kernel `name` in a team, or -1 where there is none. */
int clover_op_kind(const char *name) {
    for (int i = 0; i < N_OPS; i++)
        if (!strcmp(OPS[i].name, name)) return i;
    return -1;
}

/* Ops 0 … n−1 (op kinds[i] on args[i]) in order, by one team of `threads` threads. Returns 0, or
 * the status of the first op that failed (its index in *failed; -1 when none), -4 for an unknown
 * kind. An op that fails does not stop the walk: every thread must meet the same barriers. */
int clover_run_steps(int n, const int32_t *kinds, const Arg *const *args, int threads, int32_t *failed) {
    *failed = -1;
    for (int i = 0; i < n; i++)
        if (kinds[i] < 0 || kinds[i] >= N_OPS) {
            *failed = i;
            return -4;
        }
    Team team = {0};
    int first = n, status = 0;
    #pragma omp parallel num_threads(threads)
    {
        int mine = n, code = 0;
        for (int i = 0; i < n; i++) {
            int s = OPS[kinds[i]].run(&team, args[i]);
            if (s && i < mine) mine = i, code = s;
        }
        if (mine < n) {
            #pragma omp critical(clover_run_steps)
            if (mine < first) first = mine, status = code;
        }
    }
    if (first < n) *failed = first;
    return status;
}
