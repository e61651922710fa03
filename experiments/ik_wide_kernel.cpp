// The repacked Q4_K and Q6_K kernels against their 512-bit walks (`k-quant-wide`), in one process,
// calls alternating: compiled by experiments/ik_wide_kernel.py with the ik_llama.cpp kernels file
// (patched up to the two-group walk) and adaspec's `backends/ik/patches/ik_wide.cpp` included below
// (nothing of ik_llama.cpp is copied here). Random Q4_K_R4 / Q6_K_R4 weights and Q8_K activations
// of the target's shapes; every output compared bit for bit; one JSON line per shape.
#include IK_KERNELS_FILE
#include ADASPEC_WIDE_FILE
#include "ik_kernel_data.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <thread>

#ifndef HAVE_FANCY_SIMD
int main() { std::printf("{\"error\": \"this CPU has no AVX-512: the wide walk is off\"}\n"); return 2; }
#else
namespace {

using adaspec_driver::now;

// the patched kernel: the wide walk, then the kernel for the rows it leaves
template <int NY> void wide4(int n, const void * vx, size_t bx, const DataInfo& info, int nrc_x) {
    int done = adaspec_q4_k_r4_wide<NY>(n, vx, bx, info, nrc_x);
    DataInfo rest = info;
    rest.s += done;
    if (done < nrc_x) mul_mat_q4_k_r4_q8_k<NY>(n, (const char *)vx + done*bx, bx, rest, nrc_x - done);
}
template <int NY> void wide6(int n, const void * vx, size_t bx, const DataInfo& info, int nrc_x) {
    int done = adaspec_q6_k_r4_wide<NY>(n, vx, bx, info, nrc_x);
    DataInfo rest = info;
    rest.s += done;
    if (done < nrc_x) mul_mat_q6_k_r4_q8_k<NY>(n, (const char *)vx + done*bx, bx, rest, nrc_x - done);
}

// NY activation rows by nx weight rows of n quants, `copies` copies of the weights walked in
// turn (64: they come from memory), each call's weight rows split between `threads` threads
template <typename Block, int NY>
void shape(int n, int nx, int copies, int reps, int threads) {
    constexpr bool q4 = std::is_same<Block, block_q4_k_r4>::value;
    std::mt19937 rng(7 + NY);
    const int nbl = n / QK_K;
    const size_t row = nbl*sizeof(Block)/4;  // bytes of one weight row (4 share a block)
    std::vector<uint8_t> w = adaspec_driver::random_weights<Block>(rng, n, size_t(nx)*copies);
    std::vector<block_q8_K> y = adaspec_driver::random_activations<Block>(rng, n, NY);
    std::vector<float> out_pinned(nx*NY), out_wide(nx*NY);
    auto call = [&](mul_mat_t kernel, std::vector<float>& out, int copy) {
        const uint8_t * base = w.data() + size_t(copy)*row*nx;
        auto part = [&](int t) {
            const int per = nx/threads/4*4, x0 = t*per, count = t == threads - 1 ? nx - x0 : per;
            DataInfo info{out.data(), (const char *)y.data(), size_t(nx), nbl*sizeof(block_q8_K)};
            info.s += x0;
            kernel(n, base + x0*row, row, info, count);
        };
        std::vector<std::thread> others;
        for (int t = 1; t < threads; ++t) others.emplace_back(part, t);
        part(0);
        for (auto & t : others) t.join();
    };
    mul_mat_t pinned = q4 ? mul_mat_q4_k_r4_q8_k<NY> : mul_mat_q6_k_r4_q8_k<NY>;
    mul_mat_t wide = q4 ? wide4<NY> : wide6<NY>;
    call(pinned, out_pinned, 0); call(wide, out_wide, 0);
    int differ = 0;
    for (size_t k = 0; k < out_pinned.size(); ++k) differ += std::memcmp(&out_pinned[k], &out_wide[k], 4) != 0;
    std::vector<double> a, b;
    for (int r = 0; r < reps; ++r) {
        double t0 = now();
        for (int c = 0; c < copies; ++c) call(pinned, out_pinned, c);
        double t1 = now();
        for (int c = 0; c < copies; ++c) call(wide, out_wide, c);
        double t2 = now();
        a.push_back((t1 - t0)/copies); b.push_back((t2 - t1)/copies);
    }
    std::sort(a.begin(), a.end()); std::sort(b.begin(), b.end());
    std::printf("{\"type\": \"%s\", \"rows\": %d, \"n\": %d, \"weight_rows\": %d, \"copies\": %d, "
                "\"pinned_us\": %.1f, \"wide_us\": %.1f, \"wide_over_pinned\": %.3f, "
                "\"pinned_GB_per_s\": %.1f, \"outputs\": %zu, \"differ\": %d}\n",
                q4 ? "q4_K" : "q6_K", NY, n, nx, copies, 1e6*a[reps/2], 1e6*b[reps/2],
                b[reps/2]/a[reps/2], row*nx/1e9/a[reps/2], out_pinned.size(), differ);
    std::fflush(stdout);
}

template <typename Block, int... NY> void every_row_count() {
    (shape<Block, NY>(512, 260, 1, 1, 1), ...);  // 260 weight rows: a last group of 4
}

}  // namespace

int main(int argc, char ** argv) {
    const int threads = argc > 1 ? atoi(argv[1]) : 2, reps = argc > 2 ? atoi(argv[2]) : 9;
    using Q4 = block_q4_k_r4;
    using Q6 = block_q6_k_r4;
    every_row_count<Q4, 1, 2, 3, 4, 5, 6, 7, 8, 16>();
    every_row_count<Q6, 1, 2, 3, 4, 5, 6, 7, 8, 16>();
    // the 1.5B target's shapes: Q4_K ffn up or gate (1536 -> 8960) and down (8960 -> 1536),
    // Q6_K down in the other layers, 64 copies each; the Q6_K output head (1536 -> 151936)
    shape<Q4, 1>(1536, 8960, 64, reps, threads);
    shape<Q4, 2>(1536, 8960, 64, reps, threads);
    shape<Q4, 4>(1536, 8960, 64, reps, threads);
    shape<Q4, 8>(1536, 8960, 64, reps, threads);
    shape<Q4, 8>(8960, 1536, 64, reps, threads);
    shape<Q6, 1>(8960, 1536, 64, reps, threads);
    shape<Q6, 8>(8960, 1536, 64, reps, threads);
    shape<Q6, 1>(1536, 151936, 1, reps, threads);
    shape<Q6, 4>(1536, 151936, 1, reps, threads);
    shape<Q6, 8>(1536, 151936, 1, reps, threads);
    return 0;
}
#endif
