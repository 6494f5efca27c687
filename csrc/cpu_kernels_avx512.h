/* The vector layer of cpu_kernels_impl.h for AVX-512: 16 float32 lanes, 32 registers.
 * Every float operation is one IEEE multiply or add (no FMA; see cpu_kernels_avx2.h). */
#define VWD 16
#define NT_MAX 8   /* sub-tiles of VWD outputs per n-lanes item */
#define SMALL_M 12 /* rows up to which the n-lanes kernel runs */
#define NR 4       /* outputs per m-lanes block */
#define MRV_MAX 4  /* row vectors per m-lanes chunk (4 x NR accumulators + 4 rows + 1) */
#define vf __m512
#define vi __m512i
#define v_bf16 v_bf16_avx512
#define v_transpose v_transpose_avx512
#define v_unpack v_unpack_avx512

#define V_ZERO() _mm512_setzero_ps()
#define V_LOAD(p) _mm512_load_ps(p)
#define V_LOADU(p) _mm512_loadu_ps(p)
#define V_STORE(p, v) _mm512_store_ps((p), (v))
#define V_STOREU(p, v) _mm512_storeu_ps((p), (v))
#define V_SET1(f) _mm512_set1_ps(f)
#define V_ADD(a, b) _mm512_add_ps((a), (b))
#define V_MUL(a, b) _mm512_mul_ps((a), (b))
#define VI_SET1(i) _mm512_set1_epi32(i)
#define VI_SRL(v, n) _mm512_srl_epi32((v), _mm_cvtsi32_si128(n))
#define VI_SRLI(v, n) _mm512_srli_epi32((v), (unsigned)(n))
#define VI_AND(a, b) _mm512_and_si512((a), (b))
#define V_CVT(v) _mm512_cvtepi32_ps(v)
#define V_AS_I(v) _mm512_castps_si512(v)
#define V_AS_F(v) _mm512_castsi512_ps(v)

SMOE_TARGET static inline vf v_bf16(vf f) {
    vi u = _mm512_castps_si512(f);
    vi lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    u = _mm512_and_si512(u, _mm512_set1_epi32((int)0xFFFF0000u));
    __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    return _mm512_mask_blend_ps(nan, _mm512_castsi512_ps(u),
                                _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
}

/* r[i] (lane j) <- r[j] (lane i): a 16x16 transpose of 32-bit elements (pairs, quads,
 * then 128-bit lanes twice; checked in numpy against the instructions' definitions). */
SMOE_TARGET static inline void v_transpose(vf r[VWD]) {
    vf t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int j = 0; j < 4; j++) {
        t[j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);
        t[4 + j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);
        t[8 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
        t[12 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
    }
    for (int j = 0; j < 4; j++) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
        r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd);
        r[4 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0x88);
        r[12 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0xdd);
    }
}

/* The q values of VWD consecutive k (from k0, a multiple of VWD) of a packed row. */
SMOE_TARGET static inline vi v_unpack(const uint8_t *row, int bits, int k0) {
    if (bits == 8) return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + k0)));
    if (bits == 4) { /* 16 nibbles: two words, each to 8 lanes */
        vi two = _mm512_castsi128_si512(_mm_loadl_epi64((const __m128i *)(row + k0 / 2)));
        vi v = _mm512_permutexvar_epi32(
            _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1), two);
        v = _mm512_srlv_epi32(v, _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12,
                                                    16, 20, 24, 28));
        return _mm512_and_si512(v, _mm512_set1_epi32(15));
    }
    uint32_t word; /* 2 bits: 16 values in one word */
    memcpy(&word, row + k0 / 4, 4);
    vi v = _mm512_srlv_epi32(_mm512_set1_epi32((int)word),
                             _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24,
                                               26, 28, 30));
    return _mm512_and_si512(v, _mm512_set1_epi32(3));
}
