/* lua_tokenizer.c: tokenizer bindings as core.tokenizer_load (the friendly API is
 * lua/lunar/tokenizer.lua).
 *
 * core.tokenizer_load(path) -> tokenizer userdata. Methods (ids are 0-based numbers):
 *   encode(text, no_special, as_tensor)          -> {ids} or a 1-D i64 tensor
 *   encode_batch(texts, no_special, mode)        -> mode 'table': {{ids}, ...}; 'tensor': {tensor, ...};
 *                                                   'flat': ids (i64), offsets (i64, n + 1)
 *   decode(ids, skip_special)                    -> string (raw bytes); ids: a table or a
 *                                                   contiguous CPU i64 tensor
 *   token_to_id(s) -> id or nil; id_to_token(id) -> string or nil; is_special(id)
 *   vocab_size(); added_tokens() -> {{id=, content=, special=, lstrip=, rstrip=, single_word=,
 *   normalized=}, ...} in id order; path(); free(); set_linear_max(n) (test hook)
 */
#include <stdlib.h>
#include <string.h>

#include "lua_lunar.h"
#include "lunar/tokenizer.h"

#define TOKENIZER_MT "lunar.Tokenizer"

typedef struct lua_tok { lunar_tokenizer *t; } lua_tok;

static lunar_tokenizer *check_tok(lua_State *L, int idx) {
    lua_tok *u = luaL_checkudata(L, idx, TOKENIZER_MT);
    if (!u->t) lunar_lua_error(L, "tokenizer used after free()");
    return u->t;
}

static int l_load(lua_State *L) {
    const char *path = luaL_checkstring(L, 1);
    lua_tok *u = lua_newuserdata(L, sizeof *u);
    u->t = NULL;
    luaL_getmetatable(L, TOKENIZER_MT);
    lua_setmetatable(L, -2);
    lunar_lua_check_status(L, lunar_tokenizer_load(lunar_lua_ctx(L), &u->t, path));
    return 1;
}

static int l_free(lua_State *L) {
    lua_tok *u = luaL_checkudata(L, 1, TOKENIZER_MT);
    lunar_tokenizer_free(u->t);
    u->t = NULL;
    return 0;
}

/* push ids[0..n) as a Lua array or a 1-D i64 tensor */
static void push_ids(lua_State *L, const int32_t *ids, size_t n, int as_tensor) {
    if (as_tensor) {
        int64_t shape[1] = {(int64_t)n};
        lunar_tensor *t = lunar_lua_new_tensor(L, LUNAR_DTYPE_I64, (lunar_device){LUNAR_DEVICE_CPU, 0}, 1, shape);
        int64_t *d = lunar_tensor_data(t);
        for (size_t i = 0; i < n; i++) d[i] = ids[i];
        return;
    }
    lua_createtable(L, (int)n, 0);
    for (size_t i = 0; i < n; i++) {
        lua_pushinteger(L, ids[i]);
        lua_rawseti(L, -2, (int)i + 1);
    }
}

static int l_encode(lua_State *L) {
    lunar_tokenizer *tok = check_tok(L, 1);
    size_t n;
    const char *text = luaL_checklstring(L, 2, &n);
    int flags = lua_toboolean(L, 3) ? LUNAR_TOK_NO_SPECIAL : 0;
    int as_tensor = lua_toboolean(L, 4);
    int32_t *ids;
    size_t n_ids;
    lunar_lua_check_status(L, lunar_tokenizer_encode(lunar_lua_ctx(L), tok, text, n, flags, &ids, &n_ids));
    /* a Lua error while pushing (out of memory) would leak ids: copy onto the Lua side first */
    int32_t *tmp = lua_newuserdata(L, (n_ids ? n_ids : 1) * sizeof *tmp);
    memcpy(tmp, ids, n_ids * sizeof *tmp);
    free(ids);
    push_ids(L, tmp, n_ids, as_tensor);
    return 1;
}

static int l_encode_batch(lua_State *L) {
    lunar_tokenizer *tok = check_tok(L, 1);
    luaL_checktype(L, 2, LUA_TTABLE);
    int flags = lua_toboolean(L, 3) ? LUNAR_TOK_NO_SPECIAL : 0;
    const char *mode = luaL_optstring(L, 4, "table");
    int m = strcmp(mode, "table") == 0 ? 0 : strcmp(mode, "tensor") == 0 ? 1 : strcmp(mode, "flat") == 0 ? 2 : -1;
    if (m < 0) return lunar_lua_error(L, "encode_batch: unknown mode '%s' (table, tensor, flat)", mode);
    size_t n = lua_objlen(L, 2);
    /* scratch on the Lua side (collected on error); the strings stay alive in the table */
    const char **texts = lua_newuserdata(L, (n + 1) * sizeof *texts);
    size_t *lens = lua_newuserdata(L, (n + 1) * sizeof *lens);
    int64_t *offsets = lua_newuserdata(L, (n + 1) * sizeof *offsets);
    for (size_t i = 0; i < n; i++) {
        lua_rawgeti(L, 2, (int)i + 1);
        if (lua_type(L, -1) != LUA_TSTRING)
            return lunar_lua_error(L, "encode_batch: texts[%zu] is a %s, expected a string", i + 1, luaL_typename(L, -1));
        texts[i] = lua_tolstring(L, -1, &lens[i]);
        lua_pop(L, 1);
    }
    int32_t *ids;
    lunar_lua_check_status(L, lunar_tokenizer_encode_batch(lunar_lua_ctx(L), tok, n, texts, lens, flags, &ids, offsets));
    size_t total = (size_t)offsets[n];
    int32_t *tmp = lua_newuserdata(L, (total ? total : 1) * sizeof *tmp);
    memcpy(tmp, ids, total * sizeof *tmp);
    free(ids);
    if (m == 2) {
        int64_t shape[1] = {(int64_t)total};
        lunar_tensor *t = lunar_lua_new_tensor(L, LUNAR_DTYPE_I64, (lunar_device){LUNAR_DEVICE_CPU, 0}, 1, shape);
        int64_t *d = lunar_tensor_data(t);
        for (size_t i = 0; i < total; i++) d[i] = tmp[i];
        shape[0] = (int64_t)n + 1;
        t = lunar_lua_new_tensor(L, LUNAR_DTYPE_I64, (lunar_device){LUNAR_DEVICE_CPU, 0}, 1, shape);
        memcpy(lunar_tensor_data(t), offsets, (n + 1) * sizeof *offsets);
        return 2;
    }
    lua_createtable(L, (int)n, 0);
    for (size_t i = 0; i < n; i++) {
        push_ids(L, tmp + offsets[i], (size_t)(offsets[i + 1] - offsets[i]), m == 1);
        lua_rawseti(L, -2, (int)i + 1);
    }
    return 1;
}

static int l_decode(lua_State *L) {
    lunar_tokenizer *tok = check_tok(L, 1);
    int flags = lua_toboolean(L, 3) ? LUNAR_TOK_SKIP_SPECIAL : 0;
    const int64_t *ids;
    size_t n;
    if (lunar_lua_is_tensor(L, 2)) {
        lunar_tensor *t = lunar_lua_check_tensor(L, 2);
        if (t->dtype != LUNAR_DTYPE_I64 || !lunar_device_is_host(t->storage->device) || !lunar_tensor_is_contiguous(t))
            return lunar_lua_error(L, "decode: expected a contiguous CPU i64 tensor of ids");
        ids = lunar_tensor_data(t);
        n = (size_t)lunar_tensor_numel(t);
    } else {
        luaL_checktype(L, 2, LUA_TTABLE);
        n = lua_objlen(L, 2);
        int64_t *v = lua_newuserdata(L, (n + 1) * sizeof *v);
        for (size_t i = 0; i < n; i++) {
            lua_rawgeti(L, 2, (int)i + 1);
            if (!lua_isnumber(L, -1))
                return lunar_lua_error(L, "decode: ids[%zu] is a %s, expected an integer id", i + 1, luaL_typename(L, -1));
            lua_Number x = lua_tonumber(L, -1);
            if (x != (lua_Number)(int64_t)x) return lunar_lua_error(L, "decode: ids[%zu] = %g is not an integer", i + 1, x);
            v[i] = (int64_t)x;
            lua_pop(L, 1);
        }
        ids = v;
    }
    char *s;
    size_t len;
    lunar_lua_check_status(L, lunar_tokenizer_decode(lunar_lua_ctx(L), tok, ids, n, flags, &s, &len));
    /* lua_pushlstring may raise on out of memory: keep s reachable from the Lua side first */
    char *copy = lua_newuserdata(L, len + 1);
    memcpy(copy, s, len);
    free(s);
    lua_pushlstring(L, copy, len);
    return 1;
}

static int l_token_to_id(lua_State *L) {
    lunar_tokenizer *tok = check_tok(L, 1);
    size_t n;
    const char *s = luaL_checklstring(L, 2, &n);
    int32_t id = lunar_tokenizer_token_to_id(tok, s, n);
    if (id < 0) lua_pushnil(L);
    else lua_pushinteger(L, id);
    return 1;
}

static int l_id_to_token(lua_State *L) {
    lunar_tokenizer *tok = check_tok(L, 1);
    lua_Number x = luaL_checknumber(L, 2);
    size_t n;
    const char *s = x >= 0 && x < 2147483648.0 ? lunar_tokenizer_id_to_token(tok, (int32_t)x, &n) : NULL;
    if (!s || x != (lua_Number)(int32_t)x) lua_pushnil(L);
    else lua_pushlstring(L, s, n);
    return 1;
}

static int l_is_special(lua_State *L) {
    lunar_tokenizer *tok = check_tok(L, 1);
    lua_Number x = luaL_checknumber(L, 2);
    lua_pushboolean(L, x >= 0 && x < 2147483648.0 && lunar_tokenizer_is_special(tok, (int32_t)x));
    return 1;
}

static int l_vocab_size(lua_State *L) {
    lua_pushinteger(L, lunar_tokenizer_vocab_size(check_tok(L, 1)));
    return 1;
}

static int l_path(lua_State *L) {
    lua_pushstring(L, lunar_tokenizer_path(check_tok(L, 1)));
    return 1;
}

static void set_bool(lua_State *L, const char *k, int v) {
    lua_pushboolean(L, v);
    lua_setfield(L, -2, k);
}

static int l_added_tokens(lua_State *L) {
    lunar_tokenizer *tok = check_tok(L, 1);
    int n = lunar_tokenizer_added_count(tok);
    lua_createtable(L, n, 0);
    for (int i = 0; i < n; i++) {
        const lunar_tok_added *a = lunar_tokenizer_added(tok, i);
        lua_createtable(L, 0, 7);
        lua_pushinteger(L, a->id);
        lua_setfield(L, -2, "id");
        lua_pushlstring(L, a->content, a->len);
        lua_setfield(L, -2, "content");
        set_bool(L, "special", a->special);
        set_bool(L, "lstrip", a->lstrip);
        set_bool(L, "rstrip", a->rstrip);
        set_bool(L, "single_word", a->single_word);
        set_bool(L, "normalized", a->normalized);
        lua_rawseti(L, -2, i + 1);
    }
    return 1;
}

static int l_set_linear_max(lua_State *L) {
    lunar_tokenizer_set_linear_max(check_tok(L, 1), (int)luaL_checkinteger(L, 2));
    return 0;
}

static int l_tostring(lua_State *L) {
    lua_tok *u = luaL_checkudata(L, 1, TOKENIZER_MT);
    if (!u->t) lua_pushstring(L, "tokenizer (freed)");
    else lua_pushfstring(L, "tokenizer('%s', vocab %d)", lunar_tokenizer_path(u->t), (int)lunar_tokenizer_vocab_size(u->t));
    return 1;
}

void lunar_lua_open_tokenizer(lua_State *L) {
    static const luaL_Reg methods[] = {
        {"encode", l_encode},           {"encode_batch", l_encode_batch}, {"decode", l_decode},
        {"token_to_id", l_token_to_id}, {"id_to_token", l_id_to_token},   {"is_special", l_is_special},
        {"vocab_size", l_vocab_size},   {"added_tokens", l_added_tokens}, {"path", l_path},
        {"free", l_free},               {"set_linear_max", l_set_linear_max}, {NULL, NULL}};
    luaL_newmetatable(L, TOKENIZER_MT);
    lua_newtable(L);
    lunar_lua_setfuncs(L, methods);
    lua_setfield(L, -2, "__index");
    lua_pushcfunction(L, l_free);
    lua_setfield(L, -2, "__gc");
    lua_pushcfunction(L, l_tostring);
    lua_setfield(L, -2, "__tostring");
    lua_pop(L, 1);
    lua_pushcfunction(L, l_load);
    lua_setfield(L, -2, "tokenizer_load");
}
