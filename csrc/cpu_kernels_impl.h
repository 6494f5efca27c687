/* One instruction set's kernels (see cpu_kernels.c). The includer defines KNAME(name),
 * SMOE_TARGET and the vector layer: VWD lanes, NT_MAX, SMALL_M, NR, MRV_MAX, vf/vi and
 * the V_*, VI_* macros and v_bf16, v_transpose, v_unpack.
 *
 * Shapes: P (row, expert) pairs, N outputs, K inputs; a "word" is 32 bits of a weight row
 * (a float, or 32/bits packed values). ``bf`` is a constant 0 or 1 at every call (the
 * always-inline functions are specialized by it): 1 rounds each result to bfloat16. */

#define RND(bf, v) ((bf) ? v_bf16(v) : (v))
/* Bytes ahead of a weight row's next load to prefetch (measured: 128 is +25% at a decode
 * step's expert shapes on the 2-core EPYC; 256 and 512 less). */
#define PREFETCH_AHEAD 128
#define ALWAYS SMOE_TARGET static inline __attribute__((always_inline))

/* Floats of scratch one thread needs for ``pb``. */
static size_t KNAME(scratch)(const Problem *pb) {
    size_t groups = pb->quantized ? (size_t)(pb->K / pb->group) : 0;
    size_t nl = (size_t)VWD * 16 * NT_MAX * VWD         /* dequantized word-block */
                + 2 * groups * NT_MAX * VWD              /* scales, biases by lane */
                + (size_t)SMALL_M * NT_MAX * VWD        /* accumulators */
                + (size_t)VWD * VWD + 64;                /* a tail's padded row, alignment */
    size_t ml = (size_t)NR * 128 + (size_t)NR * ((size_t)pb->P + VWD) + 64;
    return (nl > ml ? nl : ml) + 64;
}

static int KNAME(tile)(const Problem *pb) {
    (void)pb;
    return NT_MAX * VWD;
}

/* ------------------------------------------------------------ n-lanes: few rows */

/* acc[r][t] (MB rows x NT sub-tiles of VWD outputs, in registers) over the block's kn k's:
 * acc = acc + x[r][k] * w[k][t], k in order. */
#define DOT_FN(MB, NT)                                                                     \
    ALWAYS void KNAME(dot_##MB)(float *acc, const float *buf, const float *const *xr, \
                                        int kbase, int kn, int t0, const int bf) {          \
        vf a[MB][NT];                                                                      \
        for (int r = 0; r < MB; r++)                                                       \
            for (int t = 0; t < NT; t++) a[r][t] = V_LOAD(acc + (r * NT_MAX + t0 + t) * VWD); \
        for (int kk = 0; kk < kn; kk++) {                                                  \
            const float *wk = buf + ((size_t)kk * NT_MAX + t0) * VWD;                      \
            for (int r = 0; r < MB; r++) {                                                 \
                vf xv = V_SET1(xr[r][kbase + kk]);                                         \
                for (int t = 0; t < NT; t++)                                               \
                    a[r][t] = RND(bf, V_ADD(a[r][t], RND(bf, V_MUL(xv, V_LOAD(wk + t * VWD))))); \
            }                                                                              \
        }                                                                                  \
        for (int r = 0; r < MB; r++)                                                       \
            for (int t = 0; t < NT; t++) V_STORE(acc + (r * NT_MAX + t0 + t) * VWD, a[r][t]); \
    }
DOT_FN(1, NT_MAX)
DOT_FN(2, NT_MAX / 2)
DOT_FN(3, NT_MAX / 4)

/* Rows [0, m) of the block (m <= SMALL_M), in register blocks of 1, 2 or 3 rows. */
ALWAYS void KNAME(dot_rows)(float *acc, const float *buf, const float *const *xr, int m,
                            int kbase, int kn, const int bf) {
    int r = 0;
    while (r < m) {
        int left = m - r;
        float *ar = acc + (size_t)r * NT_MAX * VWD;
        if (left == 1) {
            KNAME(dot_1)(ar, buf, xr + r, kbase, kn, 0, bf);
            r += 1;
        } else if (left == 2 || left == 4) {
            for (int t0 = 0; t0 < NT_MAX; t0 += NT_MAX / 2)
                KNAME(dot_2)(ar, buf, xr + r, kbase, kn, t0, bf);
            r += 2;
        } else {
            for (int t0 = 0; t0 < NT_MAX; t0 += NT_MAX / 4)
                KNAME(dot_3)(ar, buf, xr + r, kbase, kn, t0, bf);
            r += 3;
        }
    }
}

/* Each group's scale and bias of the item's NT_MAX*VWD outputs, one lane per output:
 * st[j][t] lane l = scale of output n0 + t*VWD + l in group j (rows past N repeat the
 * last one), transposed VWD groups at a time. */
ALWAYS void KNAME(lane_scales)(const Problem *pb, const Group *g, int n0, float *st, float *bt,
                               float *pad) {
    const int N = pb->N, G = pb->K / pb->group;
    for (int half = 0; half < 2; half++) {
        float *dst = half ? bt : st;
        for (int t = 0; t < NT_MAX; t++)
            for (int j0 = 0; j0 < G; j0 += VWD) {
                const int jn = G - j0 < VWD ? G - j0 : VWD;
                vf r[VWD];
                for (int l = 0; l < VWD; l++) {
                    const int n = n0 + t * VWD + l < N ? n0 + t * VWD + l : N - 1;
                    if (jn == VWD && !pb->sb_bf16) {
                        const uint8_t *row = (half ? pb->biases : pb->scales) +
                                             (ptrdiff_t)g->expert * pb->sb_e_stride +
                                             (ptrdiff_t)n * pb->sb_row_stride;
                        r[l] = V_LOADU((const float *)row + j0);
                    } else {
                        for (int j = 0; j < VWD; j++)
                            pad[j] = j < jn ? sb_at(pb, half, g->expert, n, j0 + j) : 0.0f;
                        r[l] = V_LOADU(pad);
                    }
                }
                v_transpose(r);
                for (int j = 0; j < jn; j++)
                    V_STORE(dst + ((size_t)(j0 + j) * NT_MAX + t) * VWD, r[j]);
            }
    }
}

/* One item of a group of at most SMALL_M rows: outputs [n0, n0 + NT_MAX*VWD) clamped to
 * the matrix (the rows past N repeat the last one; their results are not stored). */
ALWAYS void KNAME(n_lanes)(const Job *job, const Group *g, int n0, int n1, float *scratch,
                           const int bf) {
    const Problem *pb = job->pb;
    const int N = pb->N, K = pb->K, m = g->count, q = pb->quantized;
    const int bits = pb->bits, pack = q ? 32 / bits : 1, mask = q ? (1 << bits) - 1 : 0;
    const int rw = q ? K * bits / 32 : K; /* words per row */
    const int wpg = q ? pb->group * bits / 32 : 1;
    const int G = q ? K / pb->group : 0;
    float *buf = align16(scratch);
    float *st = align16(buf + (size_t)VWD * 16 * NT_MAX * VWD);
    float *bt = align16(st + (size_t)G * NT_MAX * VWD);
    float *acc = align16(bt + (size_t)G * NT_MAX * VWD);
    float *pad = align16(acc + (size_t)SMALL_M * NT_MAX * VWD);
    const uint8_t *wbase = pb->w + (ptrdiff_t)g->expert * pb->w_e_stride;
    const uint8_t *wrow[NT_MAX * VWD];
    for (int i = 0; i < NT_MAX * VWD; i++) {
        int n = n0 + i < N ? n0 + i : N - 1;
        wrow[i] = wbase + (ptrdiff_t)n * pb->w_row_stride;
    }
    if (q) KNAME(lane_scales)(pb, g, n0, st, bt, pad);
    const float *xr[SMALL_M];
    for (int i = 0; i < m; i++) xr[i] = pb->x + (size_t)pb->rows[job->order[g->start + i]] * K;
    memset(acc, 0, sizeof(float) * (size_t)m * NT_MAX * VWD);
    for (int w0 = 0; w0 < rw; w0 += VWD) {
        const int wn = rw - w0 < VWD ? rw - w0 : VWD;
        for (int t = 0; t < NT_MAX; t++) {
            vf r[VWD];
            for (int l = 0; l < VWD; l++) {
                const uint8_t *src = wrow[t * VWD + l] + (size_t)w0 * 4;
                __builtin_prefetch(src + PREFETCH_AHEAD);
                if (wn == VWD) {
                    r[l] = V_LOADU((const float *)src);
                } else { /* the row's last words, zero-padded */
                    memset(pad, 0, sizeof(float) * VWD);
                    memcpy(pad, src, (size_t)wn * 4);
                    r[l] = V_LOADU(pad);
                }
            }
            v_transpose(r); /* r[w], lane l: word w0 + w of output t*VWD + l */
            for (int w = 0; w < wn; w++) {
                if (!q) {
                    V_STORE(buf + ((size_t)w * NT_MAX + t) * VWD, r[w]);
                    continue;
                }
                const int j = (w0 + w) / wpg;
                const vf s = V_LOAD(st + ((size_t)j * NT_MAX + t) * VWD);
                const vf b = V_LOAD(bt + ((size_t)j * NT_MAX + t) * VWD);
                const vi word = V_AS_I(r[w]);
                for (int i = 0; i < pack; i++) {
                    vi qi = VI_AND(VI_SRL(word, i * bits), VI_SET1(mask));
                    vf v = RND(bf, V_MUL(s, V_CVT(qi)));
                    v = RND(bf, V_ADD(v, b));
                    V_STORE(buf + ((size_t)(w * pack + i) * NT_MAX + t) * VWD, v);
                }
            }
        }
        KNAME(dot_rows)(acc, buf, xr, m, w0 * pack, wn * pack, bf);
    }
    for (int i = 0; i < m; i++) {
        float *out = pb->out + (size_t)job->order[g->start + i] * N;
        for (int c = 0; c < NT_MAX * VWD && n0 + c < n1; c++) {
            float v = acc[(size_t)i * NT_MAX * VWD + c];
            if (pb->out_bias) v = bf ? rnd_bf16(v + pb->out_bias[n0 + c]) : v + pb->out_bias[n0 + c];
            out[n0 + c] = v;
        }
    }
}

/* One item of a group of one or two rows (a decode step, most experts' share of a call):
 * the dequantization fused into the products, TG sub-tiles x MB rows of accumulators in
 * registers over all of K. BITS: 2, 4, 8 (packed) or 32 (float weights). */
ALWAYS void KNAME(n_fused)(const Job *job, const Group *g, int n0, int n1, float *scratch,
                           const int bf, const int BITS, const int MB) {
    const Problem *pb = job->pb;
    const int N = pb->N, K = pb->K, q = BITS < 32;
    const int pack = q ? 32 / BITS : 1;
    const int mask = q ? (1 << (BITS & 31)) - 1 : 0;
    const int rw = q ? K * BITS / 32 : K;
    const int wpg = q ? pb->group * BITS / 32 : 1;
    const int G = q ? K / pb->group : 0;
    enum { TG = 4 };
    /* sub-tiles at once: 4 for one row, 2 for two to four rows (registers) */
    const int tg = MB == 1 ? TG : TG / 2;
    float *wt = align16(scratch);
    float *st = align16(wt + (size_t)TG * VWD * VWD);
    float *bt = align16(st + (size_t)G * NT_MAX * VWD);
    float *pad = align16(bt + (size_t)G * NT_MAX * VWD);
    const uint8_t *wbase = pb->w + (ptrdiff_t)g->expert * pb->w_e_stride;
    const uint8_t *wrow[NT_MAX * VWD];
    for (int i = 0; i < NT_MAX * VWD; i++) {
        int n = n0 + i < N ? n0 + i : N - 1;
        wrow[i] = wbase + (ptrdiff_t)n * pb->w_row_stride;
    }
    if (q) KNAME(lane_scales)(pb, g, n0, st, bt, pad);
    const float *xr[4];
    for (int i = 0; i < MB; i++) xr[i] = pb->x + (size_t)pb->rows[job->order[g->start + i]] * K;
    for (int t0 = 0; t0 < NT_MAX && n0 + t0 * VWD < n1; t0 += tg) {
        vf a[TG][4];
        for (int tt = 0; tt < tg; tt++)
            for (int r = 0; r < MB; r++) a[tt][r] = V_ZERO();
        for (int w0 = 0; w0 < rw; w0 += VWD) {
            const int wn = rw - w0 < VWD ? rw - w0 : VWD;
            for (int tt = 0; tt < tg; tt++) {
                vf r[VWD];
                for (int l = 0; l < VWD; l++) {
                    const uint8_t *src = wrow[(t0 + tt) * VWD + l] + (size_t)w0 * 4;
                    /* many rows at once: the hardware prefetcher does not keep up */
                    __builtin_prefetch(src + PREFETCH_AHEAD);
                    if (wn == VWD) {
                        r[l] = V_LOADU((const float *)src);
                    } else {
                        memset(pad, 0, sizeof(float) * VWD);
                        memcpy(pad, src, (size_t)wn * 4);
                        r[l] = V_LOADU(pad);
                    }
                }
                v_transpose(r);
                for (int w = 0; w < VWD; w++) V_STORE(wt + ((size_t)tt * VWD + w) * VWD, r[w]);
            }
            for (int w = 0; w < wn; w++) {
                const int j = q ? (w0 + w) / wpg : 0;
                const float *xk[4];
                for (int r = 0; r < MB; r++) xk[r] = xr[r] + (size_t)(w0 + w) * pack;
                /* The word's values low bits first: each step masks the lowest and
                 * shifts the rest down (a real loop: unrolled, GCC spills). */
                vi cur[TG];
                for (int tt = 0; tt < tg; tt++)
                    cur[tt] = V_AS_I(V_LOAD(wt + ((size_t)tt * VWD + w) * VWD));
#pragma GCC unroll 1
                for (int i = 0; i < pack; i++) {
                    vf xv[4];
                    for (int r = 0; r < MB; r++) xv[r] = V_SET1(xk[r][i]);
                    for (int tt = 0; tt < tg; tt++) {
                        vf v;
                        if (q) {
                            const size_t sj = ((size_t)j * NT_MAX + t0 + tt) * VWD;
                            vi qi = VI_AND(cur[tt], VI_SET1(mask));
                            cur[tt] = VI_SRLI(cur[tt], BITS);
                            v = RND(bf, V_MUL(V_LOAD(st + sj), V_CVT(qi)));
                            v = RND(bf, V_ADD(v, V_LOAD(bt + sj)));
                        } else {
                            v = V_AS_F(cur[tt]);
                        }
                        for (int r = 0; r < MB; r++)
                            a[tt][r] = RND(bf, V_ADD(a[tt][r], RND(bf, V_MUL(xv[r], v))));
                    }
                }
            }
        }
        for (int r = 0; r < MB; r++) {
            float *out = pb->out + (size_t)job->order[g->start + r] * N;
            for (int tt = 0; tt < tg; tt++) {
                float lanes[VWD] __attribute__((aligned(64)));
                V_STORE(lanes, a[tt][r]);
                for (int l = 0; l < VWD; l++) {
                    const int n = n0 + (t0 + tt) * VWD + l;
                    if (n >= n1) break;
                    float v = lanes[l];
                    if (pb->out_bias) v = bf ? rnd_bf16(v + pb->out_bias[n]) : v + pb->out_bias[n];
                    out[n] = v;
                }
            }
        }
    }
}

/* ------------------------------------------------------------ m-lanes: many rows */

/* am[t][c .. c + MRV*VWD) (NR outputs x MRV row vectors, in registers) over kn k's:
 * am = am + xt[k][row] * w[t][k], k in order. */
#define MDOT_FN(MRV)                                                                       \
    ALWAYS void KNAME(mdot_##MRV)(float *am, int mpad, int c, const float *xt,             \
                                   const float *const *wk, int kn, const int bf) {         \
        vf a[MRV][NR];                                                                     \
        for (int v = 0; v < MRV; v++)                                                      \
            for (int t = 0; t < NR; t++) a[v][t] = V_LOAD(am + (size_t)t * mpad + c + v * VWD); \
        for (int kk = 0; kk < kn; kk++) {                                                  \
            const float *xk = xt + (size_t)kk * mpad + c;                                  \
            vf xv[MRV];                                                                    \
            for (int v = 0; v < MRV; v++) xv[v] = V_LOAD(xk + v * VWD);                    \
            for (int t = 0; t < NR; t++) {                                                 \
                vf wv = V_SET1(wk[t][kk]);                                                 \
                for (int v = 0; v < MRV; v++)                                              \
                    a[v][t] = RND(bf, V_ADD(a[v][t], RND(bf, V_MUL(xv[v], wv))));          \
            }                                                                              \
        }                                                                                  \
        for (int v = 0; v < MRV; v++)                                                      \
            for (int t = 0; t < NR; t++) V_STORE(am + (size_t)t * mpad + c + v * VWD, a[v][t]); \
    }
MDOT_FN(1)
MDOT_FN(2)
MDOT_FN(3)
#if MRV_MAX >= 4
MDOT_FN(4)
#endif

/* One item of a group of many rows (read transposed, g->xt [K][mpad]): outputs
 * [n0, n1) in blocks of NR, each block's weights dequantized once per group of k. */
ALWAYS void KNAME(m_lanes)(const Job *job, const Group *g, int n0, int n1, float *scratch,
                           const int bf) {
    const Problem *pb = job->pb;
    const int N = pb->N, K = pb->K, q = pb->quantized, bits = pb->bits;
    const int chunk = q ? pb->group : 64; /* k's per dequantized piece */
    const int mpad = g->mpad;
    float *wr = align16(scratch);
    float *am = align16(wr + (size_t)NR * 128);
    const uint8_t *wbase = pb->w + (ptrdiff_t)g->expert * pb->w_e_stride;
    for (int nb = n0; nb < n1; nb += NR) {
        const uint8_t *row[NR];
        int nn[NR];
        for (int t = 0; t < NR; t++) {
            nn[t] = nb + t < N ? nb + t : N - 1;
            row[t] = wbase + (ptrdiff_t)nn[t] * pb->w_row_stride;
        }
        memset(am, 0, sizeof(float) * (size_t)NR * mpad);
        for (int kc = 0; kc < K; kc += chunk) {
            const int kn = K - kc < chunk ? K - kc : chunk;
            const float *wk[NR];
            for (int t = 0; t < NR; t++) {
                if (!q) {
                    wk[t] = (const float *)row[t] + kc;
                    continue;
                }
                const int j = kc / pb->group;
                const vf s = V_SET1(sb_at(pb, 0, g->expert, nn[t], j));
                const vf b = V_SET1(sb_at(pb, 1, g->expert, nn[t], j));
                float *dst = wr + (size_t)t * 128;
                for (int k = 0; k < kn; k += VWD) {
                    vf v = RND(bf, V_MUL(s, V_CVT(v_unpack(row[t], bits, kc + k))));
                    V_STORE(dst + k, RND(bf, V_ADD(v, b)));
                }
                wk[t] = dst;
            }
            const float *xt = g->xt + (size_t)kc * mpad;
            for (int c = 0; c < mpad; c += MRV_MAX * VWD) {
                int left = (mpad - c) / VWD;
                if (left >= MRV_MAX) {
#if MRV_MAX >= 4
                    KNAME(mdot_4)(am, mpad, c, xt, wk, kn, bf);
#else
                    KNAME(mdot_3)(am, mpad, c, xt, wk, kn, bf);
#endif
                } else if (left == 3) {
                    KNAME(mdot_3)(am, mpad, c, xt, wk, kn, bf);
                } else if (left == 2) {
                    KNAME(mdot_2)(am, mpad, c, xt, wk, kn, bf);
                } else {
                    KNAME(mdot_1)(am, mpad, c, xt, wk, kn, bf);
                }
            }
        }
        for (int t = 0; t < NR && nb + t < n1; t++) {
            const int n = nb + t;
            for (int i = 0; i < g->count; i++) {
                float v = am[(size_t)t * mpad + i];
                if (pb->out_bias) v = bf ? rnd_bf16(v + pb->out_bias[n]) : v + pb->out_bias[n];
                pb->out[(size_t)job->order[g->start + i] * N + n] = v;
            }
        }
    }
}

#ifndef FUSED_ROWS
#define FUSED_ROWS 4 /* groups of up to this many rows run the fused kernel */
#endif
/* n_fused for one (rows, bits, rounding): each a specialization of the always-inline body. */
#define FUSED(BF, BITS, MB)                                                                \
    SMOE_TARGET static void KNAME(fused_##BF##_##BITS##_##MB)(const Job *job, const Group *g, \
                                                              int n0, int n1, float *s) { \
        KNAME(n_fused)(job, g, n0, n1, s, BF, BITS, MB);                                   \
    }
#define FUSED_ALL(BF, MB) FUSED(BF, 2, MB) FUSED(BF, 4, MB) FUSED(BF, 8, MB) FUSED(BF, 32, MB)
FUSED_ALL(0, 1)
FUSED_ALL(0, 2)
FUSED_ALL(0, 3)
FUSED_ALL(0, 4)
FUSED_ALL(1, 1)
FUSED_ALL(1, 2)
FUSED_ALL(1, 3)
FUSED_ALL(1, 4)

SMOE_TARGET static int KNAME(run_fused)(Job *job, const Group *g, const Item *it, float *s) {
    const Problem *pb = job->pb;
    const int bits = pb->quantized ? pb->bits : 32, m = g->count;
#define ROWS(BF, B)                                                                        \
    switch (m) {                                                                           \
    case 1: KNAME(fused_##BF##_##B##_1)(job, g, it->n0, it->n1, s); return 1;            \
    case 2: KNAME(fused_##BF##_##B##_2)(job, g, it->n0, it->n1, s); return 1;            \
    case 3: KNAME(fused_##BF##_##B##_3)(job, g, it->n0, it->n1, s); return 1;            \
    case 4: KNAME(fused_##BF##_##B##_4)(job, g, it->n0, it->n1, s); return 1;            \
    }
#define PICK(BF)                                                                           \
    switch (bits) {                                                                        \
    case 2: ROWS(BF, 2) break;                                                             \
    case 4: ROWS(BF, 4) break;                                                             \
    case 8: ROWS(BF, 8) break;                                                             \
    case 32: ROWS(BF, 32) break;                                                           \
    }
    if (pb->bf16) {
        PICK(1)
    } else {
        PICK(0)
    }
#undef PICK
#undef ROWS
    return 0;
}

SMOE_TARGET static void KNAME(run_item)(Job *job, const Item *it, float *scratch) {
    const Group *g = &job->groups[it->group];
    const int small = g->count <= job->small;
    if (g->count <= FUSED_ROWS && KNAME(run_fused)(job, g, it, scratch)) return;
    if (job->pb->bf16) {
        if (small)
            KNAME(n_lanes)(job, g, it->n0, it->n1, scratch, 1);
        else
            KNAME(m_lanes)(job, g, it->n0, it->n1, scratch, 1);
    } else {
        if (small)
            KNAME(n_lanes)(job, g, it->n0, it->n1, scratch, 0);
        else
            KNAME(m_lanes)(job, g, it->n0, it->n1, scratch, 0);
    }
}

/* Floating-point operations this core completes per second in these vectors, without
 * FMA (a multiply and an add count one each): 12 independent chains each of multiplies
 * and adds, enough to hide their latency. The yardstick of the kernels' GFLOP/s. */
SMOE_TARGET static double KNAME(peak)(long iters) {
    vf m[12], a[12];
    const vf one = V_SET1(1.0000001f), tiny = V_SET1(1e-30f);
    for (int i = 0; i < 12; i++) {
        m[i] = V_SET1(1.0f + i);
        a[i] = V_SET1((float)i);
    }
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long it = 0; it < iters; it++) {
        for (int i = 0; i < 12; i++) {
            m[i] = V_MUL(m[i], one);
            a[i] = V_ADD(a[i], tiny);
        }
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    float sink[VWD] __attribute__((aligned(64)));
    vf sum = V_ZERO();
    for (int i = 0; i < 12; i++) sum = V_ADD(sum, V_ADD(m[i], a[i]));
    V_STORE(sink, sum);
    peak_sink += sink[0];
    double s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    return (double)iters * 24.0 * VWD / s;
}

#undef DOT_FN
#undef MDOT_FN
#undef PREFETCH_AHEAD
#undef FUSED
#undef FUSED_ALL
#undef RND
#undef ALWAYS
#undef VWD
#undef NT_MAX
#undef SMALL_M
#undef NR
#undef MRV_MAX
#undef vf
#undef vi
#undef v_bf16
#undef v_transpose
#undef v_unpack
#undef V_ZERO
#undef V_LOAD
#undef V_LOADU
#undef V_STORE
#undef V_STOREU
#undef V_SET1
#undef V_ADD
#undef V_MUL
#undef VI_LOADU
#undef VI_SET1
#undef VI_SRLV
#undef VI_SRL
#undef VI_SRLI
#undef VI_AND
#undef V_CVT
#undef V_AS_I
#undef V_AS_F
