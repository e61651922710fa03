// adaspec (k-quant-amx-2): the repacked Q6_K kernel on AMX tiles, for calls of 32 activation
// rows and more on a CPU with AMX (adaspec's `backends/ik/patches/amx.py`; after the Q6_K
// kernel it calls for the rows it leaves, and after `ik_amx.cpp`, whose activation order,
// tile setup and float lanes it shares).
//
#ifdef ADASPEC_AMX_Q4K
namespace adaspec_amx {

// The Q6_K kernel above sums, per weight row and super-block, in two integers: for each parity
// of its 16-quant sub-blocks, scale x (quants . activation quants), plus -32 x scale x the
// activations' block sums of one half of the super-block; then one float multiply-add. Here
// the tiles compute the first part: a scale (int8) is cut into four 2-bit pieces, the top one
// signed, so that a quant (0..63) x piece fits a byte, and four tile products are summed with
// shifts. The second part is the kernel's own vector code, lane for lane.
struct Prepared6 {  // one super-block of 16 weight rows
    int8_t wq[2][2][4][16*64];  // [parity][run][piece]: quants x scale piece, tile rows (the
                                 // first three pieces unsigned, the top one signed)
    __m512 d[2];                 // groups (0, 1) and (2, 3): the scales d, 8 lanes a group
    __m512i s[2][4];             // -32 x the scales, for the block sums (the kernel's s1..s4)
};

inline void prepare6(const block_q6_k_r4 * const w[4], int ibl, Prepared6& p) {
    auto m4 = _mm256_set1_epi8(0xf);
    auto m3 = _mm256_set1_epi8(0x30);
    static const uint8_t k_shuff[32] = {0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15, 0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15};
    auto shuff = _mm256_loadu_si256((const __m256i *)k_shuff);
    auto rep = _mm512_set1_epi32(0x01010101);
    __m256 d4[4];
    for (int G = 0; G < 4; ++G) {
        auto dl = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)w[G][ibl].d));
        d4[G] = _mm256_set_m128(dl, dl);
    }
    for (int P = 0; P < 2; ++P) p.d[P] = _mm512_insertf32x8(_mm512_castps256_ps512(d4[2*P]), d4[2*P + 1], 1);
    __m256i s[4][4];  // as the kernel above: [G][k], k = blocks (0, 1, 8, 9), (2, 3, 10, 11), ...
    for (int G = 0; G < 4; ++G) {
        const block_q6_k_r4 * iq6 = w[G];
        auto t1 = _mm256_shuffle_epi8(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)iq6[ibl].scales+0)), shuff);
        auto t2 = _mm256_shuffle_epi8(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)iq6[ibl].scales+1)), shuff);
        auto t3 = _mm256_shuffle_epi8(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)iq6[ibl].scales+2)), shuff);
        auto t4 = _mm256_shuffle_epi8(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)iq6[ibl].scales+3)), shuff);
        s[G][0] = MM256_SET_M128I(_mm256_extracti128_si256(t3, 0), _mm256_extracti128_si256(t1, 0));
        s[G][1] = MM256_SET_M128I(_mm256_extracti128_si256(t3, 1), _mm256_extracti128_si256(t1, 1));
        s[G][2] = MM256_SET_M128I(_mm256_extracti128_si256(t4, 0), _mm256_extracti128_si256(t2, 0));
        s[G][3] = MM256_SET_M128I(_mm256_extracti128_si256(t4, 1), _mm256_extracti128_si256(t2, 1));
        for (int k = 0; k < 4; ++k) s[G][k] = _mm256_mullo_epi16(s[G][k], _mm256_set1_epi16(-32));
    }
    for (int P = 0; P < 2; ++P) for (int k = 0; k < 4; ++k) {
        p.s[P][k] = _mm512_inserti64x4(_mm512_castsi256_si512(s[2*P][k]), s[2*P + 1][k], 1);
    }
    for (int ib = 0; ib < QK_K/32; ++ib) {
        // the scales of sub-blocks 2ib + parity, for the 16 rows (dword n: row n)
        __m512i sc[2];
        for (int par = 0; par < 2; ++par) {
            uint32_t s4[4];
            for (int G = 0; G < 4; ++G) std::memcpy(&s4[G], w[G][ibl].scales + 8*ib + 4*par, 4);
            sc[par] = _mm512_cvtepi8_epi32(_mm_set_epi32(s4[3], s4[2], s4[1], s4[0]));
        }
        __m256i qx[4][4];  // [G][t], as the kernel above builds them
        for (int G = 0; G < 4; ++G) {
            const block_q6_k_r4 * iq6 = w[G];
            auto lbits1 = _mm256_loadu_si256((const __m256i *)iq6[ibl].ql+2*ib+0);
            auto lbits2 = _mm256_loadu_si256((const __m256i *)iq6[ibl].ql+2*ib+1);
            auto hbits  = _mm256_loadu_si256((const __m256i *)iq6[ibl].qh+ib);
            qx[G][0] = _mm256_or_si256(_mm256_and_si256(lbits1, m4), _mm256_and_si256(m3, _mm256_slli_epi16(hbits, 4)));
            qx[G][1] = _mm256_or_si256(_mm256_and_si256(lbits2, m4), _mm256_and_si256(m3, hbits));
            qx[G][2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lbits1, 4), m4), _mm256_and_si256(m3, _mm256_slli_epi16(hbits, 2)));
            qx[G][3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lbits2, 4), m4), _mm256_and_si256(m3, _mm256_srli_epi16(hbits, 2)));
        }
        const int run = ib / 4, kk0 = 4*(ib % 4);
        for (int par = 0; par < 2; ++par) {
            // the pieces' bits, one mask bit per byte of the row's dword
            __m512i rs = _mm512_mullo_epi32(_mm512_and_si512(sc[par], _mm512_set1_epi32(0xff)), rep);
            __mmask64 bit[8];
            for (int b = 0; b < 8; ++b) bit[b] = _mm512_test_epi8_mask(rs, _mm512_set1_epi8(char(1 << b)));
            for (int t = 0; t < 4; ++t) {
                __m512i q;  // tile row kk0 + t: for each row n, its 4 quants of sub-block 2ib + par
                if (par == 0) {
                    q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_permute2x128_si256(qx[0][t], qx[1][t], 0x20)),
                                           _mm256_permute2x128_si256(qx[2][t], qx[3][t], 0x20), 1);
                } else {
                    q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_permute2x128_si256(qx[0][t], qx[1][t], 0x31)),
                                           _mm256_permute2x128_si256(qx[2][t], qx[3][t], 0x31), 1);
                }
                auto q2 = _mm512_add_epi8(q, q);
                for (int piece = 0; piece < 4; ++piece) {
                    auto r = _mm512_maskz_mov_epi8(bit[2*piece], q);
                    r = piece < 3 ? _mm512_mask_add_epi8(r, bit[2*piece + 1], r, q2)
                                  : _mm512_mask_sub_epi8(r, bit[2*piece + 1], r, q2);
                    _mm512_store_si512((void *)(p.wq[par][run][piece] + 64*(kk0 + t)), r);
                }
            }
        }
    }
}

constexpr int kChunk6 = 16;  // weight rows prepared at a time (16 KiB a super-block)

// The product of a call's weight rows with the activation rows `order` took. Calls of 16 rows
// (a block of 16 tokens, a round of 8 x 2) keep the kernel above: preparing the weights for
// one block of 16 rows measured slower than its dot products there.
static void mul_mat_q6_k_r4_q8_k_amx(int n, const void * vx, size_t bx, const DataInfo& info, int nrc_x) {
    Ordered& o = ordered();
    GGML_ASSERT(nrc_x%4 == 0 && o.n == n && o.first == info.src1_row(0));
    const int nrc_y = o.rows;
    // rows beyond whole tiles of 16 (or every row): the kernel above
    const int tiled = nrc_y < 32 ? 0 : nrc_x - nrc_x%16;
    pinned_rest(mul_mat_q6_k_r4_q8_k<16>, n, vx, bx, info, tiled, nrc_x, nrc_y);
    if (!tiled) return;
    const int nbl = n / QK_K;
    const int blocks = nrc_y / 16;
    static thread_local std::vector<Prepared6> prepared;
    prepared.resize(size_t(nbl));
    const int8_t * quants = o.quants.data();
    alignas(64) int32_t sums[2][2][4][16][16];  // [buffer][parity][piece][row][weight row]
    __m512 acc[16][2];
    configure();
    for (int x0 = 0; x0 < tiled; x0 += kChunk6) {
        const block_q6_k_r4 * w[4];
        for (int G = 0; G < 4; ++G) w[G] = (const block_q6_k_r4 *)((const char *)vx + (x0 + 4*G)*bx);
        for (int ibl = 0; ibl < nbl; ++ibl) prepare6(w, ibl, prepared[ibl]);
        for (int b = 0; b < blocks; ++b) {
            const int8_t * ab = quants + size_t(b)*nbl*4*16*64;
            const block_q8_K * y[16];
            for (int iy = 0; iy < 16; ++iy) y[iy] = (const block_q8_K *)info.src1_row(16*b + iy);
            for (int iy = 0; iy < 16; ++iy) acc[iy][0] = acc[iy][1] = _mm512_setzero_ps();
            // runs of the activations: (parity h, sub-blocks 8g .. 8g+7 of that parity) at 2h+g
            auto tiles = [&](int ibl, int32_t (*out)[4][16][16]) {
                const Prepared6& p = prepared[ibl];
                const int8_t * a = ab + size_t(ibl)*4*16*64;
                for (int par = 0; par < 2; ++par) {
                    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                    _tile_loadd(4, a + (2*par + 0)*16*64, 64);
                    _tile_loadd(5, p.wq[par][0][0], 64); _tile_loadd(6, p.wq[par][0][1], 64);
                    _tile_dpbsud(0, 4, 5); _tile_dpbsud(1, 4, 6);
                    _tile_loadd(5, p.wq[par][0][2], 64); _tile_loadd(6, p.wq[par][0][3], 64);
                    _tile_dpbsud(2, 4, 5); _tile_dpbssd(3, 4, 6);
                    _tile_loadd(7, a + (2*par + 1)*16*64, 64);
                    _tile_loadd(5, p.wq[par][1][0], 64); _tile_loadd(6, p.wq[par][1][1], 64);
                    _tile_dpbsud(0, 7, 5); _tile_dpbsud(1, 7, 6);
                    _tile_loadd(5, p.wq[par][1][2], 64); _tile_loadd(6, p.wq[par][1][3], 64);
                    _tile_dpbsud(2, 7, 5); _tile_dpbssd(3, 7, 6);
                    _tile_stored(0, out[par][0], 64); _tile_stored(1, out[par][1], 64);
                    _tile_stored(2, out[par][2], 64); _tile_stored(3, out[par][3], 64);
                }
            };
            auto finish = [&](int ibl, int32_t (*in)[4][16][16]) {
                const Prepared6& p = prepared[ibl];
                for (int iy = 0; iy < 16; ++iy) {
                    __m512i h[2];
                    for (int par = 0; par < 2; ++par) {
                        auto s = _mm512_add_epi32(_mm512_load_si512(in[par][0][iy]), _mm512_slli_epi32(_mm512_load_si512(in[par][1][iy]), 2));
                        s = _mm512_add_epi32(s, _mm512_slli_epi32(_mm512_load_si512(in[par][2][iy]), 4));
                        h[par] = _mm512_add_epi32(s, _mm512_slli_epi32(_mm512_load_si512(in[par][3][iy]), 6));
                    }
                    auto dy = _mm512_set1_ps(y[iy][ibl].d);
                    auto bs = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)y[iy][ibl].bsums));
                    auto b0 = _mm512_shuffle_epi32(bs, _MM_PERM_AAAA), b1 = _mm512_shuffle_epi32(bs, _MM_PERM_BBBB);
                    auto b2 = _mm512_shuffle_epi32(bs, _MM_PERM_CCCC), b3 = _mm512_shuffle_epi32(bs, _MM_PERM_DDDD);
                    for (int P = 0; P < 2; ++P) {
                        auto m = _mm512_dpwssd_epi32(_mm512_setzero_si512(), p.s[P][0], b0);
                        m = _mm512_dpwssd_epi32(m, p.s[P][1], b1);
                        m = _mm512_dpwssd_epi32(m, p.s[P][2], b2);
                        m = _mm512_dpwssd_epi32(m, p.s[P][3], b3);
                        auto i = _mm512_add_epi32(lanes(h[0], h[1], P), m);
                        acc[iy][P] = _mm512_fmadd_ps(_mm512_mul_ps(p.d[P], dy), _mm512_cvtepi32_ps(i), acc[iy][P]);
                    }
                }
            };
            tiles(0, sums[0]);
            for (int ibl = 0; ibl < nbl; ++ibl) {
                if (ibl + 1 < nbl) tiles(ibl + 1, sums[(ibl + 1) & 1]);
                finish(ibl, sums[ibl & 1]);
            }
            store_block(info, 16*b, x0, acc);
        }
    }
    _tile_release();
}


// ik's driver: calls of 16 activation rows and more take the kernels above, every 16 rows
// at once (`adaspec_amx_rows`, `adaspec_amx_order` at the end of this file, called from
// iqk_mul_mat.cpp)
inline mul_mat_t rows_kernel(int typeA) {
    if (!enabled()) return nullptr;
    if (typeA == GGML_TYPE_Q4_K_R4) return mul_mat_q4_k_r4_q8_k_amx;
    if (typeA == GGML_TYPE_Q6_K_R4) return mul_mat_q6_k_r4_q8_k_amx;
    return nullptr;
}

}  // namespace adaspec_amx
#endif
