// adaspec (k-quant-amx): the repacked Q4_K kernel on AMX tiles, for calls of 16
// activation rows on a CPU with AMX (adaspec's `backends/ik_amx_patch.py`).
//
// The kernel above this one sums, per weight row, per super-block and per half of each
// 32-quant sub-block, scale x (weight quants . activation quants), and turns those integers
// into floats with its own operations. Integers are exact whatever computes them, so here
// the tiles compute them and the kernel's float code runs unchanged, in its order: every
// output is bit for bit the kernel's. A weight quant (0..15) times the low 3 bits, and times
// the high 3 bits, of its 6-bit scale each fit a byte, so two tile products (the second
// counted 8 times) give the scaled sums of a whole super-block; the activation quants are
// ordered so that one run of 64 holds one half of 4 sub-blocks, which keeps the halves apart.
// The process asks Linux for the tile state once (ARCH_REQ_XCOMP_PERM); refused, or with
// ADASPEC_IK_AMX=off, the kernel above runs as before.
// (its headers: ik_amx_patch.INCLUDES, at the top of the file)
#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512BW__) && defined(HAVE_VNNI256)
#define ADASPEC_AMX_Q4K 1
namespace adaspec_amx {

// The tile state is off until the process asks the kernel for it (Linux >= 5.16).
inline bool enabled() {
    static const bool ok = [] {
        const char * off = getenv("ADASPEC_IK_AMX");
        if (off && strcmp(off, "off") == 0) return false;
        return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    }();
    return ok;
}

struct TileConfig {
    uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// tiles 0-3: the sums (first halves x low scale bits, x high bits; second halves the same),
// 4 and 7: activation quants (m rows x 64 bytes), 5 and 6: weights (16 rows of 4 quants of
// each of 16 weight rows), times the low and the high scale bits
inline void configure(int m) {
    TileConfig c;
    for (int t = 0; t < 8; ++t) { c.rows[t] = t == 5 || t == 6 ? 16 : m; c.colsb[t] = 64; }
    _tile_loadconfig(&c);
}

// The activation quants of m rows, each super-block as 4 runs of 64: (half h, sub-blocks
// 4g..4g+3) at run 2h+g, so that a run holds one half of each of its sub-blocks.
template <int nrc_y>
inline void order_quants(const Q8<nrc_y, block_q8_K>& q8, int nbl, int8_t * out) {
    for (int ibl = 0; ibl < nbl; ++ibl) {
        for (int iy = 0; iy < nrc_y; ++iy) {
            const int8_t * qs = q8.y[iy][ibl].qs;
            for (int h = 0; h < 2; ++h) for (int g = 0; g < 2; ++g) {
                int8_t * dst = out + ((ibl*4 + 2*h + g)*nrc_y + iy)*64;
                for (int j = 0; j < 4; ++j) {
                    _mm_storeu_si128((__m128i *)(dst + 16*j), _mm_loadu_si128((const __m128i *)(qs + 32*(4*g + j) + 16*h)));
                }
            }
        }
    }
}

template <int nrc_y>
static void mul_mat_q4_k_r4_q8_k_amx(int n, const void * vx, size_t bx, const DataInfo& info, int nrc_x) {
    GGML_ASSERT(nrc_x%4 == 0);
    int tiled = nrc_x - nrc_x%16;
    if (tiled < nrc_x) {  // rows beyond whole tiles of 16: the kernel above, as they are
        DataInfo rest = info;
        rest.s += tiled;
        mul_mat_q4_k_r4_q8_k<nrc_y>(n, (const char *)vx + tiled*bx, bx, rest, nrc_x - tiled);
    }
    if (!tiled) return;
    Q8<nrc_y, block_q8_K> q8(info);
    const int nbl = n / QK_K;
    static thread_local std::vector<int8_t> quants;
    quants.resize(size_t(nbl)*4*nrc_y*64);
    order_quants(q8, nbl, quants.data());
    alignas(64) uint8_t wq[8][16*64];           // [2*run + p]: weights x scale bits, tile rows
    alignas(64) int32_t sums[4][nrc_y][16];
    configure(nrc_y);
    auto mf = _mm256_set1_epi8(0xf);
    auto m3 = _mm256_set1_epi8(0x30);
    auto m4b = _mm512_set1_epi8(0xf);
    auto m7 = _mm512_set1_epi32(7);
    union { __m256i vec; uint32_t val[8]; } hd[4];
    __m256 acc[4][nrc_y];
    for (int ix = 0; ix < tiled; ix += 16) {
        const block_q4_k_r4 * w[4];
        for (int G = 0; G < 4; ++G) w[G] = (const block_q4_k_r4 *)((const char *)vx + (ix + 4*G)*bx);
        for (int G = 0; G < 4; ++G) for (int iy = 0; iy < nrc_y; ++iy) acc[G][iy] = _mm256_setzero_ps();
        for (int ibl = 0; ibl < nbl; ++ibl) {
            __m256 d4[4];
            for (int G = 0; G < 4; ++G) {  // scales and mins, as the kernel above
                const block_q4_k_r4 * iq4 = w[G];
                auto dl = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)iq4[ibl].d));
                d4[G] = _mm256_set_m128(_mm256_castps256_ps128(dl), _mm256_castps256_ps128(dl));
                auto m4 = _mm256_mul_ps(_mm256_set1_ps(-1.0f), _mm256_set_m128(_mm256_extractf128_ps(dl, 1), _mm256_extractf128_ps(dl, 1)));
                auto lbits = _mm256_loadu_si256((const __m256i *)iq4[ibl].scales_l);
                auto hbits128 = _mm_loadu_si128((const __m128i *)iq4[ibl].scales_h);
                auto hbits = MM256_SET_M128I(hbits128, _mm_slli_epi16(hbits128, 4));
                hd[G].vec = _mm256_or_si256(_mm256_and_si256(lbits, mf), _mm256_and_si256(hbits, m3));
                auto mins = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lbits, 4), mf), _mm256_and_si256(_mm256_srli_epi16(hbits, 2), m3));
                process_min_r4_b32(ibl, m4, mins, q8, acc[G]);
            }
            // row r of run (h, g) holds, for each of the 16 weight rows, quants 16h + 4(r%4) .. +3
            // of sub-block 4g + r/4, times the scale's low 3 bits (and in the next tile its high 3)
            for (int j = 0; j < 8; ++j) {
                auto s = _mm512_cvtepu8_epi32(_mm_set_epi32(hd[3].val[j], hd[2].val[j], hd[1].val[j], hd[0].val[j]));
                auto slo = _mm512_and_si512(s, m7), shi = _mm512_srli_epi32(s, 3);
                slo = _mm512_or_si512(slo, _mm512_slli_epi32(slo, 16));
                shi = _mm512_or_si512(shi, _mm512_slli_epi32(shi, 16));
                // 64 bytes of each group: [bits1 h0 | bits1 h1 | bits2 h0 | bits2 h1], 4 rows each
                auto v0 = _mm512_loadu_si512((const void *)(w[0][ibl].qs + 64*j));
                auto v1 = _mm512_loadu_si512((const void *)(w[1][ibl].qs + 64*j));
                auto v2 = _mm512_loadu_si512((const void *)(w[2][ibl].qs + 64*j));
                auto v3 = _mm512_loadu_si512((const void *)(w[3][ibl].qs + 64*j));
                auto t0 = _mm512_shuffle_i32x4(v0, v1, 0x44), t1 = _mm512_shuffle_i32x4(v0, v1, 0xee);
                auto t2 = _mm512_shuffle_i32x4(v2, v3, 0x44), t3 = _mm512_shuffle_i32x4(v2, v3, 0xee);
                __m512i z[4];  // [2*parity + h]: 128-bit lane G = group G's 4 rows
                z[0] = _mm512_shuffle_i32x4(t0, t2, 0x88);
                z[1] = _mm512_shuffle_i32x4(t0, t2, 0xdd);
                z[2] = _mm512_shuffle_i32x4(t1, t3, 0x88);
                z[3] = _mm512_shuffle_i32x4(t1, t3, 0xdd);
                int g = j / 4, jr = j % 4;
                for (int par = 0; par < 2; ++par) for (int h = 0; h < 2; ++h) {
                    auto bits = z[2*par + h];
                    auto lo = _mm512_and_si512(bits, m4b);                          // quants 4*par ..
                    auto hi = _mm512_and_si512(_mm512_srli_epi16(bits, 4), m4b);    // quants 4*par + 8 ..
                    uint8_t * lo_run = wq[2*(2*h + g)], * hi_run = wq[2*(2*h + g) + 1];
                    int r_lo = 4*jr + par, r_hi = 4*jr + par + 2;
                    _mm512_store_si512((void *)(lo_run + 64*r_lo), _mm512_mullo_epi16(lo, slo));
                    _mm512_store_si512((void *)(hi_run + 64*r_lo), _mm512_mullo_epi16(lo, shi));
                    _mm512_store_si512((void *)(lo_run + 64*r_hi), _mm512_mullo_epi16(hi, slo));
                    _mm512_store_si512((void *)(hi_run + 64*r_hi), _mm512_mullo_epi16(hi, shi));
                }
            }
            // the four runs of 64 quants, written out: tile numbers are immediates
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            const int8_t * a = quants.data() + size_t(ibl)*4*nrc_y*64;
            _tile_loadd(4, a + 0*nrc_y*64, 64);
            _tile_loadd(5, wq[0], 64); _tile_loadd(6, wq[1], 64);
            _tile_dpbsud(0, 4, 5); _tile_dpbsud(1, 4, 6);
            _tile_loadd(7, a + 1*nrc_y*64, 64);
            _tile_loadd(5, wq[2], 64); _tile_loadd(6, wq[3], 64);
            _tile_dpbsud(0, 7, 5); _tile_dpbsud(1, 7, 6);
            _tile_loadd(4, a + 2*nrc_y*64, 64);
            _tile_loadd(5, wq[4], 64); _tile_loadd(6, wq[5], 64);
            _tile_dpbsud(2, 4, 5); _tile_dpbsud(3, 4, 6);
            _tile_loadd(7, a + 3*nrc_y*64, 64);
            _tile_loadd(5, wq[6], 64); _tile_loadd(6, wq[7], 64);
            _tile_dpbsud(2, 7, 5); _tile_dpbsud(3, 7, 6);
            _tile_stored(0, sums[0], 64); _tile_stored(1, sums[1], 64);
            _tile_stored(2, sums[2], 64); _tile_stored(3, sums[3], 64);
            for (int iy = 0; iy < nrc_y; ++iy) {
                auto h0 = _mm512_add_epi32(_mm512_load_si512(sums[0][iy]), _mm512_slli_epi32(_mm512_load_si512(sums[1][iy]), 3));
                auto h1 = _mm512_add_epi32(_mm512_load_si512(sums[2][iy]), _mm512_slli_epi32(_mm512_load_si512(sums[3][iy]), 3));
                // per group: lanes 0-3 its rows' first halves, 4-7 their second (the kernel's isum)
                auto i0 = _mm512_castsi512_si256(_mm512_permutex2var_epi32(h0, _mm512_set_epi32(0,0,0,0,0,0,0,0, 19,18,17,16, 3,2,1,0), h1));
                auto i1 = _mm512_castsi512_si256(_mm512_permutex2var_epi32(h0, _mm512_set_epi32(0,0,0,0,0,0,0,0, 23,22,21,20, 7,6,5,4), h1));
                auto i2 = _mm512_castsi512_si256(_mm512_permutex2var_epi32(h0, _mm512_set_epi32(0,0,0,0,0,0,0,0, 27,26,25,24, 11,10,9,8), h1));
                auto i3 = _mm512_castsi512_si256(_mm512_permutex2var_epi32(h0, _mm512_set_epi32(0,0,0,0,0,0,0,0, 31,30,29,28, 15,14,13,12), h1));
                auto dy = _mm256_set1_ps(q8.scale(iy, ibl));
                acc[0][iy] = _mm256_fmadd_ps(_mm256_mul_ps(d4[0], dy), _mm256_cvtepi32_ps(i0), acc[0][iy]);
                acc[1][iy] = _mm256_fmadd_ps(_mm256_mul_ps(d4[1], dy), _mm256_cvtepi32_ps(i1), acc[1][iy]);
                acc[2][iy] = _mm256_fmadd_ps(_mm256_mul_ps(d4[2], dy), _mm256_cvtepi32_ps(i2), acc[2][iy]);
                acc[3][iy] = _mm256_fmadd_ps(_mm256_mul_ps(d4[3], dy), _mm256_cvtepi32_ps(i3), acc[3][iy]);
            }
        }
        for (int G = 0; G < 4; ++G) for (int iy = 0; iy < nrc_y; ++iy) {
            auto sum = _mm_add_ps(_mm256_castps256_ps128(acc[G][iy]), _mm256_extractf128_ps(acc[G][iy], 1));
            info.store(ix + 4*G, iy, sum);
        }
    }
    _tile_release();
}


// The Q4_K_R4 kernel for 16 activation rows at a time (ik's `func16`: prompt chunks, blocks
// of 16 and more). Calls of 8 rows and fewer keep the kernel above: with their weights read
// from memory once per call (rounds of a few requests), the tile kernel measured no faster
// in the library, though faster on weights in cache.
inline void use_q4_k_r4(std::array<mul_mat_t, IQK_MAX_NY>& kernels, mul_mat_t& func16) {
    (void)kernels;
    if (enabled()) func16 = mul_mat_q4_k_r4_q8_k_amx<16>;
}

}  // namespace adaspec_amx
#endif
