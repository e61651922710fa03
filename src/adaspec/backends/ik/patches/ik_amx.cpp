// adaspec (k-quant-amx-2): the repacked Q4_K kernel on AMX tiles, for calls of 16 activation
// rows and more on a CPU with AMX (adaspec's `backends/ik/patches/amx.py`).
//
// The kernel above this one sums, per weight row, per super-block and per half of each
// 32-quant sub-block, scale x (weight quants . activation quants), and turns those integers
// into floats with its own operations. Integers are exact whatever computes them, so here
// the tiles compute them and the kernel's float code runs unchanged, in its order: every
// output is bit for bit the kernel's. A weight quant (0..15) times the low 3 bits, and times
// the high 3 bits, of its 6-bit scale each fit a byte, so two tile products (the second
// counted 8 times) give the scaled sums of a whole super-block; the activation quants are
// ordered so that one run of 64 holds one half of 4 sub-blocks, which keeps the halves apart.
//
// A call takes all its activation rows at once (ik's driver would call a 16-row kernel for
// each 16 rows of each 64 weight rows, preparing the same weights again each time): the
// activations are ordered once (`order`, kept per thread for the gate and up products that
// share them), each 64 weight rows prepared once, then multiplied by every 16 rows.
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
// 4 and 7: activation quants (16 rows x 64 bytes), 5 and 6: weights (16 rows of 4 quants of
// each of 16 weight rows), times the low and the high scale bits
inline void configure() {
    TileConfig c;
    for (int t = 0; t < 8; ++t) { c.rows[t] = 16; c.colsb[t] = 64; }
    _tile_loadconfig(&c);
}

struct Prepared {  // one super-block of 16 weight rows
    uint8_t wq[8][16*64];   // [2*run + p]: weights x scale bits, tile rows
    __m512 d[2];            // groups (0, 1) and (2, 3): the scales d, 8 lanes a group
    __m512 c[2][4];         // the mins' coefficients, (m4 x mins) of the kernel above
};

inline void prepare(const block_q4_k_r4 * const w[4], int ibl, Prepared& p) {
    auto mf = _mm256_set1_epi8(0xf);
    auto m3 = _mm256_set1_epi8(0x30);
    auto m4b = _mm512_set1_epi8(0xf);
    auto m7 = _mm512_set1_epi32(7);
    union { __m256i vec; uint32_t val[8]; } hd[4];
    __m256 d4[4], c[4][4];
    for (int G = 0; G < 4; ++G) {
        const block_q4_k_r4 * iq4 = w[G];
        auto dl = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)iq4[ibl].d));
        d4[G] = _mm256_set_m128(_mm256_castps256_ps128(dl), _mm256_castps256_ps128(dl));
        auto m4 = _mm256_mul_ps(_mm256_set1_ps(-1.0f), _mm256_set_m128(_mm256_extractf128_ps(dl, 1), _mm256_extractf128_ps(dl, 1)));
        auto lbits = _mm256_loadu_si256((const __m256i *)iq4[ibl].scales_l);
        auto hbits128 = _mm_loadu_si128((const __m128i *)iq4[ibl].scales_h);
        auto hbits = MM256_SET_M128I(hbits128, _mm_slli_epi16(hbits128, 4));
        hd[G].vec = _mm256_or_si256(_mm256_and_si256(lbits, mf), _mm256_and_si256(hbits, m3));
        auto mins = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lbits, 4), mf), _mm256_and_si256(_mm256_srli_epi16(hbits, 2), m3));
        // as process_min_r4_b32 for several rows
        auto mins_l = _mm256_castsi256_si128(mins);
        auto mins_h = _mm256_extracti128_si256(mins, 1);
        auto aux1   = _mm_unpacklo_epi32(mins_l, mins_h);
        auto aux2   = _mm_unpackhi_epi32(mins_l, mins_h);
        c[G][0] = _mm256_mul_ps(m4, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(aux1)));
        c[G][1] = _mm256_mul_ps(m4, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_shuffle_epi32(aux1, 0xee))));
        c[G][2] = _mm256_mul_ps(m4, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(aux2)));
        c[G][3] = _mm256_mul_ps(m4, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_shuffle_epi32(aux2, 0xee))));
    }
    for (int P = 0; P < 2; ++P) {
        p.d[P] = _mm512_insertf32x8(_mm512_castps256_ps512(d4[2*P]), d4[2*P + 1], 1);
        for (int k = 0; k < 4; ++k) p.c[P][k] = _mm512_insertf32x8(_mm512_castps256_ps512(c[2*P][k]), c[2*P + 1][k], 1);
    }
    // row r of run (h, g) holds, for each of the 16 weight rows, quants 16h + 4(r%4) .. +3
    // of sub-block 4g + r/4, times the scale's low 3 bits (and in the next tile its high 3)
    for (int j = 0; j < 8; ++j) {
        auto s = _mm512_cvtepu8_epi32(_mm_set_epi32(hd[3].val[j], hd[2].val[j], hd[1].val[j], hd[0].val[j]));
        auto slo = _mm512_and_si512(s, m7), shi = _mm512_srli_epi32(s, 3);
        slo = _mm512_or_si512(slo, _mm512_slli_epi32(slo, 16));
        shi = _mm512_or_si512(shi, _mm512_slli_epi32(shi, 16));
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
            auto lo = _mm512_and_si512(bits, m4b);
            auto hi = _mm512_and_si512(_mm512_srli_epi16(bits, 4), m4b);
            uint8_t * lo_run = p.wq[2*(2*h + g)], * hi_run = p.wq[2*(2*h + g) + 1];
            int r_lo = 4*jr + par, r_hi = 4*jr + par + 2;
            _mm512_store_si512((void *)(lo_run + 64*r_lo), _mm512_mullo_epi16(lo, slo));
            _mm512_store_si512((void *)(hi_run + 64*r_lo), _mm512_mullo_epi16(lo, shi));
            _mm512_store_si512((void *)(lo_run + 64*r_hi), _mm512_mullo_epi16(hi, slo));
            _mm512_store_si512((void *)(hi_run + 64*r_hi), _mm512_mullo_epi16(hi, shi));
        }
    }
}

// The activation quants of rows y0 .. y0+15, each super-block as 4 runs of 64: (half h,
// sub-blocks 4g..4g+3) at run 2h+g, so that a run holds one half of each of its sub-blocks.
inline void order_block(const DataInfo& info, int y0, int nbl, int8_t * out) {
    for (int ibl = 0; ibl < nbl; ++ibl) {
        for (int iy = 0; iy < 16; ++iy) {
            const int8_t * qs = ((const block_q8_K *)info.src1_row(y0 + iy))[ibl].qs;
            for (int h = 0; h < 2; ++h) for (int g = 0; g < 2; ++g) {
                int8_t * dst = out + ((ibl*4 + 2*h + g)*16 + iy)*64;
                for (int j = 0; j < 4; ++j) {
                    _mm_storeu_si128((__m128i *)(dst + 16*j), _mm_loadu_si128((const __m128i *)(qs + 32*(4*g + j) + 16*h)));
                }
            }
        }
    }
}

// A call's activation rows, ordered for the tiles once per call and thread (the gate and up
// products of a fused FFN share them).
struct Ordered {
    std::vector<int8_t> quants;  // [16-row block][super-block][run][row][64]
    const char * first = nullptr;  // the first row's quants, as ordered (a check)
    int n = 0, rows = 0;
};

inline Ordered& ordered() {
    static thread_local Ordered o;
    return o;
}

inline void order(const DataInfo& info, int n, int nrc_y) {
    GGML_ASSERT(nrc_y%16 == 0 && n%QK_K == 0);
    Ordered& o = ordered();
    const int nbl = n / QK_K;
    o.quants.resize(size_t(nrc_y)*nbl*QK_K);
    for (int b = 0; b < nrc_y/16; ++b) order_block(info, 16*b, nbl, o.quants.data() + size_t(b)*nbl*4*16*64);
    o.first = info.src1_row(0);
    o.n = n;
    o.rows = nrc_y;
}

constexpr int kChunk = 64;  // weight rows prepared at a time (4 tiles of 16)

// What both tile kernels share (the Q6_K one is in ik_amx_q6.cpp).
// Weight rows tiled .. nrc_x (fewer than 16), or every row (tiled = 0): the pinned kernel
// for each 16 activation rows, as ik's driver would call it.
inline void pinned_rest(mul_mat_t pinned16, int n, const void * vx, size_t bx, const DataInfo& info,
                        int tiled, int nrc_x, int nrc_y) {
    for (int y0 = 0; tiled < nrc_x && y0 < nrc_y; y0 += 16) {
        DataInfo rest = info;
        rest.s += tiled;
        rest.cur_y += y0;
        pinned16(n, (const char *)vx + tiled*bx, bx, rest, nrc_x - tiled);
    }
}

// The float code's lanes for groups (2P, 2P + 1) of 4 weight rows: per group, its rows' first
// halves (Q6_K: even sub-blocks) from h0, then their second halves (odd) from h1; h0 and h1
// hold the 16 weight rows' integer sums.
inline __m512i lanes(__m512i h0, __m512i h1, int P) {
    const __m512i pick = P == 0
        ? _mm512_set_epi32(23,22,21,20, 7,6,5,4, 19,18,17,16, 3,2,1,0)
        : _mm512_set_epi32(31,30,29,28, 15,14,13,12, 27,26,25,24, 11,10,9,8);
    return _mm512_permutex2var_epi32(h0, pick, h1);
}

// 16 activation rows (from y0) by 16 weight rows (from x) out: per group of 4, its two
// halves' sums added, as the pinned kernels end
inline void store_block(const DataInfo& info, int y0, int x, const __m512 (&acc)[16][2]) {
    DataInfo out = info;
    out.cur_y += y0;
    for (int iy = 0; iy < 16; ++iy) for (int P = 0; P < 2; ++P) {
        auto lo = _mm512_castps512_ps256(acc[iy][P]), hi = _mm512_extractf32x8_ps(acc[iy][P], 1);
        out.store(x + 8*P, iy, _mm_add_ps(_mm256_castps256_ps128(lo), _mm256_extractf128_ps(lo, 1)));
        out.store(x + 8*P + 4, iy, _mm_add_ps(_mm256_castps256_ps128(hi), _mm256_extractf128_ps(hi, 1)));
    }
}

// The product of a call's weight rows with the activation rows `order` took (its signature is
// ik's kernels': the rows' count is the order's).
static void mul_mat_q4_k_r4_q8_k_amx(int n, const void * vx, size_t bx, const DataInfo& info, int nrc_x) {
    Ordered& o = ordered();
    GGML_ASSERT(nrc_x%4 == 0 && o.n == n && o.first == info.src1_row(0));
    const int nrc_y = o.rows;
    const int tiled = nrc_x - nrc_x%16;  // rows beyond whole tiles of 16: the kernel above
    pinned_rest(mul_mat_q4_k_r4_q8_k<16>, n, vx, bx, info, tiled, nrc_x, nrc_y);
    if (!tiled) return;
    const int nbl = n / QK_K;
    const int blocks = nrc_y / 16;
    static thread_local std::vector<Prepared> prepared;
    prepared.resize(size_t(kChunk/16)*nbl);
    const int8_t * quants = o.quants.data();
    alignas(64) int32_t sums[2][4][16][16];
    __m512 acc[16][2];
    configure();
    for (int x0 = 0; x0 < tiled; x0 += kChunk) {
        const int wblocks = std::min(kChunk, tiled - x0)/16;
        for (int wb = 0; wb < wblocks; ++wb) {
            const block_q4_k_r4 * w[4];
            for (int G = 0; G < 4; ++G) w[G] = (const block_q4_k_r4 *)((const char *)vx + (x0 + 16*wb + 4*G)*bx);
            for (int ibl = 0; ibl < nbl; ++ibl) prepare(w, ibl, prepared[wb*nbl + ibl]);
        }
        for (int b = 0; b < blocks; ++b) {
            const int8_t * ab = quants + size_t(b)*nbl*4*16*64;
            const block_q8_K * y[16];
            for (int iy = 0; iy < 16; ++iy) y[iy] = (const block_q8_K *)info.src1_row(16*b + iy);
            for (int wb = 0; wb < wblocks; ++wb) {
                for (int iy = 0; iy < 16; ++iy) acc[iy][0] = acc[iy][1] = _mm512_setzero_ps();
                // super-block ibl's tiles: the two halves on tiles of their own (0, 1, 4, 5
                // and 2, 3, 7, 6), so neither waits on the other's registers
                auto tiles = [&](int ibl, int32_t (*out)[16][16]) {
                    const Prepared& p = prepared[wb*nbl + ibl];
                    const int8_t * a = ab + size_t(ibl)*4*16*64;
                    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                    _tile_loadd(4, a + 0*16*64, 64); _tile_loadd(7, a + 2*16*64, 64);
                    _tile_loadd(5, p.wq[0], 64); _tile_loadd(6, p.wq[4], 64);
                    _tile_dpbsud(0, 4, 5); _tile_dpbsud(2, 7, 6);
                    _tile_loadd(5, p.wq[1], 64); _tile_loadd(6, p.wq[5], 64);
                    _tile_dpbsud(1, 4, 5); _tile_dpbsud(3, 7, 6);
                    _tile_loadd(4, a + 1*16*64, 64); _tile_loadd(7, a + 3*16*64, 64);
                    _tile_loadd(5, p.wq[2], 64); _tile_loadd(6, p.wq[6], 64);
                    _tile_dpbsud(0, 4, 5); _tile_dpbsud(2, 7, 6);
                    _tile_loadd(5, p.wq[3], 64); _tile_loadd(6, p.wq[7], 64);
                    _tile_dpbsud(1, 4, 5); _tile_dpbsud(3, 7, 6);
                    _tile_stored(0, out[0], 64); _tile_stored(1, out[1], 64);
                    _tile_stored(2, out[2], 64); _tile_stored(3, out[3], 64);
                };
                // its float code, as the kernel above: the mins, then the scaled sums
                auto finish = [&](int ibl, int32_t (*in)[16][16]) {
                    const Prepared& p = prepared[wb*nbl + ibl];
                    for (int iy = 0; iy < 16; ++iy) {
                        auto bs = _mm512_broadcast_f32x8(_mm256_loadu_ps((const float *)y[iy][ibl].bsums));
                        auto b0 = _mm512_shuffle_ps(bs, bs, 0x00), b1 = _mm512_shuffle_ps(bs, bs, 0x55);
                        auto b2 = _mm512_shuffle_ps(bs, bs, 0xaa), b3 = _mm512_shuffle_ps(bs, bs, 0xff);
                        auto h0 = _mm512_add_epi32(_mm512_load_si512(in[0][iy]), _mm512_slli_epi32(_mm512_load_si512(in[1][iy]), 3));
                        auto h1 = _mm512_add_epi32(_mm512_load_si512(in[2][iy]), _mm512_slli_epi32(_mm512_load_si512(in[3][iy]), 3));
                        auto dy = _mm512_set1_ps(y[iy][ibl].d);
                        for (int P = 0; P < 2; ++P) {
                            auto s = _mm512_fmadd_ps(p.c[P][0], b0, acc[iy][P]);
                            s = _mm512_fmadd_ps(p.c[P][1], b1, s);
                            s = _mm512_fmadd_ps(p.c[P][2], b2, s);
                            s = _mm512_fmadd_ps(p.c[P][3], b3, s);
                            auto i = lanes(h0, h1, P);
                            acc[iy][P] = _mm512_fmadd_ps(_mm512_mul_ps(p.d[P], dy), _mm512_cvtepi32_ps(i), s);
                        }
                    }
                };
                // the tiles of the next super-block run while the float code of this one does
                tiles(0, sums[0]);
                for (int ibl = 0; ibl < nbl; ++ibl) {
                    if (ibl + 1 < nbl) tiles(ibl + 1, sums[(ibl + 1) & 1]);
                    finish(ibl, sums[ibl & 1]);
                }
                store_block(info, 16*b, x0 + 16*wb, acc);
            }
        }
    }
    _tile_release();
}

}  // namespace adaspec_amx
#endif
