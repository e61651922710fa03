// What the kernel drivers (ik_amx_kernel.cpp, ik_wide_kernel.cpp) share: a clock and random
// repacked weights and Q8_K activations of a k-quant kernel's shape. Included after the
// ik_llama.cpp kernels file, which defines the block types.
#pragma once

#include <chrono>
#include <cstdint>
#include <random>
#include <type_traits>
#include <vector>

namespace adaspec_driver {

inline double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// `rows` weight rows of n quants of a repacked type (Block: 4 rows a block), random bytes
// with scales in the kernels' range
template <typename Block>
std::vector<uint8_t> random_weights(std::mt19937 & rng, int n, size_t rows) {
    const int nbl = n / QK_K;
    const size_t row = nbl*sizeof(Block)/4;  // bytes of one weight row (4 share a block)
    std::vector<uint8_t> w(row*rows);
    for (auto & b : w) b = rng();
    for (size_t g = 0; g < rows/4; ++g) for (int i = 0; i < nbl; ++i) {
        auto * blk = (Block *)(w.data() + g*4*row) + i;
        for (auto & d : blk->d) d = _cvtss_sh(0.001f + 0.01f*(rng() % 1000)/1000.f, 0);
    }
    return w;
}

// ny activation rows of n quants, with the block sums the kernel of Block reads
template <typename Block>
std::vector<block_q8_K> random_activations(std::mt19937 & rng, int n, int ny) {
    std::vector<block_q8_K> y(n / QK_K * ny);
    for (auto & b : y) {
        b.d = 0.01f*(rng() % 1000)/1000.f;
        for (auto & q : b.qs) q = int8_t(int(rng() % 255) - 127);
        if (std::is_same<Block, block_q4_k_r4>::value) {
            float * f = (float *)b.bsums;  // the repacked Q4_K kernel reads 8 floats there
            for (int k = 0; k < 8; ++k) f[k] = (rng() % 10000)/100.f - 50.f;
        } else {  // the Q6_K one, the sums of 16 quants
            for (int k = 0; k < QK_K/16; ++k) {
                int sum = 0;
                for (int j = 0; j < 16; ++j) sum += b.qs[16*k + j];
                b.bsums[k] = sum;
            }
        }
    }
    return y;
}

}  // namespace adaspec_driver
