/* json.c: JSON parsing with located errors (cJSON underneath) and the JSON writer helpers.
 * The conversion between JSON and Lua tables is in host/lua/lua_io.c. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "io.h"

static int is_json_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* "line L, column C (near 'xyz')" for byte offset pos of buf */
static void describe_position(const char *buf, size_t n, size_t pos, char *out, size_t out_n) {
    if (pos > n) pos = n;
    int line = 1, col = 1;
    for (size_t i = 0; i < pos; i++) {
        if (buf[i] == '\n') {
            line++;
            col = 1;
        } else if (((unsigned char)buf[i] & 0xC0) != 0x80) {
            col++;   /* count UTF-8 characters, not continuation bytes */
        }
    }
    char near[32];
    size_t k = 0;
    for (size_t i = pos; i < n && k < 20; i++) {
        unsigned char c = (unsigned char)buf[i];
        near[k++] = (c >= 0x20 && c < 0x7f) ? (char)c : ' ';
    }
    near[k] = 0;
    if (k == 0) snprintf(out, out_n, "line %d, column %d (at the end of the input)", line, col);
    else snprintf(out, out_n, "line %d, column %d (near '%s')", line, col, near);
}

lunar_status lunar_json_parse(lunar_ctx *ctx, const char *what, const char *buf, size_t n, cJSON **out) {
    *out = NULL;
    size_t start = 0;
    while (start < n && is_json_space(buf[start])) start++;
    if (start == n) return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: empty JSON document", what);
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(buf, n, &end, 0);
    char where[96];
    if (!root) {
        size_t pos = end && end >= buf ? (size_t)(end - buf) : 0;
        describe_position(buf, n, pos, where, sizeof where);
        return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: invalid JSON at %s", what, where);
    }
    size_t pos = end ? (size_t)(end - buf) : n;
    while (pos < n && is_json_space(buf[pos])) pos++;
    if (pos < n) {
        describe_position(buf, n, pos, where, sizeof where);
        cJSON_Delete(root);
        return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: invalid JSON: unexpected content after the value at %s", what,
                          where);
    }
    *out = root;
    return LUNAR_OK;
}

lunar_status lunar_json_read_file(lunar_ctx *ctx, const char *path, cJSON **out) {
    char *buf;
    size_t n;
    *out = NULL;
    LUNAR_TRY(lunar_read_file(ctx, path, &buf, &n));
    lunar_status st = lunar_json_parse(ctx, path, buf, n, out);
    free(buf);
    return st;
}

void lunar_json_put_string(lunar_buf *b, const char *s, size_t n) {
    static const char hex[] = "0123456789abcdef";
    lunar_buf_append(b, "\"", 1);
    size_t run = 0;   /* bytes copied verbatim in one append */
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        const char *esc = NULL;
        char u[7];
        switch (c) {
        case '"': esc = "\\\""; break;
        case '\\': esc = "\\\\"; break;
        case '\n': esc = "\\n"; break;
        case '\r': esc = "\\r"; break;
        case '\t': esc = "\\t"; break;
        case '\b': esc = "\\b"; break;
        case '\f': esc = "\\f"; break;
        default:
            if (c < 0x20) {
                u[0] = '\\', u[1] = 'u', u[2] = '0', u[3] = '0', u[4] = hex[c >> 4], u[5] = hex[c & 15], u[6] = 0;
                esc = u;
            }
        }
        if (esc) {
            lunar_buf_append(b, s + i - run, run);
            run = 0;
            lunar_buf_puts(b, esc);
        } else {
            run++;
        }
    }
    lunar_buf_append(b, s + n - run, run);
    lunar_buf_append(b, "\"", 1);
}

lunar_status lunar_json_float_flags(lunar_ctx *ctx, const char *buf, size_t n, unsigned char **flags, size_t *count) {
    size_t cap = 64, k = 0;
    unsigned char *f = malloc(cap);
    if (!f) return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "out of memory scanning JSON numbers");
    for (size_t i = 0; i < n;) {
        char c = buf[i];
        if (c == '"') {   /* skip the string, escapes included */
            for (i++; i < n && buf[i] != '"'; i++)
                if (buf[i] == '\\') i++;
            i++;
        } else if (c == '-' || (c >= '0' && c <= '9')) {
            int is_float = 0;
            for (; i < n && strchr("+-0123456789.eE", buf[i]) && buf[i]; i++)
                if (buf[i] == '.' || buf[i] == 'e' || buf[i] == 'E') is_float = 1;
            if (k == cap) {
                unsigned char *g = realloc(f, cap *= 2);
                if (!g) {
                    free(f);
                    return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "out of memory scanning JSON numbers");
                }
                f = g;
            }
            f[k++] = (unsigned char)is_float;
        } else {
            i++;
        }
    }
    *flags = f;
    *count = k;
    return LUNAR_OK;
}

int lunar_json_put_float(lunar_buf *b, double v) {
    size_t before = b->len;
    if (!lunar_json_put_number(b, v)) return 0;
    if (b->oom) return 1;
    const char *s = b->data + before;
    if (!strpbrk(s, ".eE")) lunar_buf_puts(b, ".0");
    return 1;
}

int lunar_json_put_number(lunar_buf *b, double v) {
    if (!isfinite(v)) return 0;
    if (v == floor(v) && fabs(v) < 9007199254740992.0) {
        lunar_buf_printf(b, "%lld", (long long)v);
        return 1;
    }
    char tmp[40];
    for (int prec = 15; prec <= 17; prec++) {
        snprintf(tmp, sizeof tmp, "%.*g", prec, v);
        if (prec == 17 || strtod(tmp, NULL) == v) break;
    }
    lunar_buf_puts(b, tmp);
    return 1;
}
