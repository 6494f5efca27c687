/* smoe._cpu_kernels: MLX's Linux CPU matmuls, bit for bit, at the cores' speed.
 *
 * What MLX 0.32 computes on an x86-64 Linux CPU (its wheel: SSE2, no FMA, one core):
 *   quantized_matmul (transpose=True, affine), per output n of row m, over k in order:
 *       sum = sum + x[m,k] * ((scale * q[n,k]) + bias)      four roundings a term
 *   in float32, or in bfloat16 with each of those four results rounded to bfloat16;
 *   gather_qmm: the same for each (row, expert) pair;
 *   matmul float32 (its bundled reference BLAS, sgemm 'T','N'): sum = sum + x[m,k]*w[n,k]
 *   from +0 in k order, then + bias for an addmm (nn.Linear with a bias).
 * Each output is one sequential chain. This file puts different outputs (few rows: the
 * "n-lanes" kernel) or different rows (many rows: the "m-lanes" kernel) in the SIMD lanes
 * and performs, per k, the same operations in the same order: the same bits. A weight's
 * dequantized value (scale*q + bias, rounded as MLX rounds it) does not depend on the row,
 * so it is computed once per call and reused across rows. Threads split the outputs.
 * Compiled with -ffp-contract=off: a fused multiply-add would round once, not twice.
 *
 * Instruction sets are chosen at run time: AVX2 (8 lanes), AVX-512 (16 lanes) where the
 * CPU has it, else portable C (one lane). The same kernel text is instantiated for each
 * (cpu_kernels_impl.h, included below with a vector layer).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(_M_X64)
#define SMOE_X86 1
#include <immintrin.h>
#else
#define SMOE_X86 0
#endif

/* ------------------------------------------------------------------ the problem */

typedef struct {
    int bf16;       /* round every result to bfloat16, as MLX's bfloat16 kernels do */
    int quantized;  /* 1: affine quantized weights; 0: float32 weights (sgemm) */
    int bits, group;
    int N, K;
    const float *x; /* rows of K floats (bfloat16 inputs widened: exact) */
    /* Expert e's weight rows: w + e*w_e_stride, row n at + n*w_row_stride (bytes). */
    const uint8_t *w;
    ptrdiff_t w_e_stride, w_row_stride;
    /* Its scales and biases, read where they are: [E][N][K/group] with these strides
     * (bytes; the last axis contiguous), float32 or bfloat16 (sb_bf16). */
    const uint8_t *scales, *biases;
    ptrdiff_t sb_e_stride, sb_row_stride;
    int sb_bf16;
    const float *out_bias; /* [N] added after the chain (addmm, a layer's bias); or NULL */
    float *out;            /* [P][N] float32 results (rounded to bf16 where bf16) */
    int P;
    const int32_t *rows;    /* pair p's x row */
    const int32_t *experts; /* pair p's expert */
} Problem;

/* Pairs grouped by expert, and each group's rows transposed for the m-lanes kernel. */
typedef struct {
    int expert, start, count; /* into order[] */
    float *xt;                /* [K][count padded] for count > small (else NULL) */
    int mpad;
} Group;

typedef struct {
    int group;     /* index into groups */
    int n0, n1;    /* outputs [n0, n1) */
} Item;

typedef struct Job {
    const Problem *pb;
    const Group *groups;
    const int32_t *order; /* pairs sorted by expert */
    const Item *items;
    int n_items;
    int small; /* groups of at most this many rows run the n-lanes kernel */
    void (*run_item)(struct Job *, const Item *, float *scratch);
    volatile int next; /* the next item to take (atomic) */
    int failed;
} Job;

/* ------------------------------------------------------------------ scalar helpers */

static inline float f_of(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint32_t u_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
/* MLX's float -> bfloat16 (round to nearest even; NaN -> 0x7FC0), as float again. */
static inline float rnd_bf16(float f) {
    if (f != f) return f_of(0x7FC00000u);
    uint32_t u = u_of(f);
    u += ((u >> 16) & 1u) + 0x7FFFu;
    return f_of(u & 0xFFFF0000u);
}
static inline float bf16_to_f32(uint16_t h) { return f_of((uint32_t)h << 16); }
static inline uint16_t f32_to_bf16_bits(float f) {
    /* f is already a bfloat16 value (rounded): its upper half */
    return (uint16_t)(u_of(f) >> 16);
}

/* Scale or bias j of output n of expert e (which: 0 scales, 1 biases), as float32. */
static inline float sb_at(const Problem *pb, int which, int e, int n, int j) {
    const uint8_t *row = (which ? pb->biases : pb->scales) + (ptrdiff_t)e * pb->sb_e_stride +
                         (ptrdiff_t)n * pb->sb_row_stride;
    if (pb->sb_bf16) {
        uint16_t h;
        memcpy(&h, row + 2 * (size_t)j, 2);
        return bf16_to_f32(h);
    }
    float f;
    memcpy(&f, row + 4 * (size_t)j, 4);
    return f;
}

/* q (bits wide) of element k of a packed row, as MLX packs it: low bits first, 2/4/8 bits
 * within bytes; 3/5/6 bits across bytes in packs of 8 (3, 5) or 4 (6) values. */
static inline uint32_t q_at(const uint8_t *row, int bits, int k) {
    if (bits == 2 || bits == 4 || bits == 8) {
        int per = 8 / bits;
        return (row[k / per] >> ((k % per) * bits)) & ((1u << bits) - 1);
    }
    int pack = bits == 6 ? 4 : 8;
    int bytes = bits == 6 ? 3 : bits;
    const uint8_t *p = row + (k / pack) * bytes;
    uint64_t v = 0;
    for (int i = 0; i < bytes; i++) v |= (uint64_t)p[i] << (8 * i);
    return (uint32_t)(v >> ((k % pack) * bits)) & ((1u << bits) - 1);
}

static volatile float peak_sink; /* keeps the peak loops' results alive */

/* 64-byte aligned (p + up to 63 bytes): scratch buffers hold aligned vectors */
static inline float *align16(float *p) {
    uintptr_t u = (uintptr_t)p;
    return (float *)((u + 63) & ~(uintptr_t)63);
}

/* ------------------------------------------------------------------ the kernels, per ISA */

/* The portable one-lane version: every ISA's reference (and the fallback). */
#define KNAME(name) name##_scalar
#define VW 1
#include "cpu_kernels_scalar.h"
#undef KNAME
#undef VW

#if SMOE_X86
#define KNAME(name) name##_avx2
#define SMOE_TARGET __attribute__((target("avx2")))
#include "cpu_kernels_avx2.h"
#include "cpu_kernels_impl.h"
#undef KNAME
#undef SMOE_TARGET

#define KNAME(name) name##_avx512
#define SMOE_TARGET __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl")))
#include "cpu_kernels_avx512.h"
#include "cpu_kernels_impl.h"
#undef KNAME
#undef SMOE_TARGET
#endif

/* ------------------------------------------------------------------ threads */

/* A pool of worker threads; the calling thread is one more. A decode step makes a
 * hundred calls a token, back to back, and waking a sleeping thread costs tens of
 * microseconds (more under a hypervisor): a worker spins SPIN_NS after each job before
 * it sleeps, and the caller spins as long for the workers to finish. */
#define SPIN_NS 50000

typedef struct {
    pthread_t *threads;
    int n; /* worker threads */
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    Job *job;                 /* written before generation is published */
    unsigned long generation; /* atomic: a new job */
    int busy;                 /* atomic: workers still on the job */
    int sleepers;             /* under mu: workers waiting on go */
    int stopping;             /* atomic */
} Pool;

static Pool pool = {NULL, 0, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
                    PTHREAD_COND_INITIALIZER, NULL, 0, 0, 0, 0};
static int want_threads = 0; /* 0: every CPU this process may run on */
static pthread_mutex_t call_mu = PTHREAD_MUTEX_INITIALIZER; /* one call in the pool at a time */
static size_t scratch_floats = 0;

static inline uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static inline void relax(void) {
#if SMOE_X86
    for (int i = 0; i < 32; i++) _mm_pause();
#endif
}

static void run_items(Job *job, float *scratch) {
    for (;;) {
        int i = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (i >= job->n_items) return;
        job->run_item(job, &job->items[i], scratch);
    }
}

static __thread float *thread_scratch = NULL;
static __thread size_t thread_scratch_n = 0;

static float *scratch_for_thread(size_t n) {
    if (thread_scratch_n < n) {
        free(thread_scratch);
        thread_scratch = NULL;
        thread_scratch_n = 0;
        if (posix_memalign((void **)&thread_scratch, 64, n * sizeof(float)) != 0) return NULL;
        thread_scratch_n = n;
    }
    return thread_scratch;
}

/* The next generation after ``seen``: spun for, then slept for (no wakeup is lost: the
 * generation is read again under the lock that the publisher takes). */
static unsigned long next_generation(unsigned long seen) {
    uint64_t until = now_ns() + SPIN_NS;
    unsigned long g;
    while ((g = __atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE)) == seen &&
           !__atomic_load_n(&pool.stopping, __ATOMIC_ACQUIRE)) {
        if (now_ns() < until) {
            relax();
            continue;
        }
        pthread_mutex_lock(&pool.mu);
        pool.sleepers++;
        while ((g = __atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE)) == seen &&
               !__atomic_load_n(&pool.stopping, __ATOMIC_ACQUIRE))
            pthread_cond_wait(&pool.go, &pool.mu);
        pool.sleepers--;
        pthread_mutex_unlock(&pool.mu);
        break;
    }
    return g;
}

static void *worker(void *arg) {
    (void)arg;
    unsigned long seen = 0;
    for (;;) {
        seen = next_generation(seen);
        if (__atomic_load_n(&pool.stopping, __ATOMIC_ACQUIRE)) break;
        Job *job = pool.job;
        float *scratch = scratch_for_thread(scratch_floats);
        if (scratch == NULL)
            __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED);
        else
            run_items(job, scratch);
        if (__atomic_sub_fetch(&pool.busy, 1, __ATOMIC_ACQ_REL) == 0) {
            pthread_mutex_lock(&pool.mu);
            pthread_cond_signal(&pool.done);
            pthread_mutex_unlock(&pool.mu);
        }
    }
    return NULL;
}

static int cpus_available(void) {
#ifdef __linux__
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
#endif
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static void pool_stop(void) {
    if (pool.n == 0) return;
    pthread_mutex_lock(&pool.mu);
    __atomic_store_n(&pool.stopping, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&pool.go);
    pthread_mutex_unlock(&pool.mu);
    for (int i = 0; i < pool.n; i++) pthread_join(pool.threads[i], NULL);
    free(pool.threads);
    pool.threads = NULL;
    pool.n = 0;
    __atomic_store_n(&pool.stopping, 0, __ATOMIC_RELEASE);
}

static int pool_size_wanted(void) { return want_threads > 0 ? want_threads : cpus_available(); }

/* A forked child has none of the parent's workers: it starts a pool of its own. */
static void pool_forget_after_fork(void) {
    pool.threads = NULL;
    pool.n = 0;
    pool.sleepers = 0;
    pool.busy = 0;
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.go, NULL);
    pthread_cond_init(&pool.done, NULL);
    pthread_mutex_init(&call_mu, NULL);
}

static int pool_ensure(void) {
    int workers = pool_size_wanted() - 1;
    if (workers == pool.n) return 0;
    pool_stop();
    if (workers <= 0) return 0;
    pool.threads = calloc((size_t)workers, sizeof(pthread_t));
    if (pool.threads == NULL) return -1;
    for (int i = 0; i < workers; i++) {
        if (pthread_create(&pool.threads[i], NULL, worker, NULL) != 0) {
            pool.n = i;
            return -1;
        }
    }
    pool.n = workers;
    return 0;
}

/* Run every item of ``job``: the workers and this thread take items in turn. One caller
 * at a time (the engine's compute thread; the module's functions hold the GIL until
 * here, and solve takes call_mu around it for callers on other threads). */
static int pool_run(Job *job, size_t scratch_n, int parallel) {
    float *mine = scratch_for_thread(scratch_n);
    if (mine == NULL) return -1;
    if (!parallel || pool.n == 0) {
        run_items(job, mine);
        return job->failed ? -1 : 0;
    }
    pool.job = job;
    scratch_floats = scratch_n;
    __atomic_store_n(&pool.busy, pool.n, __ATOMIC_RELEASE);
    pthread_mutex_lock(&pool.mu);
    __atomic_add_fetch(&pool.generation, 1, __ATOMIC_RELEASE);
    if (pool.sleepers > 0) pthread_cond_broadcast(&pool.go);
    pthread_mutex_unlock(&pool.mu);
    run_items(job, mine);
    uint64_t until = now_ns() + SPIN_NS;
    while (__atomic_load_n(&pool.busy, __ATOMIC_ACQUIRE) > 0) {
        if (now_ns() < until) {
            relax();
            continue;
        }
        pthread_mutex_lock(&pool.mu);
        while (__atomic_load_n(&pool.busy, __ATOMIC_ACQUIRE) > 0)
            pthread_cond_wait(&pool.done, &pool.mu);
        pthread_mutex_unlock(&pool.mu);
    }
    return job->failed ? -1 : 0;
}

/* ------------------------------------------------------------------ dispatch */

enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
static const char *isa_names[] = {"scalar", "avx2", "avx512"};
static int isa_forced = -1; /* -1: the best this CPU has */

static int isa_supported(int isa) {
#if SMOE_X86
    __builtin_cpu_init();
    if (isa == ISA_AVX2) return __builtin_cpu_supports("avx2");
    if (isa == ISA_AVX512)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
#endif
    return isa == ISA_SCALAR;
}

static int isa_best(void) {
    if (isa_forced >= 0) return isa_forced;
    if (isa_supported(ISA_AVX512)) return ISA_AVX512;
    if (isa_supported(ISA_AVX2)) return ISA_AVX2;
    return ISA_SCALAR;
}

typedef struct {
    int lanes;          /* outputs per n-lanes sub-tile */
    int small;          /* rows up to which the n-lanes kernel runs */
    int nr;             /* outputs per m-lanes block */
    size_t (*scratch)(const Problem *);
    void (*run_item)(Job *, const Item *, float *);
    int (*tile)(const Problem *); /* outputs per n-lanes item */
} Kernels;

static Kernels kernels_for(int isa) {
    Kernels k;
#if SMOE_X86
    if (isa == ISA_AVX512) {
        k.lanes = 16; k.small = 12; k.nr = 4;
        k.scratch = scratch_avx512; k.run_item = run_item_avx512; k.tile = tile_avx512;
        return k;
    }
    if (isa == ISA_AVX2) {
        k.lanes = 8; k.small = 6; k.nr = 3;
        k.scratch = scratch_avx2; k.run_item = run_item_avx2; k.tile = tile_avx2;
        return k;
    }
#endif
    (void)isa;
    k.lanes = 1; k.small = 1 << 30; k.nr = 1;
    k.scratch = scratch_scalar; k.run_item = run_item_scalar; k.tile = tile_scalar;
    return k;
}

/* Solve ``pb`` with the kernels of ``isa``; 0, or -1 with a Python error set. */
static int solve(const Problem *pb, int isa) {
    if (pb->quantized && !(pb->bits == 2 || pb->bits == 4 || pb->bits == 8))
        isa = ISA_SCALAR; /* 3, 5, 6 bits pack across bytes: the portable kernel */
    Kernels kn = kernels_for(isa);
    int P = pb->P, N = pb->N, K = pb->K;
    int32_t *order = malloc(sizeof(int32_t) * (size_t)(P > 0 ? P : 1));
    Group *groups = malloc(sizeof(Group) * (size_t)(P > 0 ? P : 1));
    Item *items = NULL;
    int n_groups = 0, rc = -1;
    if (order == NULL || groups == NULL) goto oom;
    /* Pairs by expert (stable): each expert's weights are dequantized once for its rows. */
    for (int p = 0; p < P; p++) order[p] = p;
    {
        /* insertion sort by expert: P is small (a call's (token, rank) pairs) */
        for (int i = 1; i < P; i++) {
            int32_t v = order[i];
            int j = i - 1;
            while (j >= 0 && pb->experts[order[j]] > pb->experts[v]) {
                order[j + 1] = order[j];
                j--;
            }
            order[j + 1] = v;
        }
    }
    for (int p = 0; p < P;) {
        int e = pb->experts[order[p]], q = p;
        while (q < P && pb->experts[order[q]] == e) q++;
        Group g = {e, p, q - p, NULL, 0};
        groups[n_groups++] = g;
        p = q;
    }
    /* The m-lanes kernel reads each group's rows transposed: [K][rows padded]. */
    for (int g = 0; g < n_groups; g++) {
        Group *gr = &groups[g];
        if (gr->count <= kn.small) continue;
        int mpad = (gr->count + kn.lanes - 1) / kn.lanes * kn.lanes;
        if (posix_memalign((void **)&gr->xt, 64, sizeof(float) * (size_t)mpad * (size_t)K) != 0) {
            gr->xt = NULL;
            goto oom;
        }
        gr->mpad = mpad;
        for (int k = 0; k < K; k++) {
            float *dst = gr->xt + (size_t)k * mpad;
            for (int i = 0; i < gr->count; i++)
                dst[i] = pb->x[(size_t)pb->rows[order[gr->start + i]] * K + k];
            for (int i = gr->count; i < mpad; i++) dst[i] = 0.0f;
        }
    }
    /* Items: each group's outputs in blocks; threads take them in turn. */
    {
        int n_items = 0, cap = 0;
        for (int g = 0; g < n_groups; g++) {
            int step = groups[g].count <= kn.small ? kn.tile(pb) : kn.nr * 8;
            for (int n0 = 0; n0 < N; n0 += step) {
                if (n_items == cap) {
                    cap = cap ? 2 * cap : 256;
                    Item *bigger = realloc(items, sizeof(Item) * (size_t)cap);
                    if (bigger == NULL) goto oom;
                    items = bigger;
                }
                Item it = {g, n0, n0 + step < N ? n0 + step : N};
                items[n_items++] = it;
            }
        }
        Job job = {pb, groups, order, items, n_items, kn.small, kn.run_item, 0, 0};
        /* A small call is not worth waking the other cores for (a router, one row of a
         * small projection: waking them costs tens of microseconds). */
        double work = (double)P * N * K;
        int parallel = n_items > 1 && work >= 1.0e6;
        size_t need = kn.scratch(pb);
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&call_mu);
        rc = pool_ensure();
        if (rc == 0) rc = pool_run(&job, need, parallel);
        pthread_mutex_unlock(&call_mu);
        Py_END_ALLOW_THREADS
        if (rc != 0) goto oom;
    }
    rc = 0;
    goto done;
oom:
    PyErr_NoMemory();
    rc = -1;
done:
    for (int g = 0; g < n_groups; g++) free(groups[g].xt);
    free(groups);
    free(order);
    free(items);
    return rc;
}

/* ------------------------------------------------------------------ Python */

typedef struct {
    Py_buffer view;
    int held;
} Buf;

static void release(Buf *b) {
    if (b->held) PyBuffer_Release(&b->view);
    b->held = 0;
}

static int get_buf(PyObject *obj, Buf *b, const char *name, int writable) {
    int flags = PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &b->view, flags) != 0) {
        PyErr_Format(PyExc_TypeError, "%s: not a buffer of the expected kind", name);
        return -1;
    }
    b->held = 1;
    return 0;
}

static int c_contiguous_rows(const Py_buffer *v) {
    /* the last axis contiguous */
    return v->ndim >= 1 && v->strides[v->ndim - 1] == v->itemsize;
}

/* float32 or bfloat16-bits (uint16) data of ``b`` as a new float32 array, in C order of
 * its (possibly strided) elements. */
static float *widen(const Buf *b, int bf16, Py_ssize_t *count) {
    const Py_buffer *v = &b->view;
    Py_ssize_t n = 1;
    for (int d = 0; d < v->ndim; d++) n *= v->shape[d];
    *count = n;
    float *out = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    if (out == NULL) return NULL;
    Py_ssize_t idx[8] = {0};
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t off = 0;
        for (int d = 0; d < v->ndim; d++) off += idx[d] * v->strides[d];
        const char *p = (const char *)v->buf + off;
        if (bf16) {
            uint16_t h;
            memcpy(&h, p, 2);
            out[i] = bf16_to_f32(h);
        } else {
            memcpy(&out[i], p, 4);
        }
        for (int d = v->ndim - 1; d >= 0; d--) {
            if (++idx[d] < v->shape[d]) break;
            idx[d] = 0;
        }
    }
    return out;
}

static int check_itemsize(const Buf *b, Py_ssize_t size, const char *name) {
    if (b->view.itemsize != size) {
        PyErr_Format(PyExc_TypeError, "%s: items of %zd bytes expected, got %zd", name, size,
                     b->view.itemsize);
        return -1;
    }
    if (b->view.ndim > 8) {
        PyErr_Format(PyExc_ValueError, "%s: too many dimensions", name);
        return -1;
    }
    return 0;
}

/* matmul(x, w, out, *, scales=None, biases=None, bits=0, group=0, rows=None, experts=None,
 *        bias=None, bf16=False, isa=None)
 * x: [R, K] float32 (or uint16: bfloat16 bits); w: float32 [N, K] / [E, N, K], or uint32
 * packed [N, K*bits/32] / [E, N, ...] with scales and biases [.., N, K/group]; out: [P, N]
 * float32 (or uint16), written. rows/experts: int32 [P] (default: row p, expert 0).
 */
static PyObject *py_matmul(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *names[] = {"x", "w", "out", "scales", "biases", "bits", "group", "rows",
                            "experts", "bias", "bf16", "isa", NULL};
    PyObject *xo, *wo, *outo, *so = Py_None, *bo = Py_None, *rowso = Py_None,
                               *expo = Py_None, *biaso = Py_None, *isao = Py_None;
    int bits = 0, group = 0, bf16 = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|OOiiOOOpO", names, &xo, &wo, &outo, &so,
                                     &bo, &bits, &group, &rowso, &expo, &biaso, &bf16, &isao))
        return NULL;
    Buf x = {0}, w = {0}, out = {0}, sc = {0}, bi = {0}, rw = {0}, ex = {0}, bs = {0};
    float *xf = NULL, *biasf = NULL, *outf = NULL;
    int32_t *rows_own = NULL, *exp_own = NULL;
    PyObject *result = NULL;
    int quantized = so != Py_None;
    Py_ssize_t count;

    int isa = isa_best();
    if (isao != Py_None) {
        const char *s = PyUnicode_AsUTF8(isao);
        if (s == NULL) goto done;
        isa = -1;
        for (int i = 0; i < 3; i++)
            if (strcmp(s, isa_names[i]) == 0) isa = i;
        if (isa < 0 || !isa_supported(isa)) {
            PyErr_Format(PyExc_ValueError, "instruction set %s is not available here", s);
            goto done;
        }
    }
    if (get_buf(xo, &x, "x", 0) || get_buf(wo, &w, "w", 0) || get_buf(outo, &out, "out", 1))
        goto done;
    if (check_itemsize(&x, bf16 ? 2 : 4, "x") || check_itemsize(&out, bf16 ? 2 : 4, "out") ||
        check_itemsize(&w, 4, "w"))
        goto done;
    if (x.view.ndim != 2 || out.view.ndim != 2 || (w.view.ndim != 2 && w.view.ndim != 3)) {
        PyErr_SetString(PyExc_ValueError, "x and out must be 2-D, w 2-D or 3-D");
        goto done;
    }
    if (!c_contiguous_rows(&w.view) || (out.view.strides[1] != out.view.itemsize) ||
        out.view.strides[0] != out.view.shape[1] * out.view.itemsize) {
        PyErr_SetString(PyExc_ValueError, "w's rows and out must be contiguous");
        goto done;
    }
    Problem pb;
    memset(&pb, 0, sizeof(pb));
    pb.bf16 = bf16;
    pb.quantized = quantized;
    pb.bits = bits;
    pb.group = group;
    int wd = w.view.ndim;
    pb.N = (int)w.view.shape[wd - 2];
    pb.K = (int)x.view.shape[1];
    pb.w = (const uint8_t *)w.view.buf;
    pb.w_e_stride = wd == 3 ? w.view.strides[0] : 0;
    pb.w_row_stride = w.view.strides[wd - 2];
    int E = wd == 3 ? (int)w.view.shape[0] : 1;
    if (quantized) {
        if (!(bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8) ||
            !(group == 32 || group == 64 || group == 128) || pb.K % group != 0) {
            PyErr_SetString(PyExc_ValueError, "bits 2-8 and groups of 32, 64 or 128 only");
            goto done;
        }
        if (w.view.shape[wd - 1] * 32 != (Py_ssize_t)pb.K * bits) {
            PyErr_SetString(PyExc_ValueError, "w's packed width does not match K and bits");
            goto done;
        }
        if (get_buf(so, &sc, "scales", 0) || get_buf(bo, &bi, "biases", 0)) goto done;
        if (check_itemsize(&sc, bf16 ? 2 : 4, "scales") ||
            check_itemsize(&bi, bf16 ? 2 : 4, "biases"))
            goto done;
        const Py_buffer *sv = &sc.view, *bv = &bi.view;
        if (sv->ndim != wd || bv->ndim != wd || !c_contiguous_rows(sv) ||
            sv->shape[wd - 1] != pb.K / group || sv->shape[wd - 2] != pb.N ||
            (wd == 3 && sv->shape[0] != E))
            goto shape;
        for (int d = 0; d < wd; d++)
            if (bv->shape[d] != sv->shape[d] || bv->strides[d] != sv->strides[d]) goto shape;
        pb.scales = (const uint8_t *)sv->buf;
        pb.biases = (const uint8_t *)bv->buf;
        pb.sb_e_stride = wd == 3 ? sv->strides[0] : 0;
        pb.sb_row_stride = sv->strides[wd - 2];
        pb.sb_bf16 = bf16;
    } else {
        if (bf16) {
            PyErr_SetString(PyExc_ValueError, "float weights run in float32 only");
            goto done;
        }
        if (w.view.shape[wd - 1] != pb.K) goto shape;
    }
    xf = widen(&x, bf16, &count);
    if (xf == NULL) goto nomem;
    pb.x = xf;
    int R = (int)x.view.shape[0];
    pb.P = (int)out.view.shape[0];
    if (out.view.shape[1] != pb.N) goto shape;
    if (rowso != Py_None) {
        if (get_buf(rowso, &rw, "rows", 0) || check_itemsize(&rw, 4, "rows")) goto done;
        if (rw.view.ndim != 1 || rw.view.shape[0] != pb.P || rw.view.strides[0] != 4) goto shape;
        pb.rows = rw.view.buf;
    } else {
        if (R != pb.P) goto shape;
        rows_own = malloc(sizeof(int32_t) * (size_t)(pb.P > 0 ? pb.P : 1));
        if (rows_own == NULL) goto nomem;
        for (int p = 0; p < pb.P; p++) rows_own[p] = p;
        pb.rows = rows_own;
    }
    if (expo != Py_None) {
        if (get_buf(expo, &ex, "experts", 0) || check_itemsize(&ex, 4, "experts")) goto done;
        if (ex.view.ndim != 1 || ex.view.shape[0] != pb.P || ex.view.strides[0] != 4) goto shape;
        pb.experts = ex.view.buf;
    } else {
        exp_own = calloc((size_t)(pb.P > 0 ? pb.P : 1), sizeof(int32_t));
        if (exp_own == NULL) goto nomem;
        pb.experts = exp_own;
    }
    for (int p = 0; p < pb.P; p++) {
        if (pb.rows[p] < 0 || pb.rows[p] >= R || pb.experts[p] < 0 || pb.experts[p] >= E) {
            PyErr_SetString(PyExc_IndexError, "a row or expert index is out of range");
            goto done;
        }
    }
    if (biaso != Py_None) {
        if (get_buf(biaso, &bs, "bias", 0) || check_itemsize(&bs, bf16 ? 2 : 4, "bias"))
            goto done;
        biasf = widen(&bs, bf16, &count);
        if (biasf == NULL) goto nomem;
        if (count != pb.N) goto shape;
        pb.out_bias = biasf;
    }
    if (bf16) {
        outf = malloc(sizeof(float) * (size_t)pb.P * (size_t)pb.N + 4);
        if (outf == NULL) goto nomem;
        pb.out = outf;
    } else {
        pb.out = (float *)out.view.buf;
    }
    if (pb.P > 0 && pb.N > 0) {
        if (solve(&pb, isa) != 0) goto done;
    }
    if (bf16) {
        uint16_t *o = (uint16_t *)out.view.buf;
        for (size_t i = 0; i < (size_t)pb.P * pb.N; i++) o[i] = f32_to_bf16_bits(outf[i]);
    }
    Py_INCREF(Py_None);
    result = Py_None;
    goto done;
shape:
    PyErr_SetString(PyExc_ValueError, "shapes do not agree");
    goto done;
nomem:
    PyErr_NoMemory();
done:
    release(&x); release(&w); release(&out); release(&sc); release(&bi);
    release(&rw); release(&ex); release(&bs);
    free(xf); free(biasf); free(outf); free(rows_own); free(exp_own);
    return result;
}

static PyObject *py_isa(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    return PyUnicode_FromString(isa_names[isa_best()]);
}

static PyObject *py_available(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    PyObject *list = PyList_New(0);
    if (list == NULL) return NULL;
    for (int i = 0; i < 3; i++) {
        if (isa_supported(i)) {
            PyObject *s = PyUnicode_FromString(isa_names[i]);
            if (s == NULL || PyList_Append(list, s) != 0) {
                Py_XDECREF(s);
                Py_DECREF(list);
                return NULL;
            }
            Py_DECREF(s);
        }
    }
    return list;
}

static PyObject *py_set_threads(PyObject *self, PyObject *args) {
    (void)self;
    int n;
    if (!PyArg_ParseTuple(args, "i", &n)) return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "threads must be 0 (every CPU) or more");
        return NULL;
    }
    want_threads = n;
    return PyLong_FromLong(pool_size_wanted());
}

/* peak(isa=None): one core's float32 multiply and add throughput in these vectors. */
static PyObject *py_peak(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *names[] = {"isa", NULL};
    const char *name = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|z", names, &name)) return NULL;
    int isa = isa_best();
    if (name != NULL) {
        isa = -1;
        for (int i = 0; i < 3; i++)
            if (strcmp(name, isa_names[i]) == 0) isa = i;
        if (isa < 0 || !isa_supported(isa)) {
            PyErr_Format(PyExc_ValueError, "instruction set %s is not available here", name);
            return NULL;
        }
    }
    double flops = 0.0;
    long iters = 20000000;
    Py_BEGIN_ALLOW_THREADS
#if SMOE_X86
    if (isa == ISA_AVX512) flops = peak_avx512(iters);
    else if (isa == ISA_AVX2) flops = peak_avx2(iters);
    else
#endif
        flops = peak_scalar(iters);
    Py_END_ALLOW_THREADS
    return PyFloat_FromDouble(flops);
}

static PyObject *py_threads(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    return PyLong_FromLong(pool_size_wanted());
}

static PyMethodDef methods[] = {
    {"peak", (PyCFunction)(void (*)(void))py_peak, METH_VARARGS | METH_KEYWORDS,
     "peak(isa=None): one core's float32 multiplies and adds a second, without FMA."},
    {"threads", py_threads, METH_NOARGS, "Threads a call uses (the caller's and the pool's)."},
    {"matmul", (PyCFunction)(void (*)(void))py_matmul, METH_VARARGS | METH_KEYWORDS,
     "matmul(x, w, out, *, scales, biases, bits, group, rows, experts, bias, bf16, isa): "
     "MLX's CPU matmul chains, bit for bit (see the module source)."},
    {"isa", py_isa, METH_NOARGS, "The instruction set the kernels use on this CPU."},
    {"available", py_available, METH_NOARGS, "The instruction sets this CPU can run."},
    {"set_threads", py_set_threads, METH_VARARGS,
     "set_threads(n): threads a call may use (0: every CPU); returns the count."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_kernels",
                                    "MLX's Linux CPU matmuls, bit for bit, vectorized and threaded.",
                                    -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cpu_kernels(void) {
    pthread_atfork(NULL, NULL, pool_forget_after_fork);
    return PyModule_Create(&module);
}
