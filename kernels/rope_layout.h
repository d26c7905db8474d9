/* rope_layout.h: where the two channels of rotary pair i are read and written, per layout, shared
 * by the CPU and CUDA rope kernels (see lunar_rope_layout in lunar/ops.h). Pair i reads
 * channels (i * in_step, i * in_step + in_second) and writes (i * out_step, i * out_step +
 * out_second). The backward (inverse) applies the transposed rotation, which also swaps the
 * read and write patterns (undoing INTERLEAVED_TO_HALF's channel move). */
#ifndef LUNAR_KERNELS_ROPE_LAYOUT_H
#define LUNAR_KERNELS_ROPE_LAYOUT_H

#include <stdint.h>

#include "lunar/ops.h"

typedef struct lunar_rope_pairs {
    int64_t in_step, in_second, out_step, out_second;
} lunar_rope_pairs;

/* half = R / 2, the number of rotated pairs */
static inline lunar_rope_pairs lunar_rope_pairs_for(lunar_rope_layout layout, int64_t half, int inverse) {
    lunar_rope_pairs p;
    if (layout == LUNAR_ROPE_HALF) {
        p.in_step = p.out_step = 1;
        p.in_second = p.out_second = half;
    } else if (layout == LUNAR_ROPE_INTERLEAVED) {
        p.in_step = p.out_step = 2;
        p.in_second = p.out_second = 1;
    } else {   /* INTERLEAVED_TO_HALF: (2i, 2i+1) -> (i, i + R/2) */
        p.in_step = 2, p.in_second = 1;
        p.out_step = 1, p.out_second = half;
    }
    if (inverse) {
        lunar_rope_pairs q = {p.out_step, p.out_second, p.in_step, p.in_second};
        p = q;
    }
    return p;
}

#endif
