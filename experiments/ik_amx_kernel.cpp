// The repacked Q4_K and Q6_K kernels against their AMX versions (`k-quant-amx-2`), in one process, calls
// alternating: compiled by experiments/ik_amx_kernel.py with the patched ik_llama.cpp kernels
// file included below (from the source tree adaspec's build patches; nothing of it is
// copied here). Random Q4_K_R4 / Q6_K_R4 weights and Q8_K activations of the target's shapes; every
// output compared bit for bit; prints one JSON line per shape: medians in ms.
#include IK_KERNELS_FILE
#include "ik_kernel_data.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#ifndef ADASPEC_AMX_Q4K
int main() { std::printf("{\"error\": \"the kernels file has no AMX kernel for this CPU\"}\n"); return 2; }
#else
namespace {

using adaspec_driver::now;

// ny activation rows (a multiple of 16) by nx weight rows of n quants of a repacked type
// (Block, 4 rows a block): the pinned kernel in calls of 8 rows (as ik's driver splits them)
// against the tile kernel taking all at once
template <typename Block>
void shape(const char * type, int n, int nx, int ny, int reps, mul_mat_t pinned8, mul_mat_t tiles) {
    std::mt19937 rng(1000*ny + n);
    const int nbl = n / QK_K;
    const size_t row = nbl*sizeof(Block)/4;  // bytes of one weight row (4 share a block)
    std::vector<uint8_t> w = adaspec_driver::random_weights<Block>(rng, n, nx);
    std::vector<block_q8_K> y = adaspec_driver::random_activations<Block>(rng, n, ny);
    std::vector<float> out_pinned(nx*ny), out_amx(nx*ny);
    DataInfo pinned{out_pinned.data(), (const char *)y.data(), (size_t)nx, nbl*sizeof(block_q8_K)};
    DataInfo amx{out_amx.data(), (const char *)y.data(), (size_t)nx, nbl*sizeof(block_q8_K)};
    auto run_pinned = [&]() {
        for (int done = 0; done < ny; done += 8) {
            DataInfo part = pinned; part.cur_y = done;
            pinned8(n, w.data(), row, part, nx);
        }
    };
    auto run_amx = [&]() {  // as the patched driver: order the rows, then one call
        adaspec_amx::order(amx, n, ny);
        tiles(n, w.data(), row, amx, nx);
    };
    run_pinned(); run_amx();
    int differ = 0;
    for (size_t k = 0; k < out_pinned.size(); ++k) differ += std::memcmp(&out_pinned[k], &out_amx[k], 4) != 0;
    std::vector<double> a, b;
    for (int r = 0; r < reps; ++r) {
        double t0 = now(); run_pinned(); double t1 = now(); run_amx(); double t2 = now();
        a.push_back(t1 - t0); b.push_back(t2 - t1);
    }
    std::sort(a.begin(), a.end()); std::sort(b.begin(), b.end());
    std::printf("{\"type\": \"%s\", \"rows\": %d, \"n\": %d, \"weight_rows\": %d, \"pinned_ms\": %.4f, "
                "\"amx_ms\": %.4f, \"amx_over_pinned\": %.3f, \"outputs\": %zu, \"differ\": %d}\n", type, ny, n, nx,
                1e3*a[reps/2], 1e3*b[reps/2], b[reps/2]/a[reps/2], out_pinned.size(), differ);
    std::fflush(stdout);
}

}  // namespace

int main() {
    if (!adaspec_amx::enabled()) {
        std::printf("{\"error\": \"no AMX tile state (Linux refused, or ADASPEC_IK_AMX=off)\"}\n");
        return 2;
    }
    // the 1.5B target's shapes, one thread's half of the weight rows. Q4_K: 1536 -> 8960 (ffn
    // up, gate), 8960 -> 1536 (down in some layers) and 1536 -> 1536 (attention q, o); Q6_K:
    // 8960 -> 1536 (down in the others) and 1536 -> 256 (attention v). 16 rows (a block of
    // 16, a round of 8 x 2: Q6_K keeps its pinned kernel there), 64 and 256 (prompt chunks).
    auto q4 = mul_mat_q4_k_r4_q8_k<8>, q6 = mul_mat_q6_k_r4_q8_k<8>;
    auto q4t = adaspec_amx::mul_mat_q4_k_r4_q8_k_amx, q6t = adaspec_amx::mul_mat_q6_k_r4_q8_k_amx;
    for (int ny : {16, 64, 256}) {
        int reps = ny == 256 ? 9 : 21;
        shape<block_q4_k_r4>("q4_K", 1536, 4480, ny, reps, q4, q4t);
        shape<block_q4_k_r4>("q4_K", 8960, 768, ny, reps, q4, q4t);
        shape<block_q4_k_r4>("q4_K", 1536, 768, ny, reps, q4, q4t);
        shape<block_q6_k_r4>("q6_K", 8960, 768, ny, reps, q6, q6t);
        shape<block_q6_k_r4>("q6_K", 1536, 128, ny, reps, q6, q6t);
    }
    return 0;
}
#endif
