// The repacked Q4_K kernel against its AMX version (`k-quant-amx`), in one process, calls
// alternating: compiled by experiments/ik_amx_kernel.py with the patched ik_llama.cpp kernels
// file included below (from the source tree adaspec's build patches; nothing of it is
// copied here). Random Q4_K_R4 weights and Q8_K activations of the target's shapes; every
// output compared bit for bit; prints one JSON line per shape: medians in ms.
#include IK_KERNELS_FILE

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>

#ifndef ADASPEC_AMX_Q4K
int main() { std::printf("{\"error\": \"the kernels file has no AMX kernel for this CPU\"}\n"); return 2; }
#else
namespace {

double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <int ny>
void shape(int n, int nx, int reps, int pinned_rows) {  // pinned_rows: 6 or 8, dividing ny
    static_assert(ny % 2 == 0, "rows: 6, 8 or 16");
    std::mt19937 rng(1000*ny + n);
    const int nbl = n / QK_K;
    const size_t row = nbl*sizeof(block_q4_k_r4)/4;  // bytes of one weight row (4 share a block)
    std::vector<uint8_t> w(row*nx);
    for (auto & b : w) b = rng();
    for (int g = 0; g < nx/4; ++g) for (int i = 0; i < nbl; ++i) {
        auto * blk = (block_q4_k_r4 *)(w.data() + g*4*row) + i;
        for (auto & d : blk->d) d = _cvtss_sh(0.001f + 0.01f*(rng() % 1000)/1000.f, 0);
    }
    std::vector<block_q8_K> y(nbl*ny);
    for (auto & b : y) {
        b.d = 0.01f*(rng() % 1000)/1000.f;
        for (auto & q : b.qs) q = int8_t(int(rng() % 255) - 127);
        float * f = (float *)b.bsums;  // the repacked kernels read 8 floats there
        for (int k = 0; k < 8; ++k) f[k] = (rng() % 10000)/100.f - 50.f;
    }
    std::vector<float> out_pinned(nx*ny), out_amx(nx*ny);
    DataInfo pinned{out_pinned.data(), (const char *)y.data(), (size_t)nx, nbl*sizeof(block_q8_K)};
    DataInfo amx{out_amx.data(), (const char *)y.data(), (size_t)nx, nbl*sizeof(block_q8_K)};
    auto run_pinned = [&]() {  // as ik's driver splits rows: calls of pinned_rows
        for (int done = 0; done < ny; ) {
            DataInfo part = pinned; part.cur_y = done;
            if (pinned_rows == 8) mul_mat_q4_k_r4_q8_k<8>(n, w.data(), row, part, nx);
            else mul_mat_q4_k_r4_q8_k<6>(n, w.data(), row, part, nx);
            done += pinned_rows;
        }
    };
    auto run_amx = [&]() { adaspec_amx::mul_mat_q4_k_r4_q8_k_amx<ny>(n, w.data(), row, amx, nx); };
    run_pinned(); run_amx();
    int differ = 0;
    for (size_t k = 0; k < out_pinned.size(); ++k) differ += std::memcmp(&out_pinned[k], &out_amx[k], 4) != 0;
    std::vector<double> a, b;
    for (int r = 0; r < reps; ++r) {
        double t0 = now(); run_pinned(); double t1 = now(); run_amx(); double t2 = now();
        a.push_back(t1 - t0); b.push_back(t2 - t1);
    }
    std::sort(a.begin(), a.end()); std::sort(b.begin(), b.end());
    std::printf("{\"rows\": %d, \"n\": %d, \"weight_rows\": %d, \"pinned_ms\": %.4f, \"amx_ms\": %.4f, "
                "\"amx_over_pinned\": %.3f, \"outputs\": %zu, \"differ\": %d}\n", ny, n, nx,
                1e3*a[reps/2], 1e3*b[reps/2], b[reps/2]/a[reps/2], out_pinned.size(), differ);
    std::fflush(stdout);
}

}  // namespace

int main() {
    if (!adaspec_amx::enabled()) {
        std::printf("{\"error\": \"no AMX tile state (Linux refused, or ADASPEC_IK_AMX=off)\"}\n");
        return 2;
    }
    // the 1.5B target's Q4_K shapes: 1536 -> 8960 (ffn up, gate) and 8960 -> 1536 (down)
    shape<6>(1536, 8960, 41, 6);  shape<6>(8960, 1536, 41, 6);
    shape<8>(1536, 8960, 41, 8);  shape<8>(8960, 1536, 41, 8);
    shape<16>(1536, 8960, 21, 8); shape<16>(8960, 1536, 21, 8);
    return 0;
}
#endif
