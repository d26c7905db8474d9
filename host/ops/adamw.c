/* adamw.c: one AdamW step (torch.optim.AdamW semantics, decoupled weight decay).
 *
 * m, v and master are f32 with param's shape; grad is a float tensor with param's shape. With a
 * master copy, the master is updated and param (any float dtype) receives its rounding;
 * without one, param itself must be f32. param and grad each reach the backend in their own
 * compute dtype (a bf16 param may have an f32 grad); m, v, master are f32. */
#include <math.h>

#include "prep.h"

static lunar_status same_shape_f32(lunar_prep *p, const lunar_tensor *t, const char *role, const lunar_tensor *param) {
    if (prep_check(p, t, role)) return p->st;
    if (t->dtype != LUNAR_DTYPE_F32)
        return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_DTYPE, "%s: %s '%s' must be f32, not %s", p->op, role,
                                  lunar_tensor_label(t), lunar_dtype_name(t->dtype));
    return prep_expect_shape(p, t, role, param->ndim, param->shape);
}

lunar_status lunar_adamw_step(lunar_ctx *ctx, lunar_tensor *param, lunar_tensor *master, lunar_tensor *m,
                              lunar_tensor *v, const lunar_tensor *grad, const lunar_adamw_hparams *hp) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "adamw_step", param));
    if (!p.be->adamw_step) return prep_end(&p, prep_unsupported(&p));
    if (!hp) return prep_end(&p, LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "adamw_step: hyperparameters are missing"));
    prep_expect_float(&p, param, "param");
    prep_check(&p, grad, "grad");
    prep_expect_float(&p, grad, "grad");
    if (!p.st) prep_expect_shape(&p, grad, "grad", param->ndim, param->shape);
    same_shape_f32(&p, m, "m", param);
    same_shape_f32(&p, v, "v", param);
    if (master) same_shape_f32(&p, master, "master", param);
    if (p.st) return prep_end(&p, p.st);
    if (!master && param->dtype != LUNAR_DTYPE_F32)
        return prep_end(&p, LUNAR_FAIL(ctx, LUNAR_ERR_DTYPE,
                                       "adamw_step: param '%s' is %s: pass an f32 master copy (master=) or use an f32 param",
                                       lunar_tensor_label(param), lunar_dtype_name(param->dtype)));
    if (hp->step < 1)
        return prep_end(&p, LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "adamw_step: step must be >= 1 (1-based), got %lld",
                                       (long long)hp->step));
    if (!(hp->beta1 >= 0 && hp->beta1 < 1) || !(hp->beta2 >= 0 && hp->beta2 < 1))
        return prep_end(&p, LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "adamw_step: betas must be in [0, 1), got %g, %g", hp->beta1,
                                       hp->beta2));
    if (!isfinite(hp->lr) || !(hp->eps >= 0) || !isfinite(hp->weight_decay) || !isfinite(hp->grad_scale))
        return prep_end(&p, LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "adamw_step: lr %g, eps %g, weight_decay %g, grad_scale %g must be finite (eps >= 0)",
                                       hp->lr, hp->eps, hp->weight_decay, hp->grad_scale));
    lunar_tensor pw, mw, mm, vw, gw;
    prep_in(&p, &gw, grad, "grad", prep_compute_dtype(&p, grad->dtype));
    prep_out(&p, &pw, param, "param", prep_compute_dtype(&p, param->dtype), master == NULL);
    if (master) prep_out(&p, &mw, master, "master", LUNAR_DTYPE_F32, 1);
    prep_out(&p, &mm, m, "m", LUNAR_DTYPE_F32, 1);
    prep_out(&p, &vw, v, "v", LUNAR_DTYPE_F32, 1);
    if (p.st) return prep_end(&p, p.st);
    return prep_end(&p, p.be->adamw_step(ctx, &pw, master ? &mw : NULL, &mm, &vw, &gw, hp));
}
