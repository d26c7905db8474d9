// test_cuda_convert.cu: the element conversions of kernels/cuda/common.cuh (lunar_from_f32,
// lunar_to_f32: what every CUDA kernel uses to load and store bf16 and f16), compiled for the
// host, give the bits of the CPU's conversions (lunar/dtype.h) over every NaN payload of both
// signs, infinities, zeros, every f32 subnormal, the values at and around every rounding tie of
// bf16 and f16, every 16-bit code for the loads, and a sweep over all f32 bit patterns. Needs no
// GPU; built where nvcc is.
#include <stdint.h>
#include <stdio.h>

#include "cuda/common.cuh"

static long long failures = 0, checked = 0;

static void check_from_f32(uint32_t bits) {
    float f = lunar_bits_f32(bits);
    uint16_t b = __bfloat16_as_ushort(lunar_from_f32<__nv_bfloat16>(f)), bw = lunar_f32_to_bf16(f);
    uint16_t h = __half_as_ushort(lunar_from_f32<__half>(f)), hw = lunar_f32_to_f16(f);
    checked++;
    if (b != bw || h != hw) {
        if (failures < 10)
            fprintf(stderr, "FAIL f32 0x%08x: cuda bf16 0x%04x f16 0x%04x, cpu bf16 0x%04x f16 0x%04x\n", bits, b, h, bw,
                    hw);
        failures++;
    }
}

int main(void) {
    // every NaN (both signs, every payload, quiet and signalling) and both infinities
    for (uint32_t m = 0; m <= 0x7fffffu; m++) {
        check_from_f32(0x7f800000u | m);
        check_from_f32(0xff800000u | m);
    }
    // zeros and every subnormal, both signs
    for (uint32_t m = 0; m <= 0x7fffffu; m++) {
        check_from_f32(m);
        check_from_f32(0x80000000u | m);
    }
    // around every rounding boundary: bf16 keeps the top 16 bits (ties at low half 0x8000), f16
    // keeps 10 mantissa bits of normals (ties at 0x1000 of the low 13 bits)
    for (uint32_t hi = 0; hi <= 0xffffu; hi++) {
        static const uint32_t lows[] = {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu, 0x0fffu, 0x1000u,
                                        0x1001u, 0x2000u, 0x3000u, 0x9000u};
        for (unsigned j = 0; j < sizeof lows / sizeof lows[0]; j++) check_from_f32((hi << 16) | lows[j]);
    }
    // the f16 range edges, subnormals and ties, densely: |x| in [2^-26, 2^17)
    for (uint32_t a = 0x32800000u; a < 0x48000000u; a += 0x3ffu) {
        check_from_f32(a);
        check_from_f32(a | 0x80000000u);
    }
    // a sweep over every f32 bit pattern
    for (uint64_t u = 0; u <= 0xffffffffull; u += 257) check_from_f32((uint32_t)u);

    // the loads: every bf16 and f16 code, NaNs keep their sign and payload as on the CPU
    for (uint32_t c = 0; c <= 0xffffu; c++) {
        uint32_t b = lunar_f32_bits(lunar_to_f32(__ushort_as_bfloat16((uint16_t)c)));
        uint32_t h = lunar_f32_bits(lunar_to_f32(__ushort_as_half((uint16_t)c)));
        uint32_t bw = lunar_f32_bits(lunar_bf16_to_f32((uint16_t)c)), hw = lunar_f32_bits(lunar_f16_to_f32((uint16_t)c));
        checked++;
        if (b != bw || h != hw) {
            if (failures < 10)
                fprintf(stderr, "FAIL code 0x%04x: cuda bf16 -> 0x%08x f16 -> 0x%08x, cpu 0x%08x 0x%08x\n", c, b, h, bw,
                        hw);
            failures++;
        }
    }
    if (failures) {
        fprintf(stderr, "%lld of %lld conversions differ between common.cuh and lunar/dtype.h\n", failures, checked);
        return 1;
    }
    printf("ok: %lld conversions, common.cuh == lunar/dtype.h bit for bit\n", checked);
    return 0;
}
