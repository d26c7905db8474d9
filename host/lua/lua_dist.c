/* lua_dist.c: bindings of the collectives (lunar/comm.h) as core.dist, the group userdata, and
 * the process hooks main.c uses (rank prefix, abort, finalize).
 *
 * core.dist.init() -> world group (made once; kept in the registry, so it lives as long as the VM)
 * core.dist.split(parent, color, key, name) -> group
 * core.dist.all_reduce(g, t, op) / all_gather(g, out, in) / reduce_scatter(g, out, in, op) /
 *   broadcast(g, t, root) / all_to_all(g, out, in, send_rows, recv_rows) / send(g, t, dst) /
 *   recv(g, t, src) / send_recv(g, recv, src, send, dst) / barrier(g)
 * core.dist.all_reduce_start(g, t, op) / reduce_scatter_start(g, out, in, counts, op) -> request;
 *   request:wait(), request:test() -> finished (a request not waited for is waited for when it
 *   is collected, so MPI never writes into freed memory)
 * Ranks are 0-based; the friendly API is lua/lunar/dist.lua.
 */
#include <stdlib.h>
#include <string.h>

#include "lua_lunar.h"
#include "lunar/backend.h"
#include "lunar/comm.h"

#define LUNAR_COMM_MT "lunar.Comm"
#define LUNAR_REQUEST_MT "lunar.CommRequest"
#define WORLD_KEY     "lunar.dist.world"

typedef struct lunar_lua_comm { lunar_comm *c; } lunar_lua_comm;

/* ---- process hooks (main.c) ----------------------------------------------------------------- */

int lunar_dist_env_rank(void) { return lunar_comm_env_rank(); }
int lunar_dist_env_size(void) { return lunar_comm_env_size(); }
void lunar_dist_finalize(void) { lunar_comm_finalize(); }

/* An error on one rank must end the whole job. With MPI up, MPI_Abort does it. When this rank
 * failed before lunar.dist was initialised, returning is enough: the rank exits non-zero before
 * ever entering MPI, and the launcher (mpirun) then terminates the job, including ranks that
 * wait in MPI_Init or in a collective. */
void lunar_dist_abort(int code) { lunar_comm_abort(code); }

/* ---- group userdata ------------------------------------------------------------------------- */

static lunar_comm *check_comm(lua_State *L, int idx) {
    lunar_lua_comm *u = luaL_checkudata(L, idx, LUNAR_COMM_MT);
    if (!u->c) lunar_lua_error(L, "group used after it was freed");
    return u->c;
}

/* An empty group userdata for the caller to fill in: it exists before the group does, so no Lua
 * error can leave a group held only by C. */
static lunar_comm **push_comm_slot(lua_State *L) {
    lunar_lua_comm *u = lua_newuserdata(L, sizeof *u);
    u->c = NULL;
    luaL_getmetatable(L, LUNAR_COMM_MT);
    lua_setmetatable(L, -2);
    return &u->c;
}

static int l_comm_gc(lua_State *L) {
    lunar_lua_comm *u = luaL_checkudata(L, 1, LUNAR_COMM_MT);
    if (u->c) lunar_comm_free(lunar_lua_ctx(L), u->c);
    u->c = NULL;
    return 0;
}

static int l_comm_rank(lua_State *L) { lua_pushinteger(L, lunar_comm_rank(check_comm(L, 1))); return 1; }
static int l_comm_size(lua_State *L) { lua_pushinteger(L, lunar_comm_size(check_comm(L, 1))); return 1; }
static int l_comm_name(lua_State *L) { lua_pushstring(L, lunar_comm_name(check_comm(L, 1))); return 1; }
static int l_comm_local_rank(lua_State *L) { lua_pushinteger(L, lunar_comm_local_rank(check_comm(L, 1))); return 1; }
static int l_comm_uses_mpi(lua_State *L) { lua_pushboolean(L, lunar_comm_uses_mpi(check_comm(L, 1))); return 1; }
static int l_comm_uses_nccl(lua_State *L) { lua_pushboolean(L, lunar_comm_uses_nccl(check_comm(L, 1))); return 1; }

/* g:ranks() -> {world rank of member 0, ...} */
static int l_comm_ranks(lua_State *L) {
    lunar_comm *c = check_comm(L, 1);
    int n = lunar_comm_size(c);
    const int *r = lunar_comm_world_ranks(c);
    lua_createtable(L, n, 0);
    for (int i = 0; i < n; i++) {
        lua_pushinteger(L, r[i]);
        lua_rawseti(L, -2, i + 1);
    }
    return 1;
}

/* g:checks([on]) -> whether cross-rank signature checks run (sets them when on is given) */
static int l_comm_checks(lua_State *L) {
    lunar_comm *c = check_comm(L, 1);
    if (!lua_isnoneornil(L, 2)) lunar_comm_set_checks(c, lua_toboolean(L, 2));
    lua_pushboolean(L, lunar_comm_checks(c));
    return 1;
}

/* g:nccl_init(device_index): make the group's NCCL communicator now (collective); on a group of
 * one, CUDA collectives then go through NCCL instead of local copies */
static int l_comm_nccl_init(lua_State *L) {
    lunar_comm *c = check_comm(L, 1);
    int dev = (int)luaL_optinteger(L, 2, lunar_ctx_default_cuda_device(lunar_lua_ctx(L)));
    lunar_lua_check_status(L, lunar_comm_nccl_init(lunar_lua_ctx(L), c, dev));
    return 0;
}

static int l_comm_tostring(lua_State *L) {
    lunar_lua_comm *u = luaL_checkudata(L, 1, LUNAR_COMM_MT);
    if (!u->c) lua_pushstring(L, "group (freed)");
    else lua_pushfstring(L, "group '%s' (rank %d of %d)", lunar_comm_name(u->c), lunar_comm_rank(u->c), lunar_comm_size(u->c));
    return 1;
}

/* ---- core.dist ------------------------------------------------------------------------------ */

static void set_default_cuda(lua_State *L, lunar_comm *world) {
    lunar_ctx *ctx = lunar_lua_ctx(L);
    const lunar_backend *be = lunar_ctx_backend(ctx, LUNAR_DEVICE_CUDA);
    int count = 0;
    if (!be || be->device_count(ctx, &count) != LUNAR_OK) {
        lunar_ctx_clear_error(ctx);
        return;
    }
    if (count > 0) lunar_ctx_set_default_cuda_device(ctx, lunar_comm_local_rank(world) % count);
}

static int l_init(lua_State *L) {
    lua_getfield(L, LUA_REGISTRYINDEX, WORLD_KEY);
    if (!lua_isnil(L, -1)) return 1;
    lua_pop(L, 1);
    lunar_comm **world = push_comm_slot(L);
    lunar_lua_check_status(L, lunar_comm_init_world(lunar_lua_ctx(L), world));
    lua_pushvalue(L, -1);
    lua_setfield(L, LUA_REGISTRYINDEX, WORLD_KEY);
    set_default_cuda(L, *world);
    return 1;
}

static int l_is_initialized(lua_State *L) {
    lua_getfield(L, LUA_REGISTRYINDEX, WORLD_KEY);
    lua_pushboolean(L, !lua_isnil(L, -1));
    return 1;
}

/* the launcher's view, without initialising anything */
static int l_env(lua_State *L) {
    lua_createtable(L, 0, 4);
    lua_pushboolean(L, lunar_comm_env_launched());
    lua_setfield(L, -2, "launched");
    lua_pushinteger(L, lunar_comm_env_rank());
    lua_setfield(L, -2, "rank");
    lua_pushinteger(L, lunar_comm_env_size());
    lua_setfield(L, -2, "size");
    lua_pushinteger(L, lunar_comm_env_local_rank());
    lua_setfield(L, -2, "local_rank");
    return 1;
}

static int l_split(lua_State *L) {
    lunar_comm *parent = check_comm(L, 1);
    int color = (int)luaL_checkinteger(L, 2);
    int key = (int)luaL_checkinteger(L, 3);
    const char *name = luaL_optstring(L, 4, "group");
    lunar_comm **c = push_comm_slot(L);
    lunar_lua_check_status(L, lunar_comm_split(lunar_lua_ctx(L), c, parent, color, key, name));
    return 1;
}

static lunar_comm_op check_op(lua_State *L, int idx, const char *opname) {
    const char *s = luaL_optstring(L, idx, "sum");
    lunar_comm_op op;
    if (!lunar_comm_op_from_name(s, &op)) lunar_lua_error(L, "%s: unknown op '%s' (sum, avg, max, min)", opname, s);
    return op;
}

static int l_all_reduce(lua_State *L) {
    lunar_comm *c = check_comm(L, 1);
    lunar_tensor *t = lunar_lua_check_tensor(L, 2);
    lunar_comm_op op = check_op(L, 3, "all_reduce");
    lunar_lua_check_status(L, lunar_comm_all_reduce(lunar_lua_ctx(L), c, t, op));
    lua_settop(L, 2);
    return 1;
}

static int l_all_gather(lua_State *L) {
    lunar_comm *c = check_comm(L, 1);
    lunar_tensor *out = lunar_lua_check_tensor(L, 2);
    lunar_tensor *in = lunar_lua_check_tensor(L, 3);
    lunar_lua_check_status(L, lunar_comm_all_gather(lunar_lua_ctx(L), c, out, in));
    lua_settop(L, 2);
    return 1;
}

static int l_reduce_scatter(lua_State *L) {
    lunar_comm *c = check_comm(L, 1);
    lunar_tensor *out = lunar_lua_check_tensor(L, 2);
    lunar_tensor *in = lunar_lua_check_tensor(L, 3);
    lunar_comm_op op = check_op(L, 4, "reduce_scatter");
    lunar_lua_check_status(L, lunar_comm_reduce_scatter(lunar_lua_ctx(L), c, out, in, op));
    lua_settop(L, 2);
    return 1;
}

static int l_broadcast(lua_State *L) {
    lunar_comm *c = check_comm(L, 1);
    lunar_tensor *t = lunar_lua_check_tensor(L, 2);
    int root = (int)luaL_optinteger(L, 3, 0);
    lunar_lua_check_status(L, lunar_comm_broadcast(lunar_lua_ctx(L), c, t, root));
    lua_settop(L, 2);
    return 1;
}

/* A Lua array of row counts, one per member, into scratch memory owned by a userdata (so a
 * later Lua error cannot leak it). */
static int64_t *check_counts(lua_State *L, int idx, int n, const char *what, const lunar_comm *c, const char *fname) {
    luaL_checktype(L, idx, LUA_TTABLE);
    int len = (int)lua_objlen(L, idx);
    if (len != n)
        lunar_lua_error(L, "%s: %s has %d entries, group '%s' has %d ranks", fname, what, len, lunar_comm_name(c), n);
    int64_t *v = lua_newuserdata(L, (size_t)(n > 0 ? n : 1) * sizeof *v);
    for (int i = 0; i < n; i++) {
        lua_rawgeti(L, idx, i + 1);
        if (lua_type(L, -1) != LUA_TNUMBER)
            lunar_lua_error(L, "%s: %s[%d] is a %s, not a count", fname, what, i + 1, luaL_typename(L, -1));
        double x = lua_tonumber(L, -1);
        if (!(x >= 0 && x < 9.0e15) || x != (double)(int64_t)x)
            lunar_lua_error(L, "%s: %s[%d] is %g, not a count", fname, what, i + 1, x);
        v[i] = (int64_t)x;
        lua_pop(L, 1);
    }
    return v;
}

static int l_all_to_all(lua_State *L) {
    lunar_comm *c = check_comm(L, 1);
    lunar_tensor *out = lunar_lua_check_tensor(L, 2);
    lunar_tensor *in = lunar_lua_check_tensor(L, 3);
    int n = lunar_comm_size(c);
    int64_t *send = check_counts(L, 4, n, "send_splits", c, "all_to_all");
    int64_t *recv = check_counts(L, 5, n, "recv_splits", c, "all_to_all");
    lunar_lua_check_status(L, lunar_comm_all_to_all(lunar_lua_ctx(L), c, out, in, send, recv));
    lua_settop(L, 2);
    return 1;
}

static int l_send(lua_State *L) {
    lunar_comm *c = check_comm(L, 1);
    lunar_tensor *t = lunar_lua_check_tensor(L, 2);
    int dst = (int)luaL_checkinteger(L, 3);
    lunar_lua_check_status(L, lunar_comm_send(lunar_lua_ctx(L), c, t, dst));
    return 0;
}

static int l_recv(lua_State *L) {
    lunar_comm *c = check_comm(L, 1);
    lunar_tensor *t = lunar_lua_check_tensor(L, 2);
    int src = (int)luaL_checkinteger(L, 3);
    lunar_lua_check_status(L, lunar_comm_recv(lunar_lua_ctx(L), c, t, src));
    lua_settop(L, 2);
    return 1;
}

static int l_send_recv(lua_State *L) {
    lunar_comm *c = check_comm(L, 1);
    lunar_tensor *recv = lunar_lua_check_tensor(L, 2);
    int src = (int)luaL_checkinteger(L, 3);
    lunar_tensor *send = lunar_lua_check_tensor(L, 4);
    int dst = (int)luaL_checkinteger(L, 5);
    lunar_lua_check_status(L, lunar_comm_send_recv(lunar_lua_ctx(L), c, recv, src, send, dst));
    lua_settop(L, 2);
    return 1;
}

/* ---- non-blocking collectives ----------------------------------------------------------------- */

typedef struct lunar_lua_request { lunar_comm_request *r; } lunar_lua_request;

static lunar_comm_request **push_request_slot(lua_State *L) {
    lunar_lua_request *u = lua_newuserdata(L, sizeof *u);
    u->r = NULL;
    luaL_getmetatable(L, LUNAR_REQUEST_MT);
    lua_setmetatable(L, -2);
    return &u->r;
}

static int l_request_gc(lua_State *L) {
    lunar_lua_request *u = luaL_checkudata(L, 1, LUNAR_REQUEST_MT);
    if (u->r) (void)lunar_comm_wait(lunar_lua_ctx(L), u->r);
    u->r = NULL;
    return 0;
}

/* request:wait(): finishes the operation (once; later calls do nothing) */
static int l_request_wait(lua_State *L) {
    lunar_lua_request *u = luaL_checkudata(L, 1, LUNAR_REQUEST_MT);
    lunar_comm_request *r = u->r;
    u->r = NULL;
    lunar_lua_check_status(L, lunar_comm_wait(lunar_lua_ctx(L), r));
    return 0;
}

/* request:test() -> true once the operation has finished (drives MPI's progress) */
static int l_request_test(lua_State *L) {
    lunar_lua_request *u = luaL_checkudata(L, 1, LUNAR_REQUEST_MT);
    int done = 1;
    if (u->r) lunar_lua_check_status(L, lunar_comm_test(lunar_lua_ctx(L), u->r, &done));
    lua_pushboolean(L, done);
    return 1;
}

static int l_all_reduce_start(lua_State *L) {
    lunar_comm *c = check_comm(L, 1);
    lunar_tensor *t = lunar_lua_check_tensor(L, 2);
    lunar_comm_op op = check_op(L, 3, "all_reduce_start");
    lunar_comm_request **slot = push_request_slot(L);
    lunar_lua_check_status(L, lunar_comm_all_reduce_start(lunar_lua_ctx(L), c, t, op, slot));
    return 1;
}

static int l_reduce_scatter_start(lua_State *L) {
    lunar_comm *c = check_comm(L, 1);
    lunar_tensor *out = lunar_lua_check_tensor(L, 2);
    lunar_tensor *in = lunar_lua_check_tensor(L, 3);
    int64_t *counts = check_counts(L, 4, lunar_comm_size(c), "counts", c, "reduce_scatter_start");
    lunar_comm_op op = check_op(L, 5, "reduce_scatter_start");
    lunar_comm_request **slot = push_request_slot(L);
    lunar_lua_check_status(L, lunar_comm_reduce_scatter_start(lunar_lua_ctx(L), c, out, in, counts, op, slot));
    return 1;
}

static int l_barrier(lua_State *L) {
    lunar_lua_check_status(L, lunar_comm_barrier(lunar_lua_ctx(L), check_comm(L, 1)));
    return 0;
}

static int l_finalize(lua_State *L) {
    (void)L;
    lunar_comm_finalize();
    return 0;
}

static int l_abort(lua_State *L) {
    lunar_comm_abort((int)luaL_optinteger(L, 1, 1));
    return 0;
}

static int l_mpi_active(lua_State *L) {
    lua_pushboolean(L, lunar_comm_mpi_active());
    return 1;
}

void lunar_lua_open_dist(lua_State *L) {
    static const luaL_Reg methods[] = {
        {"rank", l_comm_rank}, {"size", l_comm_size}, {"name", l_comm_name}, {"ranks", l_comm_ranks},
        {"local_rank", l_comm_local_rank}, {"uses_mpi", l_comm_uses_mpi}, {"uses_nccl", l_comm_uses_nccl},
        {"checks", l_comm_checks},
        {"nccl_init", l_comm_nccl_init}, {NULL, NULL},
    };
    static const luaL_Reg fns[] = {
        {"init", l_init}, {"is_initialized", l_is_initialized}, {"env", l_env}, {"split", l_split},
        {"all_reduce", l_all_reduce}, {"all_gather", l_all_gather}, {"reduce_scatter", l_reduce_scatter},
        {"broadcast", l_broadcast}, {"all_to_all", l_all_to_all}, {"send", l_send}, {"recv", l_recv},
        {"send_recv", l_send_recv}, {"barrier", l_barrier}, {"finalize", l_finalize}, {"abort", l_abort},
        {"mpi_active", l_mpi_active}, {"all_reduce_start", l_all_reduce_start},
        {"reduce_scatter_start", l_reduce_scatter_start}, {NULL, NULL},
    };
    static const luaL_Reg request_methods[] = {{"wait", l_request_wait}, {"test", l_request_test}, {NULL, NULL}};
    /* core table is on top */
    luaL_newmetatable(L, LUNAR_REQUEST_MT);
    lua_pushcfunction(L, l_request_gc);
    lua_setfield(L, -2, "__gc");
    lua_newtable(L);
    lunar_lua_setfuncs(L, request_methods);
    lua_setfield(L, -2, "__index");
    lua_pop(L, 1);
    luaL_newmetatable(L, LUNAR_COMM_MT);
    lua_pushcfunction(L, l_comm_gc);
    lua_setfield(L, -2, "__gc");
    lua_pushcfunction(L, l_comm_tostring);
    lua_setfield(L, -2, "__tostring");
    lua_newtable(L);
    lunar_lua_setfuncs(L, methods);
    lua_pushvalue(L, -1);
    lua_setfield(L, -4, "group_methods");   /* core.group_methods: extended from lunar/dist.lua */
    lua_setfield(L, -2, "__index");
    lua_setfield(L, -2, "group_mt");        /* core.group_mt: to recognise groups */
    lua_newtable(L);
    lunar_lua_setfuncs(L, fns);
    lua_setfield(L, -2, "dist");
}
