// adaspec (k-quant-wide-3): the repacked Q4_K and Q6_K kernels walk 8 weight rows at a time in
// 512-bit registers (two groups of 4, one per half) on a CPU with AVX-512, for calls of up to
// 8 activation rows (a lone token, a round of requests, a draft block). Each shuffled
// activation feeds both groups and each instruction does two groups' work. Every lane does
// the integer and float operations of the kernel below for its group, in the same order:
// the results are bit for bit the kernel's (adaspec's `backends/ik/patches/wide.py`). It
// fetches ahead in its own walk's order (the kernel's prefetch, two blocks ahead in a group
// of 4, would miss the second group's first blocks), for a lone row too: on a 2-vCPU Xeon a
// lone row's walk without it streamed slower than a walk of two rows. Returns the rows it
// left to the kernel (a last group of 4); without AVX-512, for more rows, or for more rows
// than `adaspec_wide_rows` (0 where the CPU walks 512 bits slower, set at load), the walk
// before it.
#ifdef HAVE_FANCY_SIMD
// the block ADASPEC_WIDE_AHEAD steps ahead of block ibl of a group, in the walk's order:
// further in the group, else in the same group of the next 8 rows (`next`)
#ifndef ADASPEC_WIDE_AHEAD
#define ADASPEC_WIDE_AHEAD 2
#endif
template <typename Block>
static inline void adaspec_wide_prefetch(const Block * group, const void * vx, size_t bx, int next, int ibl, int nbl) {
    const Block * ahead = ibl + ADASPEC_WIDE_AHEAD < nbl ? group + ibl + ADASPEC_WIDE_AHEAD
        : (const Block *)((const char *)vx + next*bx) + (ibl + ADASPEC_WIDE_AHEAD - nbl);
    for (int k = 0; k < (int)sizeof(Block); k += 64) _mm_prefetch((const char *)ahead + k, _MM_HINT_T0);
}

// group 0's 32 bytes at p0 and group 1's at p1, in one register
static inline __m512i adaspec_wide_pair(const void * p0, const void * p1) {
    return _mm512_inserti32x8(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p0)),
                              _mm256_loadu_si256((const __m256i *)p1), 1);
}

// sub-block ib of super-block ibl: each row's 4 quant runs times both groups' weights,
// scaled, added to its integer sums (the kernels' VNNI inner loop, two groups at once)
template <int nrc_y>
static inline void adaspec_wide_dots(const Q8<nrc_y, block_q8_K>& q8, int ibl, int ib, const __m512i (&qx)[4],
                                     __m512i scales, __m512i * isum) {
    for (int iy = 0; iy < nrc_y; ++iy) {
        auto y = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)q8.y[iy][ibl].qs+ib));
        auto s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), qx[0], _mm512_shuffle_epi32(y, _MM_PERM_AAAA));
        s = _mm512_dpbusd_epi32(s, qx[1], _mm512_shuffle_epi32(y, _MM_PERM_BBBB));
        s = _mm512_dpbusd_epi32(s, qx[2], _mm512_shuffle_epi32(y, _MM_PERM_CCCC));
        s = _mm512_dpbusd_epi32(s, qx[3], _mm512_shuffle_epi32(y, _MM_PERM_DDDD));
        isum[iy] = _mm512_add_epi32(isum[iy], _mm512_mullo_epi32(scales, s));
    }
}

// weight rows ix .. ix+7 out: per group, its two halves' sums added, as the kernels end
template <int nrc_y>
static inline void adaspec_wide_store(const DataInfo& info, int ix, __m512 * acc) {
    for (int iy = 0; iy < nrc_y; ++iy) {
        auto lo = _mm512_castps512_ps256(acc[iy]), hi = _mm512_extractf32x8_ps(acc[iy], 1);
        info.store(ix+0, iy, _mm_add_ps(_mm256_castps256_ps128(lo), _mm256_extractf128_ps(lo, 1)));
        info.store(ix+4, iy, _mm_add_ps(_mm256_castps256_ps128(hi), _mm256_extractf128_ps(hi, 1)));
        acc[iy] = _mm512_setzero_ps();
    }
}

template <int nrc_y>
static int adaspec_q4_k_r4_zmm(int n, const void * vx, size_t bx, const DataInfo& info, int nrc_x) {
    GGML_ASSERT(nrc_x%4 == 0);
    Q8<nrc_y, block_q8_K> q8(info);
    auto mf = _mm256_set1_epi8(0xf);
    auto m3 = _mm256_set1_epi8(0x30);
    auto mf5 = _mm512_set1_epi8(0xf);
    int nbl = n / QK_K;
    union { __m256i vec; uint32_t val[8]; } hd[2];
    __m512  acc[nrc_y];
    __m512i isum[nrc_y];
    for (int iy = 0; iy < nrc_y; ++iy) { acc[iy] = _mm512_setzero_ps(); isum[iy] = _mm512_setzero_si512(); }
    const int nrc_x8 = nrc_x - nrc_x % 8;
    for (int ix = 0; ix < nrc_x8; ix += 8) {
        const block_q4_k_r4 * iqg[2] = {(const block_q4_k_r4 *)((const char *)vx + (ix+0)*bx),
                                        (const block_q4_k_r4 *)((const char *)vx + (ix+4)*bx)};
        for (int ibl = 0; ibl < nbl; ++ibl) {
            __m256 d4g[2], m4g[2];
            __m256i minsg[2];
            for (int g = 0; g < 2; ++g) {
                adaspec_wide_prefetch(iqg[g], vx, bx, ix + 8 + 4*g, ibl, nbl);
                auto dl = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)iqg[g][ibl].d));
                d4g[g] = _mm256_set_m128(_mm256_castps256_ps128(dl), _mm256_castps256_ps128(dl));
                m4g[g] = _mm256_mul_ps(_mm256_set1_ps(-1.0f), _mm256_set_m128(_mm256_extractf128_ps(dl, 1), _mm256_extractf128_ps(dl, 1)));
                auto lbits = _mm256_loadu_si256((const __m256i *)iqg[g][ibl].scales_l);
                auto hbits128 = _mm_loadu_si128((const __m128i *)iqg[g][ibl].scales_h);
                auto hbits = MM256_SET_M128I(hbits128, _mm_slli_epi16(hbits128, 4));
                hd[g].vec = _mm256_or_si256(_mm256_and_si256(lbits, mf), _mm256_and_si256(hbits, m3));
                minsg[g] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lbits, 4), mf), _mm256_and_si256(_mm256_srli_epi16(hbits, 2), m3));
            }
            auto d4 = _mm512_insertf32x8(_mm512_castps256_ps512(d4g[0]), d4g[1], 1);
            {   // process_min_r4_b32, both groups
                __m512 c[4];
                for (int g = 0; g < 2; ++g) {
                    auto mins_l = _mm256_castsi256_si128(minsg[g]);
                    auto mins_h = _mm256_extracti128_si256(minsg[g], 1);
                    auto aux1   = _mm_unpacklo_epi32(mins_l, mins_h);
                    auto aux2   = _mm_unpackhi_epi32(mins_l, mins_h);
                    __m256 cg[4];
                    cg[0] = _mm256_mul_ps(m4g[g], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(aux1)));
                    cg[1] = _mm256_mul_ps(m4g[g], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_shuffle_epi32(aux1, 0xee))));
                    cg[2] = _mm256_mul_ps(m4g[g], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(aux2)));
                    cg[3] = _mm256_mul_ps(m4g[g], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_shuffle_epi32(aux2, 0xee))));
                    for (int k = 0; k < 4; ++k) {
                        c[k] = g == 0 ? _mm512_castps256_ps512(cg[k]) : _mm512_insertf32x8(c[k], cg[k], 1);
                    }
                }
                for (int iy = 0; iy < nrc_y; ++iy) {
                    auto bs = _mm512_broadcast_f32x8(_mm256_loadu_ps((const float *)q8.y[iy][ibl].bsums));
                    acc[iy] = _mm512_fmadd_ps(c[0], _mm512_shuffle_ps(bs, bs, 0x00), acc[iy]);
                    acc[iy] = _mm512_fmadd_ps(c[1], _mm512_shuffle_ps(bs, bs, 0x55), acc[iy]);
                    acc[iy] = _mm512_fmadd_ps(c[2], _mm512_shuffle_ps(bs, bs, 0xaa), acc[iy]);
                    acc[iy] = _mm512_fmadd_ps(c[3], _mm512_shuffle_ps(bs, bs, 0xff), acc[iy]);
                }
            }
            for (int ib = 0; ib < QK_K/32; ++ib) {
                auto scales_d = _mm512_inserti32x8(_mm512_castsi256_si512(_mm256_cvtepi8_epi32(_mm_set1_epi32(hd[0].val[ib]))),
                                                   _mm256_cvtepi8_epi32(_mm_set1_epi32(hd[1].val[ib])), 1);
                auto b1 = adaspec_wide_pair(iqg[0][ibl].qs + 64*ib, iqg[1][ibl].qs + 64*ib);
                auto b2 = adaspec_wide_pair(iqg[0][ibl].qs + 64*ib + 32, iqg[1][ibl].qs + 64*ib + 32);
                __m512i qx[4];
                qx[0] = _mm512_and_si512(b1, mf5);
                qx[1] = _mm512_and_si512(b2, mf5);
                qx[2] = _mm512_and_si512(_mm512_srli_epi16(b1, 4), mf5);
                qx[3] = _mm512_and_si512(_mm512_srli_epi16(b2, 4), mf5);
                adaspec_wide_dots<nrc_y>(q8, ibl, ib, qx, scales_d, isum);
            }
            for (int iy = 0; iy < nrc_y; ++iy) {
                acc[iy] = _mm512_fmadd_ps(_mm512_mul_ps(d4, _mm512_set1_ps(q8.scale(iy, ibl))), _mm512_cvtepi32_ps(isum[iy]), acc[iy]);
                isum[iy] = _mm512_setzero_si512();
            }
        }
        adaspec_wide_store<nrc_y>(info, ix, acc);
    }
    return nrc_x8;
}

template <int nrc_y>
static int adaspec_q6_k_r4_zmm(int n, const void * vx, size_t bx, const DataInfo& info, int nrc_x) {
    GGML_ASSERT(nrc_x%4 == 0);
    Q8<nrc_y, block_q8_K> q8(info);
    auto m4 = _mm512_set1_epi8(0xf);
    auto m3 = _mm512_set1_epi8(0x30);
    static const uint8_t k_shuff[32] = {0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15, 0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15};
    auto shuff = _mm256_loadu_si256((const __m256i *)k_shuff);
    int nbl = n / QK_K;
    __m512  acc[nrc_y];
    __m512i isum[nrc_y];
    for (int iy = 0; iy < nrc_y; ++iy) acc[iy] = _mm512_setzero_ps();
    const int nrc_x8 = nrc_x - nrc_x % 8;
    for (int ix = 0; ix < nrc_x8; ix += 8) {
        const block_q6_k_r4 * iqg[2] = {(const block_q6_k_r4 *)((const char *)vx + (ix+0)*bx),
                                        (const block_q6_k_r4 *)((const char *)vx + (ix+4)*bx)};
        for (int ibl = 0; ibl < nbl; ++ibl) {
            __m256 d4g[2];
            __m512i s[4];
            for (int g = 0; g < 2; ++g) {
                adaspec_wide_prefetch(iqg[g], vx, bx, ix + 8 + 4*g, ibl, nbl);
                const block_q6_k_r4 * iq6 = iqg[g];
                auto dl = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)iq6[ibl].d));
                d4g[g] = _mm256_set_m128(dl, dl);
                auto t1 = _mm256_shuffle_epi8(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)iq6[ibl].scales+0)), shuff);
                auto t2 = _mm256_shuffle_epi8(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)iq6[ibl].scales+1)), shuff);
                auto t3 = _mm256_shuffle_epi8(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)iq6[ibl].scales+2)), shuff);
                auto t4 = _mm256_shuffle_epi8(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)iq6[ibl].scales+3)), shuff);
                __m256i sg[4];
                sg[0] = MM256_SET_M128I(_mm256_extracti128_si256(t3, 0), _mm256_extracti128_si256(t1, 0));
                sg[1] = MM256_SET_M128I(_mm256_extracti128_si256(t3, 1), _mm256_extracti128_si256(t1, 1));
                sg[2] = MM256_SET_M128I(_mm256_extracti128_si256(t4, 0), _mm256_extracti128_si256(t2, 0));
                sg[3] = MM256_SET_M128I(_mm256_extracti128_si256(t4, 1), _mm256_extracti128_si256(t2, 1));
                for (int k = 0; k < 4; ++k) {
                    sg[k] = _mm256_mullo_epi16(sg[k], _mm256_set1_epi16(-32));
                    s[k] = g == 0 ? _mm512_castsi256_si512(sg[k]) : _mm512_inserti32x8(s[k], sg[k], 1);
                }
            }
            auto d4 = _mm512_insertf32x8(_mm512_castps256_ps512(d4g[0]), d4g[1], 1);
            for (int iy = 0; iy < nrc_y; ++iy) {
                auto bsums = _mm512_broadcast_i64x4(q8.load_bsums(iy, ibl));
                auto sumi = _mm512_setzero_si512();
                sumi = _mm512_dpwssd_epi32(sumi, s[0], _mm512_shuffle_epi32(bsums, _MM_PERM_AAAA));
                sumi = _mm512_dpwssd_epi32(sumi, s[1], _mm512_shuffle_epi32(bsums, _MM_PERM_BBBB));
                sumi = _mm512_dpwssd_epi32(sumi, s[2], _mm512_shuffle_epi32(bsums, _MM_PERM_CCCC));
                sumi = _mm512_dpwssd_epi32(sumi, s[3], _mm512_shuffle_epi32(bsums, _MM_PERM_DDDD));
                isum[iy] = sumi;
            }
            for (int ib = 0; ib < QK_K/32; ++ib) {
                auto iscales = _mm512_inserti32x8(
                    _mm512_castsi256_si512(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const uint32_t *)iqg[0][ibl].scales + 2*ib)))),
                    _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const uint32_t *)iqg[1][ibl].scales + 2*ib))), 1);
                auto lbits1 = adaspec_wide_pair(iqg[0][ibl].ql + 64*ib, iqg[1][ibl].ql + 64*ib);
                auto lbits2 = adaspec_wide_pair(iqg[0][ibl].ql + 64*ib + 32, iqg[1][ibl].ql + 64*ib + 32);
                auto hbits  = adaspec_wide_pair(iqg[0][ibl].qh + 32*ib, iqg[1][ibl].qh + 32*ib);
                __m512i qx[4];
                qx[0] = _mm512_or_si512(_mm512_and_si512(lbits1, m4), _mm512_and_si512(m3, _mm512_slli_epi16(hbits, 4)));
                qx[1] = _mm512_or_si512(_mm512_and_si512(lbits2, m4), _mm512_and_si512(m3, hbits));
                qx[2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lbits1, 4), m4), _mm512_and_si512(m3, _mm512_slli_epi16(hbits, 2)));
                qx[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lbits2, 4), m4), _mm512_and_si512(m3, _mm512_srli_epi16(hbits, 2)));
                adaspec_wide_dots<nrc_y>(q8, ibl, ib, qx, iscales, isum);
            }
            for (int iy = 0; iy < nrc_y; ++iy) {
                auto d4y = _mm512_mul_ps(d4, _mm512_set1_ps(q8.scale(iy, ibl)));
                acc[iy] = _mm512_fmadd_ps(d4y, _mm512_cvtepi32_ps(isum[iy]), acc[iy]);
            }
        }
        adaspec_wide_store<nrc_y>(info, ix, acc);
    }
    return nrc_x8;
}
#endif

template <int nrc_y>
static int adaspec_q4_k_r4_wide(int n, const void * vx, size_t bx, const DataInfo& info, int nrc_x) {
#ifdef HAVE_FANCY_SIMD
    if constexpr (nrc_y <= 8) {
        if (nrc_y <= adaspec_wide_rows) return adaspec_q4_k_r4_zmm<nrc_y>(n, vx, bx, info, nrc_x);
    }
#endif
    return adaspec_q4_k_r4_two_groups<nrc_y>(n, vx, bx, info, nrc_x);
}

template <int nrc_y>
static int adaspec_q6_k_r4_wide(int n, const void * vx, size_t bx, const DataInfo& info, int nrc_x) {
#ifdef HAVE_FANCY_SIMD
    if constexpr (nrc_y <= 8) {
        if (nrc_y <= adaspec_wide_rows) return adaspec_q6_k_r4_zmm<nrc_y>(n, vx, bx, info, nrc_x);
    }
#endif
    (void)n; (void)vx; (void)bx; (void)info; (void)nrc_x;
    return 0;
}
