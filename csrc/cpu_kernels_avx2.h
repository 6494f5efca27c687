/* The vector layer of cpu_kernels_impl.h for AVX2: 8 float32 lanes, 16 registers. Every
 * float operation is one IEEE multiply or add (no FMA: the file compiles with
 * -ffp-contract=off and these name the instructions). */
#define VWD 8
#define NT_MAX 8   /* sub-tiles of VWD outputs per n-lanes item */
#define SMALL_M 6  /* rows up to which the n-lanes kernel runs */
#define NR 3       /* outputs per m-lanes block */
#define MRV_MAX 3  /* row vectors per m-lanes chunk (3 x NR accumulators + 3 rows + 1) */
#define vf __m256
#define vi __m256i
#define v_bf16 v_bf16_avx2
#define v_transpose v_transpose_avx2
#define v_unpack v_unpack_avx2

#define V_ZERO() _mm256_setzero_ps()
#define V_LOAD(p) _mm256_load_ps(p)
#define V_LOADU(p) _mm256_loadu_ps(p)
#define V_STORE(p, v) _mm256_store_ps((p), (v))
#define V_STOREU(p, v) _mm256_storeu_ps((p), (v))
#define V_SET1(f) _mm256_set1_ps(f)
#define V_ADD(a, b) _mm256_add_ps((a), (b))
#define V_MUL(a, b) _mm256_mul_ps((a), (b))
#define VI_LOADU(p) _mm256_loadu_si256((const __m256i *)(p))
#define VI_SET1(i) _mm256_set1_epi32(i)
#define VI_SRLV(v, s) _mm256_srlv_epi32((v), (s))
#define VI_SRL(v, n) _mm256_srl_epi32((v), _mm_cvtsi32_si128(n))
#define VI_SRLI(v, n) _mm256_srli_epi32((v), (n))
#define VI_AND(a, b) _mm256_and_si256((a), (b))
#define V_CVT(v) _mm256_cvtepi32_ps(v)
#define V_AS_I(v) _mm256_castps_si256(v)
#define V_AS_F(v) _mm256_castsi256_ps(v)

/* Round each lane to bfloat16 as MLX does (nearest even; NaN -> 0x7FC0), kept as float. */
SMOE_TARGET static inline vf v_bf16(vf f) {
    vi u = _mm256_castps_si256(f);
    vi lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    u = _mm256_and_si256(u, _mm256_set1_epi32((int)0xFFFF0000u));
    vf nan = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
    return _mm256_blendv_ps(_mm256_castsi256_ps(u),
                            _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan);
}

/* r[i] (lane j) <- r[j] (lane i): an 8x8 transpose of 32-bit elements. */
SMOE_TARGET static inline void v_transpose(vf r[VWD]) {
    vf t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    vf t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    vf t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    vf t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    vf s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
    vf s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
    vf s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
    vf s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
    vf s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
    vf s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
    vf s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
    vf s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
    r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
    r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
    r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
    r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

/* The q values of VWD consecutive k (from k0) of a packed row of 2, 4 or 8 bits, as int
 * lanes: lane i is element k0 + i. k0 is a multiple of VWD. */
SMOE_TARGET static inline vi v_unpack(const uint8_t *row, int bits, int k0) {
    if (bits == 8) return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + k0)));
    if (bits == 4) {
        uint32_t word;
        memcpy(&word, row + k0 / 2, 4);
        vi v = _mm256_set1_epi32((int)word);
        v = _mm256_srlv_epi32(v, _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
        return _mm256_and_si256(v, _mm256_set1_epi32(15));
    }
    /* 2 bits: 8 values in two bytes */
    uint16_t half;
    memcpy(&half, row + k0 / 4, 2);
    vi v = _mm256_set1_epi32((int)half);
    v = _mm256_srlv_epi32(v, _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
    return _mm256_and_si256(v, _mm256_set1_epi32(3));
}
