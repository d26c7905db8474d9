/* lua_lunar.h: helpers shared by the Lua bindings (host/lua/).
 *
 * Objects that own memory are full userdata with a metatable, type-checked on every call. A
 * tensor userdata holds a lunar_tensor by value (a view: its __gc drops one storage reference).
 * Bindings raise Lua errors only at their end, after releasing what they hold (LÖVE's rule), via
 * lunar_lua_fail(), which prefixes the message with the first calling line outside lunar's own
 * Lua library, so the error points at the recipe or REPL line.
 */
#ifndef LUNAR_LUA_LUNAR_H
#define LUNAR_LUA_LUNAR_H

#include <lauxlib.h>
#include <lua.h>

#include "lunar/ctx.h"
#include "lunar/rng.h"
#include "lunar/tensor.h"

#define LUNAR_TENSOR_MT "lunar.Tensor"
#define LUNAR_ARENA_MT  "lunar.Arena"
#define LUNAR_RNG_MT    "lunar.Rng"

/* chunk names of lunar's own Lua modules start with this, so errors can skip their frames */
#define LUNAR_LIB_CHUNK_PREFIX "@lunar:"

typedef struct lunar_lua_tensor { lunar_tensor t; } lunar_lua_tensor;
typedef struct lunar_lua_arena { lunar_arena *a; } lunar_lua_arena;
typedef struct lunar_lua_rng { lunar_rng r; } lunar_lua_rng;

/* the context stored in the registry by lunar_vm_new */
lunar_ctx *lunar_lua_ctx(lua_State *L);
void       lunar_lua_set_ctx(lua_State *L, lunar_ctx *ctx);

/* "file:line: " of the innermost Lua frame that is not part of lunar's library ("" if none) */
void lunar_lua_user_where(lua_State *L, char *buf, size_t n);
/* Raise a Lua error with the user location prefixed. Never returns. */
int  lunar_lua_error(lua_State *L, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* st != LUNAR_OK: raise the context's message. Returns 0 otherwise. */
int  lunar_lua_check_status(lua_State *L, lunar_status st);

/* The tensor at idx (raises for non-tensors and for freed or stale tensors, naming them). */
lunar_tensor *lunar_lua_check_tensor(lua_State *L, int idx);
/* The tensor at idx even if freed/stale (for :free(), :is_valid(), printing the name). */
lunar_tensor *lunar_lua_check_tensor_raw(lua_State *L, int idx);
lunar_tensor *lunar_lua_opt_tensor(lua_State *L, int idx);   /* nil -> NULL */
int           lunar_lua_is_tensor(lua_State *L, int idx);
/* Push a new tensor userdata holding an empty tensor and return it, for the caller to fill in.
 * Bindings create the userdata before the tensor takes a storage reference, so that a Lua error
 * (even a memory error from lua_newuserdata) never leaves a reference held only by C. */
lunar_tensor *lunar_lua_push_empty_tensor(lua_State *L);
/* A new tensor userdata; it is tracked by the innermost lunar.scope(). Raises on failure. */
lunar_tensor *lunar_lua_new_tensor(lua_State *L, lunar_dtype dt, lunar_device dev, int ndim, const int64_t *shape);

lunar_dtype   lunar_lua_check_dtype(lua_State *L, int idx);
lunar_dtype   lunar_lua_opt_dtype(lua_State *L, int idx, lunar_dtype def);
lunar_device  lunar_lua_opt_device(lua_State *L, int idx, lunar_device def);
/* Shape from a table {2, 3} or from the integer arguments starting at idx; returns ndim. */
int           lunar_lua_check_shape(lua_State *L, int idx, int64_t *shape);
/* A 1-based Lua dim (negative counts from the end) to a 0-based C dim for a tensor of ndim. */
int           lunar_lua_check_dim(lua_State *L, int idx, int ndim);

lunar_rng    *lunar_lua_check_rng(lua_State *L, int idx);

/* lua_setfuncs for LuaJIT (Lua 5.1 API) */
void lunar_lua_setfuncs(lua_State *L, const luaL_Reg *l);

/* area registration: each adds its functions to the table on top of the stack */
void lunar_lua_open_tensor(lua_State *L);
void lunar_lua_open_arena(lua_State *L);
void lunar_lua_open_rng(lua_State *L);
void lunar_lua_open_ops(lua_State *L);
void lunar_lua_open_dist(lua_State *L);
void lunar_lua_open_io(lua_State *L);
void lunar_lua_open_fs(lua_State *L);   /* core.fs and core.tb (lua_fs.c) */
void lunar_lua_open_data(lua_State *L);
void lunar_lua_open_tokenizer(lua_State *L);
void lunar_lua_open_signal(lua_State *L);   /* core.signal: a graceful stop on SIGTERM / SIGINT */

/* Process-level hooks of lunar.dist used by main.c: rank and world size as launched (from the
 * launcher's environment, before or without MPI init), a clean shutdown, and the abort that ends
 * every rank after a fatal error on one of them. */
int  lunar_dist_env_rank(void);
int  lunar_dist_env_size(void);
void lunar_dist_finalize(void);
void lunar_dist_abort(int code);

#endif
