/* lua_tensor.c: the tensor userdata: constructors, views, copies, element access, freeing. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lua_lunar.h"
#include "lunar/backend.h"

static const lunar_device CPU = {LUNAR_DEVICE_CPU, 0};

/* ---- constructors ------------------------------------------------------------------------- */

/* core.empty(shape, dtype, device) */
static int l_empty(lua_State *L) {
    int64_t shape[LUNAR_MAX_DIMS];
    luaL_checktype(L, 1, LUA_TTABLE);
    int nd = lunar_lua_check_shape(L, 1, shape);
    for (int i = 0; i < nd; i++)
        if (shape[i] < 0) lunar_lua_error(L, "empty: size %lld in dim %d is negative", (long long)shape[i], i + 1);
    lunar_dtype dt = lunar_lua_opt_dtype(L, 2, LUNAR_DTYPE_F32);
    lunar_device dev = lunar_lua_opt_device(L, 3, CPU);
    lunar_lua_new_tensor(L, dt, dev, nd, shape);
    return 1;
}

/* argument i as an integer position, dim or length: 1.5 is an error, not silently 1 */
static int64_t check_index_arg(lua_State *L, int i, const char *what) {
    double v = luaL_checknumber(L, i);
    if (v != floor(v)) lunar_lua_error(L, "%s %g is not an integer", what, v);
    if (v >= 9223372036854775808.0 || v < -9223372036854775808.0) lunar_lua_error(L, "%s %g is out of range", what, v);
    return (int64_t)v;
}

/* Values stored into an integer dtype must fit it exactly: out of range they would wrap, and a
 * fraction would be cut off, without a word. Float dtypes round, and bool takes any value as
 * true or false: no check. int_store_range gives the range to check, once per tensor; i64's hi
 * is 2^63 as a double, which admits 2^63 itself: a Lua number cannot say 2^63 - 1, and that
 * value stores as INT64_MAX. */
static int int_store_range(lunar_dtype dt, double *lo, double *hi) {
    int64_t min, max;
    if (dt == LUNAR_DTYPE_BOOL || !lunar_dtype_int_range(dt, &min, &max)) return 0;
    *lo = (double)min, *hi = (double)max;
    return 1;
}

/* NULL if v fits [lo, hi] as an integer, else why not */
static const char *int_misfit(double v, double lo, double hi) {
    if (v != v || v < lo || v > hi) return "out of range";
    if (v != floor(v)) return "not an integer";
    return NULL;
}

/* core.from_flat(values, shape, dtype, device): values is a flat Lua array in row-major order */
static int l_from_flat(lua_State *L) {
    luaL_checktype(L, 1, LUA_TTABLE);
    int64_t shape[LUNAR_MAX_DIMS];
    luaL_checktype(L, 2, LUA_TTABLE);
    int nd = lunar_lua_check_shape(L, 2, shape);
    lunar_dtype dt = lunar_lua_opt_dtype(L, 3, LUNAR_DTYPE_F32);
    lunar_device dev = lunar_lua_opt_device(L, 4, CPU);
    int64_t n = 1;
    for (int i = 0; i < nd; i++) n *= shape[i];
    if ((int64_t)lua_objlen(L, 1) != n)
        lunar_lua_error(L, "tensor: %lld values for a shape of %lld elements", (long long)lua_objlen(L, 1), (long long)n);
    lunar_ctx *ctx = lunar_lua_ctx(L);
    lunar_tensor *host = lunar_lua_push_empty_tensor(L);   /* the userdata owns it: errors leak nothing */
    lunar_lua_check_status(L, lunar_tensor_new(ctx, host, dt, CPU, nd, shape));
    char *p = lunar_tensor_data(host);
    size_t es = lunar_dtype_size(dt);
    double lo = 0, hi = 0;
    int check_int = int_store_range(dt, &lo, &hi);
    for (int64_t i = 0; i < n; i++) {
        lua_rawgeti(L, 1, (int)(i + 1));
        int ok = lua_isnumber(L, -1) || lua_isboolean(L, -1);
        double v = lua_isboolean(L, -1) ? (double)lua_toboolean(L, -1) : lua_tonumber(L, -1);
        lua_pop(L, 1);
        if (!ok) return lunar_lua_error(L, "tensor: value %lld is not a number", (long long)(i + 1));
        const char *why = check_int ? int_misfit(v, lo, hi) : NULL;
        if (why) return lunar_lua_error(L, "tensor: value %lld (%.17g) is %s for %s", (long long)(i + 1), v, why,
                                        lunar_dtype_name(dt));
        lunar_dtype_store(dt, p + i * (int64_t)es, v);
    }
    if (lunar_device_is_host(dev)) {
        lunar_lua_check_status(L, lunar_scope_track(ctx, host->storage));
        return 1;
    }
    lunar_tensor *dst = lunar_lua_new_tensor(L, dt, dev, nd, shape);
    lunar_status st = lunar_copy(ctx, dst, host);
    lunar_tensor_release(ctx, host);   /* the staging copy goes back to the pool now */
    lunar_lua_check_status(L, st);
    return 1;
}

/* ---- metadata ------------------------------------------------------------------------------ */

/* t:size([dim]) / t:stride([dim]): one entry of dims (a 1-based Lua dim), or all as a table */
static int push_dims(lua_State *L, const lunar_tensor *t, const int64_t *dims) {
    if (!lua_isnoneornil(L, 2)) {
        lua_pushnumber(L, (lua_Number)dims[lunar_lua_check_dim(L, 2, t->ndim)]);
        return 1;
    }
    lua_createtable(L, t->ndim, 0);
    for (int i = 0; i < t->ndim; i++) {
        lua_pushnumber(L, (lua_Number)dims[i]);
        lua_rawseti(L, -2, i + 1);
    }
    return 1;
}

static int l_size(lua_State *L) {
    lunar_tensor *t = lunar_lua_check_tensor_raw(L, 1);
    return push_dims(L, t, t->shape);
}

static int l_stride(lua_State *L) {
    lunar_tensor *t = lunar_lua_check_tensor_raw(L, 1);
    return push_dims(L, t, t->stride);
}

static int l_dim(lua_State *L) { lua_pushinteger(L, lunar_lua_check_tensor_raw(L, 1)->ndim); return 1; }
static int l_numel(lua_State *L) { lua_pushnumber(L, (lua_Number)lunar_tensor_numel(lunar_lua_check_tensor_raw(L, 1))); return 1; }
static int l_dtype(lua_State *L) { lua_pushstring(L, lunar_dtype_name(lunar_lua_check_tensor_raw(L, 1)->dtype)); return 1; }
static int l_offset(lua_State *L) { lua_pushnumber(L, (lua_Number)lunar_lua_check_tensor_raw(L, 1)->offset); return 1; }

static int l_device(lua_State *L) {
    char buf[32];
    lunar_device_format(lunar_tensor_device(lunar_lua_check_tensor_raw(L, 1)), buf, sizeof buf);
    lua_pushstring(L, buf);
    return 1;
}

static int l_is_contiguous(lua_State *L) {
    lua_pushboolean(L, lunar_tensor_is_contiguous(lunar_lua_check_tensor_raw(L, 1)));
    return 1;
}

static int l_name(lua_State *L) {
    lunar_tensor *t = lunar_lua_check_tensor_raw(L, 1);
    if (t->name[0]) lua_pushstring(L, t->name);
    else lua_pushnil(L);
    return 1;
}

static int l_set_name(lua_State *L) {
    lunar_tensor *t = lunar_lua_check_tensor_raw(L, 1);
    lunar_tensor_set_name(t, luaL_optstring(L, 2, ""));
    lua_settop(L, 1);
    return 1;
}

/* t:is_valid() -> true | false, reason */
static int l_is_valid(lua_State *L) {
    lunar_tensor *t = lunar_lua_check_tensor_raw(L, 1);
    lunar_ctx *ctx = lunar_lua_ctx(L);
    if (t->storage && lunar_tensor_check(ctx, t) == LUNAR_OK) {
        lua_pushboolean(L, 1);
        return 1;
    }
    lua_pushboolean(L, 0);
    lua_pushstring(L, t->storage ? lunar_ctx_error(ctx) : "no storage");
    return 2;
}

/* t:free(): frees the storage now (all views of it become invalid); idempotent */
static int l_free(lua_State *L) {
    lunar_tensor *t = lunar_lua_check_tensor_raw(L, 1);
    if (t->storage) lunar_storage_free(lunar_lua_ctx(L), t->storage);
    return 0;
}

static int l_gc(lua_State *L) {
    /* checked: the metatable is reachable from Lua, so __gc can be called on anything */
    lunar_tensor *t = lunar_lua_check_tensor_raw(L, 1);
    lunar_tensor_release(lunar_lua_ctx(L), t);
    return 0;
}

/* ---- views --------------------------------------------------------------------------------- */

/* The view functions below push an empty tensor userdata first and build the view in it. */
static int view_done(lua_State *L, lunar_status st) {
    lunar_lua_check_status(L, st);
    return 1;
}

/* bounds are checked here too, so the message speaks Lua's 1-based dims and positions */
static int l_narrow(lua_State *L) {
    lunar_tensor *t = lunar_lua_check_tensor(L, 1);
    int d = lunar_lua_check_dim(L, 2, t->ndim);
    int64_t start = check_index_arg(L, 3, "narrow: start"), len = check_index_arg(L, 4, "narrow: length");
    if (start < 1 || len < 0 || start - 1 > t->shape[d] || len > t->shape[d] - (start - 1)) {
        char sh[128];
        lunar_tensor_shape_str(t, sh, sizeof sh);
        lunar_lua_error(L, "narrow: start %lld, length %lld out of bounds for dim %d (size %lld) of '%s' %s "
                           "(positions are 1-based)",
                        (long long)start, (long long)len, d + 1, (long long)t->shape[d], lunar_tensor_label(t), sh);
    }
    lunar_tensor *v = lunar_lua_push_empty_tensor(L);
    return view_done(L, lunar_tensor_narrow(lunar_lua_ctx(L), v, t, d, start - 1, len));
}

static int l_select(lua_State *L) {
    lunar_tensor *t = lunar_lua_check_tensor(L, 1);
    int d = lunar_lua_check_dim(L, 2, t->ndim);
    int64_t idx = check_index_arg(L, 3, "select: index");
    if (idx == 0) lunar_lua_error(L, "select: index 0 (indices are 1-based; negative counts from the end)");
    if (idx > t->shape[d] || idx < -t->shape[d]) {
        char sh[128];
        lunar_tensor_shape_str(t, sh, sizeof sh);
        lunar_lua_error(L, "select: index %lld out of bounds for dim %d (size %lld) of '%s' %s", (long long)idx, d + 1,
                        (long long)t->shape[d], lunar_tensor_label(t), sh);
    }
    lunar_tensor *v = lunar_lua_push_empty_tensor(L);
    return view_done(L, lunar_tensor_select(lunar_lua_ctx(L), v, t, d, idx > 0 ? idx - 1 : idx));
}

static int l_transpose(lua_State *L) {
    lunar_tensor *t = lunar_lua_check_tensor(L, 1);
    int d0, d1;
    if (lua_isnoneornil(L, 2)) {
        if (t->ndim != 2) lunar_lua_error(L, "t(): expects a 2-dim tensor, got %d dims (use transpose(d1, d2))", t->ndim);
        d0 = 0;
        d1 = 1;
    } else {
        d0 = lunar_lua_check_dim(L, 2, t->ndim);
        d1 = lunar_lua_check_dim(L, 3, t->ndim);
    }
    lunar_tensor *v = lunar_lua_push_empty_tensor(L);
    return view_done(L, lunar_tensor_transpose(lunar_lua_ctx(L), v, t, d0, d1));
}

static int l_permute(lua_State *L) {
    lunar_tensor *t = lunar_lua_check_tensor(L, 1);
    int perm[LUNAR_MAX_DIMS];
    int n = 0;
    if (lua_istable(L, 2)) {
        n = (int)lua_objlen(L, 2);
        for (int i = 0; i < n && i < LUNAR_MAX_DIMS; i++) {
            lua_rawgeti(L, 2, i + 1);
            int d = (int)lua_tointeger(L, -1);
            lua_pop(L, 1);
            perm[i] = d > 0 ? d - 1 : d + t->ndim;
        }
    } else {
        n = lua_gettop(L) - 1;
        for (int i = 0; i < n && i < LUNAR_MAX_DIMS; i++) {
            int d = (int)luaL_checkinteger(L, i + 2);
            perm[i] = d > 0 ? d - 1 : d + t->ndim;
        }
    }
    if (n != t->ndim) lunar_lua_error(L, "permute: %d dims given for a %d-dim tensor", n, t->ndim);
    lunar_tensor *v = lunar_lua_push_empty_tensor(L);
    return view_done(L, lunar_tensor_permute(lunar_lua_ctx(L), v, t, perm));
}

static int l_view(lua_State *L) {
    lunar_tensor *t = lunar_lua_check_tensor(L, 1);
    int64_t shape[LUNAR_MAX_DIMS];
    int nd = lunar_lua_check_shape(L, 2, shape);
    lunar_tensor *v = lunar_lua_push_empty_tensor(L);
    return view_done(L, lunar_tensor_view(lunar_lua_ctx(L), v, t, nd, shape));
}

static int l_expand(lua_State *L) {
    lunar_tensor *t = lunar_lua_check_tensor(L, 1);
    int64_t shape[LUNAR_MAX_DIMS];
    int nd = lunar_lua_check_shape(L, 2, shape);
    lunar_tensor *v = lunar_lua_push_empty_tensor(L);
    return view_done(L, lunar_tensor_expand(lunar_lua_ctx(L), v, t, nd, shape));
}

static int l_unsqueeze(lua_State *L) {
    lunar_tensor *t = lunar_lua_check_tensor(L, 1);
    int64_t want = check_index_arg(L, 2, "unsqueeze: dim");
    if (want == 0 || want > t->ndim + 1 || want < -(t->ndim + 1))
        lunar_lua_error(L, "unsqueeze: dim %lld out of range for a %d-dim tensor (the new dim goes at 1..%d, or -%d..-1)",
                        (long long)want, t->ndim, t->ndim + 1, t->ndim + 1);
    int d = want > 0 ? (int)want - 1 : (int)(want + t->ndim + 1);
    lunar_tensor *v = lunar_lua_push_empty_tensor(L);
    return view_done(L, lunar_tensor_unsqueeze(lunar_lua_ctx(L), v, t, d));
}

static int l_squeeze(lua_State *L) {
    lunar_tensor *t = lunar_lua_check_tensor(L, 1);
    lunar_ctx *ctx = lunar_lua_ctx(L);
    if (!lua_isnoneornil(L, 2)) {
        int d = lunar_lua_check_dim(L, 2, t->ndim);
        lunar_tensor *v = lunar_lua_push_empty_tensor(L);
        return view_done(L, lunar_tensor_squeeze(ctx, v, t, d));
    }
    lunar_tensor *v = lunar_lua_push_empty_tensor(L);
    lunar_tensor_share(v, t);
    int o = 0;
    for (int i = 0; i < t->ndim; i++) {
        if (t->shape[i] == 1) continue;
        v->shape[o] = t->shape[i];
        v->stride[o] = t->stride[i];
        o++;
    }
    v->ndim = o;
    return 1;
}

/* ---- copies -------------------------------------------------------------------------------- */

/* t:copy_(src): copies src (broadcast, cast, across devices) into t; returns t */
static int l_copy_(lua_State *L) {
    lunar_tensor *t = lunar_lua_check_tensor(L, 1);
    lunar_tensor *s = lunar_lua_check_tensor(L, 2);
    lunar_lua_check_status(L, lunar_copy(lunar_lua_ctx(L), t, s));
    lua_settop(L, 1);
    return 1;
}

static int l_copy_saturate_(lua_State *L) {
    lunar_tensor *t = lunar_lua_check_tensor(L, 1);
    lunar_tensor *s = lunar_lua_check_tensor(L, 2);
    lunar_lua_check_status(L, lunar_copy_saturate(lunar_lua_ctx(L), t, s));
    lua_settop(L, 1);
    return 1;
}

static int l_fill_(lua_State *L) {
    lunar_tensor *t = lunar_lua_check_tensor(L, 1);
    double v = lua_isboolean(L, 2) ? (double)lua_toboolean(L, 2) : luaL_checknumber(L, 2);
    lunar_lua_check_status(L, lunar_fill(lunar_lua_ctx(L), t, v));
    lua_settop(L, 1);
    return 1;
}

static int l_arange_(lua_State *L) {
    lunar_tensor *t = lunar_lua_check_tensor(L, 1);
    lunar_lua_check_status(L, lunar_arange(lunar_lua_ctx(L), t, luaL_optnumber(L, 2, 0), luaL_optnumber(L, 3, 1)));
    lua_settop(L, 1);
    return 1;
}

/* core.convert(t, dtype, device): a new contiguous tensor with the given dtype and device */
static int l_convert(lua_State *L) {
    lunar_tensor *t = lunar_lua_check_tensor(L, 1);
    lunar_dtype dt = lunar_lua_opt_dtype(L, 2, t->dtype);
    lunar_device dev = lunar_lua_opt_device(L, 3, lunar_tensor_device(t));
    int64_t shape[LUNAR_MAX_DIMS];
    memcpy(shape, t->shape, sizeof shape);
    char name[LUNAR_NAME_MAX];
    memcpy(name, t->name, sizeof name);
    lunar_tensor *out = lunar_lua_new_tensor(L, dt, dev, t->ndim, shape);
    lunar_tensor_set_name(out, name);
    lunar_lua_check_status(L, lunar_copy(lunar_lua_ctx(L), out, t));
    return 1;
}

/* ---- element access (slow path: debugging, printing, tests) -------------------------------- */


static int64_t element_offset(lua_State *L, lunar_tensor *t, int first_arg, int nidx) {
    if (nidx != t->ndim) lunar_lua_error(L, "expected %d indices for a %d-dim tensor, got %d", t->ndim, t->ndim, nidx);
    int64_t off = t->offset;
    for (int i = 0; i < nidx; i++) {
        int64_t k = check_index_arg(L, first_arg + i, "index");
        if (k < 0) k += t->shape[i] + 1;
        if (k < 1 || k > t->shape[i])
            lunar_lua_error(L, "index %lld out of range for dim %d of size %lld (indices are 1-based)",
                            (long long)luaL_checknumber(L, first_arg + i), i + 1, (long long)t->shape[i]);
        off += (k - 1) * t->stride[i];
    }
    return off;
}

static int read_element(lua_State *L, lunar_tensor *t, int64_t off, double *out) {
    lunar_ctx *ctx = lunar_lua_ctx(L);
    size_t es = lunar_dtype_size(t->dtype);
    unsigned char buf[8];
    const char *base = (const char *)t->storage->data + off * (int64_t)es;
    if (lunar_device_is_host(t->storage->device)) {
        memcpy(buf, base, es);
    } else {
        const lunar_backend *be = lunar_ctx_backend(ctx, t->storage->device.type);
        lunar_lua_check_status(L, be->copy_to_host(ctx, t->storage->device.index, buf, base, es));
        lunar_ctx_count_transfer(ctx, 1, es);
    }
    if (t->dtype == LUNAR_DTYPE_I64) {
        int64_t v;
        memcpy(&v, buf, 8);
        *out = (double)v;
    } else {
        *out = lunar_dtype_load(t->dtype, buf);
    }
    return 0;
}

/* t:get(i, j, ...) -> number */
static int l_get(lua_State *L) {
    lunar_tensor *t = lunar_lua_check_tensor(L, 1);
    int64_t off = element_offset(L, t, 2, lua_gettop(L) - 1);
    double v;
    read_element(L, t, off, &v);
    if (t->dtype == LUNAR_DTYPE_BOOL) lua_pushboolean(L, v != 0);
    else lua_pushnumber(L, v);
    return 1;
}

/* t:set(i, j, ..., value) */
static int l_set(lua_State *L) {
    lunar_tensor *t = lunar_lua_check_tensor(L, 1);
    int top = lua_gettop(L);
    double v = lua_isboolean(L, top) ? (double)lua_toboolean(L, top) : luaL_checknumber(L, top);
    int64_t off = element_offset(L, t, 2, top - 2);
    double lo, hi;
    const char *why = int_store_range(t->dtype, &lo, &hi) ? int_misfit(v, lo, hi) : NULL;
    if (why) lunar_lua_error(L, "set: %.17g is %s for %s '%s'", v, why, lunar_dtype_name(t->dtype), lunar_tensor_label(t));
    lunar_ctx *ctx = lunar_lua_ctx(L);
    size_t es = lunar_dtype_size(t->dtype);
    unsigned char buf[8];
    lunar_dtype_store(t->dtype, buf, v);
    char *base = (char *)t->storage->data + off * (int64_t)es;
    if (lunar_device_is_host(t->storage->device)) {
        memcpy(base, buf, es);
    } else {
        const lunar_backend *be = lunar_ctx_backend(ctx, t->storage->device.type);
        lunar_lua_check_status(L, be->copy_from_host(ctx, t->storage->device.index, base, buf, es));
        lunar_ctx_count_transfer(ctx, 0, es);
    }
    lua_settop(L, 1);
    return 1;
}

/* t:item() -> the only element */
static int l_item(lua_State *L) {
    lunar_tensor *t = lunar_lua_check_tensor(L, 1);
    if (lunar_tensor_numel(t) != 1) {
        char sh[128];
        lunar_tensor_shape_str(t, sh, sizeof sh);
        lunar_lua_error(L, "item: tensor '%s' %s has %lld elements, not 1", lunar_tensor_label(t), sh,
                        (long long)lunar_tensor_numel(t));
    }
    double v;
    read_element(L, t, t->offset, &v);
    if (t->dtype == LUNAR_DTYPE_BOOL) lua_pushboolean(L, v != 0);
    else lua_pushnumber(L, v);
    return 1;
}

/* t:tolist_flat() -> {v1, v2, ...} in row-major order (copies to the host first) */
static int l_tolist_flat(lua_State *L) {
    lunar_tensor *t = lunar_lua_check_tensor(L, 1);
    lunar_ctx *ctx = lunar_lua_ctx(L);
    int64_t n = lunar_tensor_numel(t);
    lunar_dtype hdt = t->dtype == LUNAR_DTYPE_I64 ? LUNAR_DTYPE_I64 : LUNAR_DTYPE_F64;
    lunar_tensor h = {0};
    lunar_status st = lunar_tensor_new(ctx, &h, hdt, CPU, t->ndim, t->shape);
    if (st == LUNAR_OK) st = lunar_copy(ctx, &h, t);
    if (st != LUNAR_OK) {
        lunar_tensor_release(ctx, &h);
        return lunar_lua_check_status(L, st);
    }
    lua_createtable(L, (int)n, 0);
    for (int64_t i = 0; i < n; i++) {
        if (hdt == LUNAR_DTYPE_I64) lua_pushnumber(L, (lua_Number)((int64_t *)lunar_tensor_data(&h))[i]);
        else lua_pushnumber(L, ((double *)lunar_tensor_data(&h))[i]);
        lua_rawseti(L, -2, (int)(i + 1));
    }
    lunar_tensor_release(ctx, &h);
    return 1;
}

/* core.same_storage(a, b) -> bool (views of one storage) */
static int l_same_storage(lua_State *L) {
    lunar_tensor *a = lunar_lua_check_tensor_raw(L, 1), *b = lunar_lua_check_tensor_raw(L, 2);
    lua_pushboolean(L, a->storage && a->storage == b->storage);
    return 1;
}

/* core.broadcast_shape(a, b) -> {sizes} */
static int l_broadcast_shape(lua_State *L) {
    lunar_tensor *a = lunar_lua_check_tensor(L, 1), *b = lunar_lua_check_tensor(L, 2);
    int nd;
    int64_t shape[LUNAR_MAX_DIMS];
    lunar_lua_check_status(L, lunar_broadcast_shape(lunar_lua_ctx(L), a, b, &nd, shape));
    lua_createtable(L, nd, 0);
    for (int i = 0; i < nd; i++) {
        lua_pushnumber(L, (lua_Number)shape[i]);
        lua_rawseti(L, -2, i + 1);
    }
    return 1;
}

/* ---- scopes -------------------------------------------------------------------------------- */

static int l_scope_push(lua_State *L) {
    lunar_lua_check_status(L, lunar_scope_push(lunar_lua_ctx(L)));
    return 0;
}

static int l_scope_pop(lua_State *L) {
    lunar_scope_pop(lunar_lua_ctx(L));
    return 0;
}

static int l_scope_keep(lua_State *L) {
    lunar_tensor *t = lunar_lua_check_tensor_raw(L, 1);
    if (t->storage) lunar_scope_keep(lunar_lua_ctx(L), t->storage);
    return 0;
}

/* core.persist(t): t's storage is no longer freed by the open scopes; returns t */
static int l_persist(lua_State *L) {
    lunar_tensor *t = lunar_lua_check_tensor_raw(L, 1);
    if (t->storage) lunar_scope_untrack(lunar_lua_ctx(L), t->storage);
    lua_settop(L, 1);
    return 1;
}

static int l_scope_depth(lua_State *L) {
    lua_pushinteger(L, lunar_scope_depth(lunar_lua_ctx(L)));
    return 1;
}

/* ---- runtime info -------------------------------------------------------------------------- */

static int l_threads(lua_State *L) {
    lunar_ctx *ctx = lunar_lua_ctx(L);
    if (!lua_isnoneornil(L, 1)) lunar_ctx_set_threads(ctx, (int)luaL_checkinteger(L, 1));
    lua_pushinteger(L, lunar_ctx_threads(ctx));
    return 1;
}

static int l_device_count(lua_State *L) {
    const char *type = luaL_optstring(L, 1, "cuda");
    lunar_ctx *ctx = lunar_lua_ctx(L);
    int count = 0;
    if (strcmp(type, "cpu") == 0) {
        count = lunar_ctx_cpu_device_count(ctx);   /* 1 + the debug devices (ctx.h) */
    } else if (strcmp(type, "cuda") == 0) {
        const lunar_backend *be = lunar_ctx_backend(ctx, LUNAR_DEVICE_CUDA);
        if (be) lunar_lua_check_status(L, be->device_count(ctx, &count));
    } else {
        lunar_lua_error(L, "device_count: unknown device type '%s'", type);
    }
    lua_pushinteger(L, count);
    return 1;
}

static int l_cuda_built(lua_State *L) {
    lua_pushboolean(L, lunar_ctx_backend(lunar_lua_ctx(L), LUNAR_DEVICE_CUDA) != NULL);
    return 1;
}

/* core.cuda_status() -> available, message: "N CUDA device(s)", or "CUDA is not available: "
 * and why (a build without CUDA, or the CUDA runtime's error) */
static int l_cuda_status(lua_State *L) {
    char buf[512];
    int n = lunar_ctx_cuda_status(lunar_lua_ctx(L), buf, sizeof buf);
    lua_pushboolean(L, n > 0);
    lua_pushstring(L, buf);
    return 2;
}

static int l_pool_stats(lua_State *L) {
    lunar_ctx *ctx = lunar_lua_ctx(L);
    lunar_device dev = lunar_lua_opt_device(L, 1, CPU);
    lunar_pool *p;
    lunar_lua_check_status(L, lunar_ctx_pool(ctx, dev, &p));
    lunar_pool_stats s = lunar_pool_stats_get(p);
    lua_createtable(L, 0, 5);
    lua_pushnumber(L, (lua_Number)s.in_use); lua_setfield(L, -2, "in_use");
    lua_pushnumber(L, (lua_Number)s.cached); lua_setfield(L, -2, "cached");
    lua_pushnumber(L, (lua_Number)s.peak_in_use); lua_setfield(L, -2, "peak_in_use");
    lua_pushnumber(L, (lua_Number)s.allocs); lua_setfield(L, -2, "allocs");
    lua_pushnumber(L, (lua_Number)s.reuses); lua_setfield(L, -2, "reuses");
    return 1;
}

static int l_pool_trim(lua_State *L) {
    lunar_ctx *ctx = lunar_lua_ctx(L);
    lunar_pool *p;
    lunar_lua_check_status(L, lunar_ctx_pool(ctx, lunar_lua_opt_device(L, 1, CPU), &p));
    lunar_pool_trim(ctx, p);
    return 0;
}

/* core.device_name(s) -> the canonical name of device s ("cpu:0" -> "cpu", "cuda" -> "cuda:N"
 * with N the default CUDA device), as t:device() gives it */
static int l_device_name(lua_State *L) {
    char buf[32];
    lunar_device_format(lunar_lua_opt_device(L, 1, CPU), buf, sizeof buf);
    lua_pushstring(L, buf);
    return 1;
}

/* core.transfer_stats() -> {to_host=, from_host=, to_host_bytes=, from_host_bytes=} (ctx.h) */
static int l_transfer_stats(lua_State *L) {
    lunar_transfer_stats s = lunar_ctx_transfer_stats(lunar_lua_ctx(L));
    lua_createtable(L, 0, 4);
    lua_pushnumber(L, (lua_Number)s.to_host); lua_setfield(L, -2, "to_host");
    lua_pushnumber(L, (lua_Number)s.from_host); lua_setfield(L, -2, "from_host");
    lua_pushnumber(L, (lua_Number)s.to_host_bytes); lua_setfield(L, -2, "to_host_bytes");
    lua_pushnumber(L, (lua_Number)s.from_host_bytes); lua_setfield(L, -2, "from_host_bytes");
    return 1;
}

static int l_synchronize(lua_State *L) {
    lunar_lua_check_status(L, lunar_synchronize(lunar_lua_ctx(L), lunar_lua_opt_device(L, 1, CPU)));
    return 0;
}

/* core.sync_check(device): the device's check point (ops.h): raises the first bad index value
 * that an op on it met since the last check */
static int l_sync_check(lua_State *L) {
    lunar_lua_check_status(L, lunar_sync_check(lunar_lua_ctx(L), lunar_lua_opt_device(L, 1, CPU)));
    return 0;
}

/* core.check_each_op([on]) -> whether every index op on a device is followed by its check point
 * (ctx.h); sets it when on is given */
static int l_check_each_op(lua_State *L) {
    lunar_ctx *ctx = lunar_lua_ctx(L);
    if (!lua_isnoneornil(L, 1)) lunar_ctx_set_check_each_op(ctx, lua_toboolean(L, 1));
    lua_pushboolean(L, lunar_ctx_check_each_op(ctx));
    return 1;
}

/* core.user_where() -> "file:line: " of the calling user code */
static int l_user_where(lua_State *L) {
    char buf[512];
    lunar_lua_user_where(L, buf, sizeof buf);
    lua_pushstring(L, buf);
    return 1;
}

static const luaL_Reg tensor_methods[] = {
    {"size", l_size}, {"stride", l_stride}, {"dim", l_dim}, {"numel", l_numel}, {"dtype", l_dtype},
    {"device", l_device}, {"storage_offset", l_offset}, {"is_contiguous", l_is_contiguous},
    {"name", l_name}, {"set_name", l_set_name}, {"is_valid", l_is_valid}, {"free", l_free},
    {"narrow", l_narrow}, {"select", l_select}, {"transpose", l_transpose}, {"permute", l_permute},
    {"view", l_view}, {"expand", l_expand}, {"unsqueeze", l_unsqueeze}, {"squeeze", l_squeeze},
    {"copy_", l_copy_}, {"copy_saturate_", l_copy_saturate_}, {"fill_", l_fill_}, {"arange_", l_arange_},
    {"get", l_get}, {"set", l_set}, {"item", l_item}, {"tolist_flat", l_tolist_flat},
    {NULL, NULL},
};

static const luaL_Reg core_funcs[] = {
    {"empty", l_empty}, {"from_flat", l_from_flat}, {"convert", l_convert},
    {"same_storage", l_same_storage}, {"broadcast_shape", l_broadcast_shape},
    {"scope_push", l_scope_push}, {"scope_pop", l_scope_pop}, {"scope_keep", l_scope_keep},
    {"scope_depth", l_scope_depth}, {"persist", l_persist}, {"threads", l_threads}, {"device_count", l_device_count},
    {"cuda_built", l_cuda_built}, {"cuda_status", l_cuda_status}, {"pool_stats", l_pool_stats}, {"transfer_stats", l_transfer_stats},
    {"device_name", l_device_name}, {"pool_trim", l_pool_trim},
    {"synchronize", l_synchronize}, {"sync_check", l_sync_check}, {"check_each_op", l_check_each_op},
    {"user_where", l_user_where},
    {NULL, NULL},
};

void lunar_lua_open_tensor(lua_State *L) {
    /* core table is on top */
    luaL_newmetatable(L, LUNAR_TENSOR_MT);
    lua_pushcfunction(L, l_gc);
    lua_setfield(L, -2, "__gc");
    lua_newtable(L);                         /* methods, extended from Lua (lunar/tensor.lua) */
    lunar_lua_setfuncs(L, tensor_methods);
    lua_pushvalue(L, -1);
    lua_setfield(L, -3, "__index");
    lua_setfield(L, -3, "tensor_methods");   /* core.tensor_methods */
    lua_setfield(L, -2, "tensor_mt");        /* core.tensor_mt */
    lunar_lua_setfuncs(L, core_funcs);
}
