/* prep.h: what every op in host/ops does before and after calling its backend.
 *
 *   lunar_prep p;
 *   LUNAR_TRY(prep_begin(&p, ctx, "rmsnorm_forward", x));      // device + backend from x
 *   prep_in(&p, &xw, x, "x", dt);   prep_out(&p, &ow, out, "out", dt, 0);
 *   st = p.be->rmsnorm_forward(ctx, &ow, ...);
 *   return prep_end(&p, st);                                  // copy back, release temporaries
 *
 * prep_in gives a contiguous view of the wanted dtype (the tensor itself when it already is
 * one, else a temporary copy); prep_out gives a contiguous tensor of the wanted dtype to write
 * into, which prep_end copies back into the user's tensor when it had to be a temporary (load=1
 * first copies the user's values in, for outputs that accumulate). Errors name the op, the
 * role and the tensor. After the first failure every later prep call is a no-op that returns
 * the same status, so an op can chain calls and check once.
 *
 * Aliasing: an output that shares memory with an input the kernel reads in place (prepared
 * before it) is written through a temporary, so no kernel reads what it has already written.
 * An op whose kernels read each element before writing the same element (elementwise and
 * row-wise ops) sets p.alias_ok, which lets an output that is exactly an input's view (in-place
 * x:add_(y), out = x) be written directly; partial overlaps always go through a temporary.
 */
#ifndef LUNAR_OPS_PREP_H
#define LUNAR_OPS_PREP_H

#include "lunar/backend.h"
#include "lunar/ops.h"

#define PREP_MAX 24

typedef struct lunar_prep {
    lunar_ctx           *ctx;
    const char          *op;
    const lunar_backend *be;
    lunar_device         dev;
    lunar_status         st;
    lunar_tensor        *held[PREP_MAX];     /* work tensors to release at the end */
    int                  n_held;
    lunar_tensor        *out_user[PREP_MAX]; /* outputs to copy back */
    lunar_tensor        *out_work[PREP_MAX];
    int                  n_out;
    lunar_tensor         in_place[PREP_MAX]; /* inputs the kernel reads in place (unretained copies) */
    int                  n_in_place;
    int                  alias_ok;           /* set by the op: see "Aliasing" above */
} lunar_prep;

lunar_status prep_begin(lunar_prep *p, lunar_ctx *ctx, const char *op, const lunar_tensor *first);
/* The backend entry is missing: fail with the op's name. */
lunar_status prep_unsupported(lunar_prep *p);
/* Validity (not freed/stale) and same device as the op. */
lunar_status prep_check(lunar_prep *p, const lunar_tensor *t, const char *role);
/* dt if the backend's kernels take it, else f32 (for floats); ints map to i64. */
lunar_dtype  prep_compute_dtype(const lunar_prep *p, lunar_dtype dt);
lunar_status prep_in(lunar_prep *p, lunar_tensor *work, const lunar_tensor *src, const char *role, lunar_dtype want);
lunar_status prep_out(lunar_prep *p, lunar_tensor *work, lunar_tensor *user, const char *role, lunar_dtype want,
                      int load);
/* A new contiguous scratch tensor on the op's device, released by prep_end. */
lunar_status prep_temp(lunar_prep *p, lunar_tensor *work, lunar_dtype dt, int ndim, const int64_t *shape);
lunar_status prep_end(lunar_prep *p, lunar_status st);

/* Shape checks with messages that name the op, role and tensor. */
lunar_status prep_expect_shape(lunar_prep *p, const lunar_tensor *t, const char *role, int ndim,
                               const int64_t *shape);
lunar_status prep_expect_float(lunar_prep *p, const lunar_tensor *t, const char *role);
lunar_status prep_expect_index(lunar_prep *p, const lunar_tensor *t, const char *role);
/* Normalises a possibly negative dim of t; fails naming the op. */
lunar_status prep_dim(lunar_prep *p, const lunar_tensor *t, const char *role, int *dim);
/* (outer, n, inner) of a contiguous layout around dim. */
void prep_split_dim(const lunar_tensor *t, int dim, int64_t *outer, int64_t *n, int64_t *inner);

#endif
