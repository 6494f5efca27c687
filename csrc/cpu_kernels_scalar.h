/* The portable kernels: one output's chain at a time, exactly as MLX's loops run it.
 * Every instruction set's reference, and what runs where none is available. */

static size_t KNAME(scratch)(const Problem *pb) {
    (void)pb;
    return 16;
}

static int KNAME(tile)(const Problem *pb) {
    (void)pb;
    return 16;
}

static void KNAME(run_item)(Job *job, const Item *it, float *scratch) {
    (void)scratch;
    const Problem *pb = job->pb;
    const Group *g = &job->groups[it->group];
    const int N = pb->N, K = pb->K, bf = pb->bf16;
    const uint8_t *wbase = pb->w + (ptrdiff_t)g->expert * pb->w_e_stride;
    for (int i = 0; i < g->count; i++) {
        const int p = job->order[g->start + i];
        const float *x = pb->x + (size_t)pb->rows[p] * K;
        for (int n = it->n0; n < it->n1; n++) {
            const uint8_t *row = wbase + (ptrdiff_t)n * pb->w_row_stride;
            float sum = 0.0f;
            if (pb->quantized) {
                for (int k = 0; k < K; k++) {
                    const int j = k / pb->group;
                    const float sj = sb_at(pb, 0, g->expert, n, j), bj = sb_at(pb, 1, g->expert, n, j);
                    float w = sj * (float)q_at(row, pb->bits, k);
                    if (bf) w = rnd_bf16(w);
                    w = w + bj;
                    if (bf) w = rnd_bf16(w);
                    float t = x[k] * w;
                    if (bf) t = rnd_bf16(t);
                    sum = sum + t;
                    if (bf) sum = rnd_bf16(sum);
                }
            } else {
                const float *w = (const float *)row;
                for (int k = 0; k < K; k++) sum = sum + x[k] * w[k];
            }
            if (pb->out_bias) sum = bf ? rnd_bf16(sum + pb->out_bias[n]) : sum + pb->out_bias[n];
            pb->out[(size_t)p * N + n] = sum;
        }
    }
}

static double KNAME(peak)(long iters) {
    float m[12], a[12];
    for (int i = 0; i < 12; i++) {
        m[i] = 1.0f + i;
        a[i] = (float)i;
    }
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long it = 0; it < iters; it++)
        for (int i = 0; i < 12; i++) {
            m[i] = m[i] * 1.0000001f;
            a[i] = a[i] + 1e-30f;
        }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    for (int i = 0; i < 12; i++) peak_sink += m[i] + a[i];
    double s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    return (double)iters * 24.0 / s;
}
