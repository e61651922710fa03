// adaspec (k-quant-two-groups): the weights 8 rows at a time (two groups of 4), so each
// shuffled activation feeds two dot products instead of one. Only rows after a call's
// first group of activations: those find the weights in cache (a prompt chunk's).
// The integer sums and the float operations of every row are those of the kernel below,
// in the same order: the results are bit for bit the same (adaspec's
// `backends/ik/patches/two_groups.py`). Returns the rows it left to the kernel (a last
// group of 4).
template <int nrc_y>
static int adaspec_q4_k_r4_two_groups(int n, const void * vx, size_t bx, const DataInfo& info, int nrc_x) {
    if constexpr (nrc_y == 1) {
        return 0;
    } else {
    // the first rows of a call bring the weights in from memory: the kernel's own walk,
    // with its prefetch, is faster there; later rows find them in cache
    if (info.cur_y == 0) return 0;
    Q8<nrc_y, block_q8_K> q8(info);
    auto mf = _mm256_set1_epi8(0xf);
    auto m3 = _mm256_set1_epi8(0x30);
    int nbl = n / QK_K;
    union { __m256i vec; uint32_t val[8]; } hd[2];
    __m256  acc[2][nrc_y] = {};
    __m256i isum[2][nrc_y] = {};
    __m256i qx[2][4];
    const int nrc_x8 = nrc_x - nrc_x % 8;
    for (int ix = 0; ix < nrc_x8; ix += 8) {
        const block_q4_k_r4 * iqg[2] = {(const block_q4_k_r4 *)((const char *)vx + (ix+0)*bx),
                                        (const block_q4_k_r4 *)((const char *)vx + (ix+4)*bx)};
        for (int ibl = 0; ibl < nbl; ++ibl) { // Block of 256
            __m256 d4[2];
            for (int g = 0; g < 2; ++g) {
                adaspec_prefetch_block<nrc_y>(iqg[g] + ibl);
                auto dl = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)iqg[g][ibl].d));
                d4[g] = _mm256_set_m128(_mm256_castps256_ps128(dl), _mm256_castps256_ps128(dl));
                auto m4 = _mm256_mul_ps(_mm256_set1_ps(-1.0f), _mm256_set_m128(_mm256_extractf128_ps(dl, 1), _mm256_extractf128_ps(dl, 1)));
                auto lbits = _mm256_loadu_si256((const __m256i *)iqg[g][ibl].scales_l);
                auto hbits128 = _mm_loadu_si128((const __m128i *)iqg[g][ibl].scales_h);
                auto hbits = MM256_SET_M128I(hbits128, _mm_slli_epi16(hbits128, 4));
                hd[g].vec = _mm256_or_si256(_mm256_and_si256(lbits, mf), _mm256_and_si256(hbits, m3));
                auto mins = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lbits, 4), mf), _mm256_and_si256(_mm256_srli_epi16(hbits, 2), m3));
                process_min_r4_b32(ibl, m4, mins, q8, acc[g]);
            }
            for (int ib = 0; ib < QK_K/32; ++ib) {
                __m256i scales_d[2];
                for (int g = 0; g < 2; ++g) {
#ifdef HAVE_VNNI256
                    scales_d[g] = _mm256_cvtepi8_epi32(_mm_set1_epi32(hd[g].val[ib]));
#else
                    auto aux = _mm_set1_epi32(hd[g].val[ib]);
                    aux = _mm_cvtepu8_epi16(_mm_unpacklo_epi8(aux, aux));
                    scales_d[g] = MM256_SET_M128I(aux, aux);
#endif
                    auto bits1 = _mm256_loadu_si256((const __m256i *)iqg[g][ibl].qs+2*ib+0);
                    auto bits2 = _mm256_loadu_si256((const __m256i *)iqg[g][ibl].qs+2*ib+1);
                    qx[g][0] = _mm256_and_si256(bits1, mf);
                    qx[g][1] = _mm256_and_si256(bits2, mf);
                    qx[g][2] = _mm256_and_si256(_mm256_srli_epi16(bits1, 4), mf);
                    qx[g][3] = _mm256_and_si256(_mm256_srli_epi16(bits2, 4), mf);
                }
                for (int iy = 0; iy < nrc_y; ++iy) {
                    auto y = _mm256_loadu_si256((const __m256i*)q8.y[iy][ibl].qs+ib);
                    auto y0 = _mm256_shuffle_epi32(y, 0x00), y1 = _mm256_shuffle_epi32(y, 0x55);
                    auto y2 = _mm256_shuffle_epi32(y, 0xaa), y3 = _mm256_shuffle_epi32(y, 0xff);
                    for (int g = 0; g < 2; ++g) {
#ifdef HAVE_VNNI256
                        auto s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), qx[g][0], y0);
                        s = _mm256_dpbusd_epi32(s, qx[g][1], y1);
                        s = _mm256_dpbusd_epi32(s, qx[g][2], y2);
                        s = _mm256_dpbusd_epi32(s, qx[g][3], y3);
                        isum[g][iy] = _mm256_add_epi32(isum[g][iy], _mm256_mullo_epi32(scales_d[g], s));
#else
                        auto sumi1 = _mm256_add_epi16(_mm256_maddubs_epi16(qx[g][0], y0), _mm256_maddubs_epi16(qx[g][1], y1));
                        auto sumi2 = _mm256_add_epi16(_mm256_maddubs_epi16(qx[g][2], y2), _mm256_maddubs_epi16(qx[g][3], y3));
                        isum[g][iy] = _mm256_add_epi32(isum[g][iy], _mm256_madd_epi16(scales_d[g], _mm256_add_epi16(sumi1, sumi2)));
#endif
                    }
                }
            }
            for (int g = 0; g < 2; ++g) {
                for (int iy = 0; iy < nrc_y; ++iy) {
                    acc[g][iy] = _mm256_fmadd_ps(_mm256_mul_ps(d4[g], _mm256_set1_ps(q8.scale(iy, ibl))), _mm256_cvtepi32_ps(isum[g][iy]), acc[g][iy]);
                    isum[g][iy] = _mm256_setzero_si256();
                }
            }
        }
        for (int g = 0; g < 2; ++g) {
            for (int iy = 0; iy < nrc_y; ++iy) {
                auto sum = _mm_add_ps(_mm256_castps256_ps128(acc[g][iy]), _mm256_extractf128_ps(acc[g][iy], 1));
                acc[g][iy] = _mm256_setzero_ps();
                info.store(ix+4*g, iy, sum);
            }
        }
    }
    return nrc_x8;
    }
}

