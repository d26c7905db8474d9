/* elementwise.c: binary ops with broadcasting, scalar forms, unary ops and their backward,
 * SwiGLU and masked_fill.
 *
 * Inputs are broadcast to out's shape (numpy rules: align trailing dims, size-1 dims stretch)
 * and handed to the backend as contiguous tensors of out's shape. The math runs in one float
 * dtype per call: the common dtype of the float tensors involved when the backend takes it,
 * else f32 (integer and bool inputs are read as f32). Comparisons write 1/0 into a bool/u8 out,
 * or into a float out.
 */
#include <stdio.h>
#include <string.h>

#include "prep.h"

static const char *const binary_names[LUNAR_BINARY_COUNT] = {
    "add", "sub", "mul", "div", "maximum", "minimum", "pow", "rsub", "rdiv", "eq", "ne", "lt", "le", "gt", "ge",
};

static const char *const unary_names[LUNAR_UNARY_COUNT] = {
    "neg", "abs", "exp", "log", "sqrt", "rsqrt", "reciprocal", "square", "tanh", "sigmoid",
    "silu", "gelu", "gelu_tanh", "relu", "sin", "cos",
};

const char *lunar_binary_op_name(lunar_binary_op op) {
    return (unsigned)op < LUNAR_BINARY_COUNT ? binary_names[op] : "?";
}

const char *lunar_unary_op_name(lunar_unary_op op) {
    return (unsigned)op < LUNAR_UNARY_COUNT ? unary_names[op] : "?";
}

int lunar_binary_op_from_name(const char *name, lunar_binary_op *out) {
    for (int i = 0; i < LUNAR_BINARY_COUNT; i++)
        if (strcmp(name, binary_names[i]) == 0) { *out = (lunar_binary_op)i; return 1; }
    if (strcmp(name, "max") == 0) { *out = LUNAR_BINARY_MAX; return 1; }
    if (strcmp(name, "min") == 0) { *out = LUNAR_BINARY_MIN; return 1; }
    return 0;
}

int lunar_unary_op_from_name(const char *name, lunar_unary_op *out) {
    for (int i = 0; i < LUNAR_UNARY_COUNT; i++)
        if (strcmp(name, unary_names[i]) == 0) { *out = (lunar_unary_op)i; return 1; }
    if (strcmp(name, "recip") == 0) { *out = LUNAR_UNARY_RECIP; return 1; }
    return 0;
}

static int is_compare(lunar_binary_op op) { return op >= LUNAR_BINARY_EQ && op < LUNAR_BINARY_COUNT; }
static int is_mask_dtype(lunar_dtype dt) { return dt == LUNAR_DTYPE_BOOL || dt == LUNAR_DTYPE_U8; }

/* The float dtype the math runs in: the tensors' common float dtype if the backend takes it,
 * else f32. Non-float tensors do not vote (they are read as f32). */
static lunar_dtype common_dtype(const lunar_prep *p, const lunar_tensor *const *ts, int n) {
    lunar_dtype dt = LUNAR_DTYPE_COUNT;
    for (int i = 0; i < n; i++) {
        if (!ts[i] || !lunar_dtype_is_float(ts[i]->dtype)) continue;
        if (dt == LUNAR_DTYPE_COUNT) dt = ts[i]->dtype;
        else if (dt != ts[i]->dtype) return LUNAR_DTYPE_F32;
    }
    return dt == LUNAR_DTYPE_COUNT ? LUNAR_DTYPE_F32 : prep_compute_dtype(p, dt);
}

static lunar_status check_op(lunar_prep *p, unsigned op, unsigned count) {
    if (p->st) return p->st;
    if (op < count) return LUNAR_OK;
    return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_ARG, "%s: unknown op %u", p->op, op);
}

/* Checks out for an elementwise result: float, or bool/u8 when allowed. */
static lunar_status check_out(lunar_prep *p, const lunar_tensor *out, int allow_mask) {
    if (p->st) return p->st;
    if (lunar_dtype_is_float(out->dtype) || (allow_mask && is_mask_dtype(out->dtype))) return LUNAR_OK;
    return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_DTYPE, "%s: out '%s' must be a float%s tensor, not %s", p->op,
                              lunar_tensor_label(out), allow_mask ? " or bool" : "", lunar_dtype_name(out->dtype));
}

/* work = src broadcast to out's shape, contiguous, in dtype dt. The error names the op, both
 * shapes and the role. */
static lunar_status broadcast_in(lunar_prep *p, lunar_tensor *work, const lunar_tensor *src, const char *role,
                                 const lunar_tensor *out, lunar_dtype dt) {
    memset(work, 0, sizeof *work);
    if (prep_check(p, src, role)) return p->st;
    lunar_tensor view = {0};
    if (lunar_tensor_expand(p->ctx, &view, src, out->ndim, out->shape) != LUNAR_OK) {
        char a[160], b[160];
        lunar_tensor_shape_str(src, a, sizeof a);
        lunar_tensor_shape_str(out, b, sizeof b);
        return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_SHAPE, "%s: %s '%s' %s does not broadcast to out '%s' %s", p->op,
                                  role, lunar_tensor_label(src), a, lunar_tensor_label(out), b);
    }
    prep_in(p, work, &view, role, dt);
    lunar_tensor_release(p->ctx, &view);
    return p->st;
}

/* Names both inputs when a and b do not broadcast together (a clearer message than naming
 * only one of them against out). */
static lunar_status check_pair(lunar_prep *p, const lunar_tensor *a, const lunar_tensor *b, const lunar_tensor *out) {
    if (p->st) return p->st;
    int nd;
    int64_t shape[LUNAR_MAX_DIMS];
    if (lunar_broadcast_shape(p->ctx, a, b, &nd, shape) == LUNAR_OK) return LUNAR_OK;
    char x[160], y[160], z[160];
    lunar_tensor_shape_str(a, x, sizeof x);
    lunar_tensor_shape_str(b, y, sizeof y);
    lunar_tensor_shape_str(out, z, sizeof z);
    return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_SHAPE, "%s: a '%s' %s and b '%s' %s do not broadcast together (out %s)",
                              p->op, lunar_tensor_label(a), x, lunar_tensor_label(b), y, z);
}

/* the out work tensor: bool/u8 outs of comparisons stay as they are, floats use dt */
static lunar_status elementwise_out(lunar_prep *p, lunar_tensor *work, lunar_tensor *out, lunar_dtype dt) {
    if (p->st) {
        memset(work, 0, sizeof *work);
        return p->st;
    }
    return prep_out(p, work, out, "out", is_mask_dtype(out->dtype) ? out->dtype : dt, 0);
}

lunar_status lunar_binary(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *a, const lunar_tensor *b,
                          lunar_binary_op op) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "binary", out));
    p.alias_ok = 1;
    p.op = (unsigned)op < LUNAR_BINARY_COUNT ? binary_names[op] : "binary";
    if (!p.be->binary) return prep_end(&p, prep_unsupported(&p));
    check_op(&p, (unsigned)op, LUNAR_BINARY_COUNT);
    prep_check(&p, a, "a");
    prep_check(&p, b, "b");
    check_out(&p, out, is_compare(op));
    check_pair(&p, a, b, out);
    if (p.st) return prep_end(&p, p.st);
    const lunar_tensor *vote[3] = {a, b, is_compare(op) ? NULL : out};
    lunar_dtype dt = common_dtype(&p, vote, 3);
    lunar_tensor aw, bw, ow;
    broadcast_in(&p, &aw, a, "a", out, dt);
    broadcast_in(&p, &bw, b, "b", out, dt);
    elementwise_out(&p, &ow, out, dt);
    if (p.st) return prep_end(&p, p.st);
    if (lunar_tensor_numel(&ow) == 0) return prep_end(&p, LUNAR_OK);
    return prep_end(&p, p.be->binary(ctx, &ow, &aw, &bw, op));
}

lunar_status lunar_binary_scalar(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *a, double s,
                                 lunar_binary_op op) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "binary_scalar", out));
    p.alias_ok = 1;
    p.op = (unsigned)op < LUNAR_BINARY_COUNT ? binary_names[op] : "binary_scalar";
    if (!p.be->binary_scalar) return prep_end(&p, prep_unsupported(&p));
    check_op(&p, (unsigned)op, LUNAR_BINARY_COUNT);
    prep_check(&p, a, "a");
    check_out(&p, out, is_compare(op));
    if (p.st) return prep_end(&p, p.st);
    const lunar_tensor *vote[2] = {a, is_compare(op) ? NULL : out};
    lunar_dtype dt = common_dtype(&p, vote, 2);
    lunar_tensor aw, ow;
    broadcast_in(&p, &aw, a, "a", out, dt);
    elementwise_out(&p, &ow, out, dt);
    if (p.st) return prep_end(&p, p.st);
    if (lunar_tensor_numel(&ow) == 0) return prep_end(&p, LUNAR_OK);
    return prep_end(&p, p.be->binary_scalar(ctx, &ow, &aw, s, op));
}

/* Tensors of an op without broadcasting must have out's shape exactly. */
static lunar_status same_shape(lunar_prep *p, const lunar_tensor *t, const char *role, const lunar_tensor *out) {
    if (prep_check(p, t, role)) return p->st;
    return prep_expect_shape(p, t, role, out->ndim, out->shape);
}

lunar_status lunar_unary(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *x, lunar_unary_op op) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "unary", out));
    p.alias_ok = 1;
    p.op = (unsigned)op < LUNAR_UNARY_COUNT ? unary_names[op] : "unary";
    if (!p.be->unary) return prep_end(&p, prep_unsupported(&p));
    check_op(&p, (unsigned)op, LUNAR_UNARY_COUNT);
    check_out(&p, out, 0);
    same_shape(&p, x, "x", out);
    if (p.st) return prep_end(&p, p.st);
    const lunar_tensor *vote[2] = {x, out};
    lunar_dtype dt = common_dtype(&p, vote, 2);
    lunar_tensor xw, ow;
    prep_in(&p, &xw, x, "x", dt);
    prep_out(&p, &ow, out, "out", dt, 0);
    if (p.st) return prep_end(&p, p.st);
    if (lunar_tensor_numel(&ow) == 0) return prep_end(&p, LUNAR_OK);
    return prep_end(&p, p.be->unary(ctx, &ow, &xw, op));
}

lunar_status lunar_unary_backward(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dy, const lunar_tensor *x,
                                  lunar_unary_op op) {
    char name[48];
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "unary_backward", dx));
    p.alias_ok = 1;
    snprintf(name, sizeof name, "%s_backward", lunar_unary_op_name(op));
    p.op = name;
    if (!p.be->unary_backward) return prep_end(&p, prep_unsupported(&p));
    check_op(&p, (unsigned)op, LUNAR_UNARY_COUNT);
    prep_expect_float(&p, dx, "dx");
    same_shape(&p, dy, "dy", dx);
    same_shape(&p, x, "x", dx);
    if (p.st) return prep_end(&p, p.st);
    const lunar_tensor *vote[3] = {dy, x, dx};
    lunar_dtype dt = common_dtype(&p, vote, 3);
    lunar_tensor dyw, xw, dxw;
    prep_in(&p, &dyw, dy, "dy", dt);
    prep_in(&p, &xw, x, "x", dt);
    prep_out(&p, &dxw, dx, "dx", dt, 0);
    if (p.st) return prep_end(&p, p.st);
    if (lunar_tensor_numel(&dxw) == 0) return prep_end(&p, LUNAR_OK);
    return prep_end(&p, p.be->unary_backward(ctx, &dxw, &dyw, &xw, op));
}

lunar_status lunar_swiglu_forward(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *gate,
                                  const lunar_tensor *up) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "swiglu_forward", out));
    p.alias_ok = 1;
    if (!p.be->swiglu_forward) return prep_end(&p, prep_unsupported(&p));
    prep_expect_float(&p, out, "out");
    same_shape(&p, gate, "gate", out);
    same_shape(&p, up, "up", out);
    if (p.st) return prep_end(&p, p.st);
    const lunar_tensor *vote[3] = {gate, up, out};
    lunar_dtype dt = common_dtype(&p, vote, 3);
    lunar_tensor gw, uw, ow;
    prep_in(&p, &gw, gate, "gate", dt);
    prep_in(&p, &uw, up, "up", dt);
    prep_out(&p, &ow, out, "out", dt, 0);
    if (p.st) return prep_end(&p, p.st);
    if (lunar_tensor_numel(&ow) == 0) return prep_end(&p, LUNAR_OK);
    return prep_end(&p, p.be->swiglu_forward(ctx, &ow, &gw, &uw));
}

lunar_status lunar_swiglu_backward(lunar_ctx *ctx, lunar_tensor *dgate, lunar_tensor *dup,
                                   const lunar_tensor *dout, const lunar_tensor *gate, const lunar_tensor *up) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "swiglu_backward", dgate));
    p.alias_ok = 1;
    if (!p.be->swiglu_backward) return prep_end(&p, prep_unsupported(&p));
    prep_expect_float(&p, dgate, "dgate");
    prep_check(&p, dup, "dup");
    if (!p.st) prep_expect_float(&p, dup, "dup");
    if (!p.st) prep_expect_shape(&p, dup, "dup", dgate->ndim, dgate->shape);
    same_shape(&p, dout, "dout", dgate);
    same_shape(&p, gate, "gate", dgate);
    same_shape(&p, up, "up", dgate);
    if (p.st) return prep_end(&p, p.st);
    const lunar_tensor *vote[5] = {dout, gate, up, dgate, dup};
    lunar_dtype dt = common_dtype(&p, vote, 5);
    lunar_tensor dow, gw, uw, dgw, duw;
    prep_in(&p, &dow, dout, "dout", dt);
    prep_in(&p, &gw, gate, "gate", dt);
    prep_in(&p, &uw, up, "up", dt);
    prep_out(&p, &dgw, dgate, "dgate", dt, 0);
    prep_out(&p, &duw, dup, "dup", dt, 0);
    if (p.st) return prep_end(&p, p.st);
    if (lunar_tensor_numel(&dgw) == 0) return prep_end(&p, LUNAR_OK);
    return prep_end(&p, p.be->swiglu_backward(ctx, &dgw, &duw, &dow, &gw, &uw));
}

lunar_status lunar_masked_fill(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *x,
                               const lunar_tensor *mask, double value) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "masked_fill", out));
    p.alias_ok = 1;
    if (!p.be->masked_fill) return prep_end(&p, prep_unsupported(&p));
    prep_expect_float(&p, out, "out");
    same_shape(&p, x, "x", out);
    prep_check(&p, mask, "mask");
    if (!p.st && !is_mask_dtype(mask->dtype))
        p.st = LUNAR_FAIL(ctx, LUNAR_ERR_DTYPE, "masked_fill: mask '%s' must be bool or u8, not %s",
                          lunar_tensor_label(mask), lunar_dtype_name(mask->dtype));
    if (p.st) return prep_end(&p, p.st);
    const lunar_tensor *vote[2] = {x, out};
    lunar_dtype dt = common_dtype(&p, vote, 2);
    lunar_tensor xw, mw, ow;
    prep_in(&p, &xw, x, "x", dt);
    broadcast_in(&p, &mw, mask, "mask", out, mask->dtype);
    prep_out(&p, &ow, out, "out", dt, 0);
    if (p.st) return prep_end(&p, p.st);
    if (lunar_tensor_numel(&ow) == 0) return prep_end(&p, LUNAR_OK);
    return prep_end(&p, p.be->masked_fill(ctx, &ow, &xw, &mw, value));
}
