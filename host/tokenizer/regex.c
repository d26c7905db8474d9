/* regex.c: a pre-tokenizer regex of a tokenizer.json (Oniguruma syntax, as HF tokenizers runs
 * it) -> a PCRE2 pattern that matches the same text, with its classes decided by lunar's
 * Unicode 16.0 tables (unicode.h) rather than by the Unicode version of the machine's PCRE2.
 *
 * HF tokenizers 0.23 answers \p{L}, \p{N}, \s, \w ... from Unicode 16.0; PCRE2 from its own
 * tables (Debian 12's PCRE2 10.42: Unicode 14.0), so a letter or digit added in Unicode 15 or
 * 16 split differently (' \U00010D43', a Garay digit, was one pre-token instead of two).
 *
 * Every class of the pattern (a bracket class, or \p{..}, \s, \w, \d and their negations) is
 * evaluated twice: with lunar's tables (what HF matches) and by running PCRE2 itself over every
 * code point (what PCRE2 would match). Where the two agree the class stays as written, since
 * PCRE2's own lookup is fast. Where they differ it becomes
 *
 *     (?:CLASS(?<![extra])(?<!(?=\p{Cn})[extra, unassigned for PCRE2])|(?=\p{Cn})[missing]|[missing])
 *
 * with explicit code point lists (a class of a few ranges, such as \s, is written out whole).
 * Nearly all differences are characters this PCRE2 does not know (\p{Cn}), so those lists sit
 * behind a \p{Cn} test and cost little on ordinary text.
 * (Writing every class out as code point ranges was 3-4x slower on CJK text: PCRE2 tries the
 * ranges of a large class one after the other.) With a PCRE2 whose tables match, the pattern
 * is the one written.
 *
 * Oniguruma's meaning is kept where it is not PCRE2's: its \w also takes the Latin-1 digits and
 * fractions ²³¹¼½¾ and not ZWNJ/ZWJ; \h is a hex digit; \v is U+000B; \uHHHH is a code point;
 * \b and \B use its \w. Refused with an error naming the construct: \X, POSIX brackets, nested
 * classes and &&, properties other than the general categories, and, under (?i), non-ASCII
 * literals, classes holding \p, \s, \w or \d (Oniguruma folds the case of a class's properties
 * too) and the letter pairs ss, st, ff, fi, fl (Oniguruma also matches ß, ﬆ, ﬀ, ﬁ, ﬂ there).
 * Caseless ASCII is the same in both engines (s and ſ, k and the Kelvin sign included).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tok.h"
#include "unicode.h"

#define MAX_DEPTH 256   /* nested groups */
#define MAX_CACHE 16    /* atoms whose PCRE2 sets are kept */
#define SMALL_SET 16    /* a corrected class of at most this many ranges is written out whole */

/* ---- sets of code points: sorted, disjoint ranges, surrogates never included ---------------- */

typedef struct rset {
    tok_range *r;
    size_t     n, cap;
} rset;

static void rs_free(rset *s) {
    free(s->r);
    s->r = NULL;
    s->n = s->cap = 0;
}

static int rs_add(rset *s, uint32_t lo, uint32_t hi) {
    if (s->n == s->cap) {
        size_t cap = s->cap ? 2 * s->cap : 64;
        tok_range *r = realloc(s->r, cap * sizeof *r);
        if (!r) return -1;
        s->r = r;
        s->cap = cap;
    }
    s->r[s->n++] = (tok_range){lo, hi};
    return 0;
}

static int cmp_range(const void *a, const void *b) {
    const tok_range *x = a, *y = b;
    return x->lo < y->lo ? -1 : x->lo > y->lo;
}

/* sort, merge overlapping and adjacent ranges, cut out the surrogates */
static int rs_norm(rset *s) {
    qsort(s->r, s->n, sizeof *s->r, cmp_range);
    size_t k = 0;
    for (size_t i = 0; i < s->n; i++) {
        if (k && s->r[i].lo <= s->r[k - 1].hi + 1) {
            if (s->r[i].hi > s->r[k - 1].hi) s->r[k - 1].hi = s->r[i].hi;
        } else {
            s->r[k++] = s->r[i];
        }
    }
    s->n = k;
    for (size_t i = 0; i < s->n; i++) {
        tok_range *r = &s->r[i];
        if (r->hi < 0xD800 || r->lo > 0xDFFF) continue;
        if (r->lo >= 0xD800 && r->hi <= 0xDFFF) {
            memmove(r, r + 1, (s->n - i - 1) * sizeof *r);
            s->n--;
            i--;
        } else if (r->lo >= 0xD800) {
            r->lo = 0xE000;
        } else if (r->hi <= 0xDFFF) {
            r->hi = 0xD7FF;
        } else {   /* spans them: split */
            uint32_t hi = r->hi;
            r->hi = 0xD7FF;
            if (rs_add(s, 0xE000, hi)) return -1;
            return rs_norm(s);
        }
    }
    return 0;
}

static int rs_add_set(rset *s, const rset *t) {
    for (size_t i = 0; i < t->n; i++)
        if (rs_add(s, t->r[i].lo, t->r[i].hi)) return -1;
    return 0;
}

/* out = every code point not in s (s normalised) */
static int rs_complement(const rset *s, rset *out) {
    uint32_t next = 0;
    for (size_t i = 0; i < s->n; i++) {
        if (s->r[i].lo > next && rs_add(out, next, s->r[i].lo - 1)) return -1;
        next = s->r[i].hi + 1;
    }
    if (next <= 0x10FFFF && rs_add(out, next, 0x10FFFF)) return -1;
    return rs_norm(out);
}

/* out = a and b (both normalised) */
static int rs_intersect(const rset *a, const rset *b, rset *out) {
    size_t i = 0, j = 0;
    while (i < a->n && j < b->n) {
        uint32_t lo = a->r[i].lo > b->r[j].lo ? a->r[i].lo : b->r[j].lo;
        uint32_t hi = a->r[i].hi < b->r[j].hi ? a->r[i].hi : b->r[j].hi;
        if (lo <= hi && rs_add(out, lo, hi)) return -1;
        if (a->r[i].hi < b->r[j].hi) i++;
        else j++;
    }
    return 0;
}

/* out = a without b */
static int rs_minus(const rset *a, const rset *b, rset *out) {
    rset nb = {0};
    int rc = rs_complement(b, &nb) || rs_intersect(a, &nb, out);
    rs_free(&nb);
    return rc ? -1 : 0;
}

/* ---- the classes -------------------------------------------------------------------------------- */

typedef enum { SET_GC, SET_SPACE, SET_WORD, SET_DIGIT } set_kind;

/* one member of a class: a code point range, or a named set (possibly negated) */
typedef struct item {
    int      is_set;
    uint32_t lo, hi;
    set_kind kind;
    uint32_t gc_mask;      /* SET_GC */
    char     pcre[4];      /* SET_GC: the name PCRE2 knows ("L", "Lu", "L&") */
    int      neg;
} item;

typedef struct gc_name {
    const char *name;      /* Oniguruma's, lower case without ' ', '_', '-' */
    const char *pcre;
    uint32_t    mask;
} gc_name;

#define B(g) TOK_GC_BIT(TOK_##g)
static const gc_name GC_NAMES[] = {
    {"l", "L", TOK_GC_L}, {"letter", "L", TOK_GC_L},
    {"lu", "Lu", B(Lu)}, {"uppercaseletter", "Lu", B(Lu)}, {"ll", "Ll", B(Ll)}, {"lowercaseletter", "Ll", B(Ll)},
    {"lt", "Lt", B(Lt)}, {"titlecaseletter", "Lt", B(Lt)}, {"lm", "Lm", B(Lm)}, {"modifierletter", "Lm", B(Lm)},
    {"lo", "Lo", B(Lo)}, {"otherletter", "Lo", B(Lo)},
    {"lc", "L&", B(Lu) | B(Ll) | B(Lt)}, {"casedletter", "L&", B(Lu) | B(Ll) | B(Lt)},
    {"m", "M", TOK_GC_M}, {"mark", "M", TOK_GC_M}, {"combiningmark", "M", TOK_GC_M},
    {"mn", "Mn", B(Mn)}, {"nonspacingmark", "Mn", B(Mn)}, {"mc", "Mc", B(Mc)}, {"spacingmark", "Mc", B(Mc)},
    {"me", "Me", B(Me)}, {"enclosingmark", "Me", B(Me)},
    {"n", "N", B(Nd) | B(Nl) | B(No)}, {"number", "N", B(Nd) | B(Nl) | B(No)},
    {"nd", "Nd", B(Nd)}, {"decimalnumber", "Nd", B(Nd)}, {"nl", "Nl", B(Nl)}, {"letternumber", "Nl", B(Nl)},
    {"no", "No", B(No)}, {"othernumber", "No", B(No)},
    {"p", "P", B(Pc) | B(Pd) | B(Ps) | B(Pe) | B(Pi) | B(Pf) | B(Po)},
    {"punctuation", "P", B(Pc) | B(Pd) | B(Ps) | B(Pe) | B(Pi) | B(Pf) | B(Po)},
    {"pc", "Pc", B(Pc)}, {"connectorpunctuation", "Pc", B(Pc)}, {"pd", "Pd", B(Pd)}, {"dashpunctuation", "Pd", B(Pd)},
    {"ps", "Ps", B(Ps)}, {"openpunctuation", "Ps", B(Ps)}, {"pe", "Pe", B(Pe)}, {"closepunctuation", "Pe", B(Pe)},
    {"pi", "Pi", B(Pi)}, {"initialpunctuation", "Pi", B(Pi)}, {"pf", "Pf", B(Pf)}, {"finalpunctuation", "Pf", B(Pf)},
    {"po", "Po", B(Po)}, {"otherpunctuation", "Po", B(Po)},
    {"s", "S", B(Sm) | B(Sc) | B(Sk) | B(So)}, {"symbol", "S", B(Sm) | B(Sc) | B(Sk) | B(So)},
    {"sm", "Sm", B(Sm)}, {"mathsymbol", "Sm", B(Sm)}, {"sc", "Sc", B(Sc)}, {"currencysymbol", "Sc", B(Sc)},
    {"sk", "Sk", B(Sk)}, {"modifiersymbol", "Sk", B(Sk)}, {"so", "So", B(So)}, {"othersymbol", "So", B(So)},
    {"z", "Z", B(Zs) | B(Zl) | B(Zp)}, {"separator", "Z", B(Zs) | B(Zl) | B(Zp)},
    {"zs", "Zs", B(Zs)}, {"spaceseparator", "Zs", B(Zs)}, {"zl", "Zl", B(Zl)}, {"lineseparator", "Zl", B(Zl)},
    {"zp", "Zp", B(Zp)}, {"paragraphseparator", "Zp", B(Zp)},
    {"c", "C", B(Cc) | B(Cf) | B(Cs) | B(Co) | B(Cn)}, {"other", "C", B(Cc) | B(Cf) | B(Cs) | B(Co) | B(Cn)},
    {"cc", "Cc", B(Cc)}, {"control", "Cc", B(Cc)}, {"cf", "Cf", B(Cf)}, {"format", "Cf", B(Cf)},
    {"cs", "Cs", B(Cs)}, {"surrogate", "Cs", B(Cs)}, {"co", "Co", B(Co)}, {"privateuse", "Co", B(Co)},
    {"cn", "Cn", B(Cn)}, {"unassigned", "Cn", B(Cn)},
};
#undef B

static int gc_ranges(uint32_t mask, rset *out) {
    for (int i = 0; i < tok_gc_run_count; i++) {
        if (!(mask & TOK_GC_BIT(tok_gc_runs[i].gc))) continue;
        uint32_t end = i + 1 < tok_gc_run_count ? tok_gc_runs[i + 1].first - 1 : 0x10FFFF;
        if (rs_add(out, tok_gc_runs[i].first, end)) return -1;
    }
    return 0;
}

static int table_ranges(const tok_range *r, int n, rset *out) {
    for (int i = 0; i < n; i++)
        if (rs_add(out, r[i].lo, r[i].hi)) return -1;
    return 0;
}

/* the code points of one item, with lunar's tables (HF's meaning) */
static int item_set(const item *it, rset *out) {
    rset s = {0};
    int rc = 0;
    if (!it->is_set) {
        rc = rs_add(&s, it->lo, it->hi);
    } else if (it->kind == SET_GC) {
        rc = gc_ranges(it->gc_mask, &s);
    } else if (it->kind == SET_DIGIT) {
        rc = gc_ranges(TOK_GC_BIT(TOK_Nd), &s);
    } else if (it->kind == SET_SPACE) {
        rc = table_ranges(tok_white_space, tok_white_space_count, &s);
    } else {   /* Oniguruma's \w: Alphabetic, M, Nd, Pc, and ²³¹¼½¾ from its Latin-1 table */
        rc = gc_ranges(TOK_GC_L | TOK_GC_M | TOK_GC_BIT(TOK_Nl) | TOK_GC_BIT(TOK_Nd) | TOK_GC_BIT(TOK_Pc), &s) ||
             table_ranges(tok_alphabetic_other, tok_alphabetic_other_count, &s) || rs_add(&s, 0xB2, 0xB3) ||
             rs_add(&s, 0xB9, 0xB9) || rs_add(&s, 0xBC, 0xBE);
    }
    if (!rc) rc = rs_norm(&s);
    if (!rc) rc = it->is_set && it->neg ? rs_complement(&s, out) : rs_add_set(out, &s);
    rs_free(&s);
    return rc ? -1 : 0;
}

/* ---- the translation ------------------------------------------------------------------------- */

typedef struct buf {
    char  *p;
    size_t n, cap;
} buf;

typedef struct probed {
    char *atom;
    int   caseless;
    rset  set;
} probed;

typedef struct tr {
    const char *pat;
    size_t      len, i;
    buf         out;
    int         caseless;
    int         stack[MAX_DEPTH], depth;   /* the caseless state outside each open group */
    int         prev_lit;                  /* the previous literal (lower-case ASCII), or -1 */
    int         oom;
    char       *msg;
    size_t      msg_size;
    /* what PCRE2 makes of classes: the UTF-8 of every code point, and the atoms run over it */
    uint8_t *all;
    size_t   all_len;
    probed   cache[MAX_CACHE];
    int      n_cache;
    rset     scratch;
    rset     cn;        /* PCRE2's \p{Cn} */
    int      cn_done;
} tr;

static void put(tr *t, buf *b, const void *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            t->oom = 1;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

__attribute__((format(printf, 3, 4))) static void putf(tr *t, buf *b, const char *fmt, ...) {
    char s[64];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(s, sizeof s, fmt, ap);
    va_end(ap);
    put(t, b, s, (size_t)n);
}

__attribute__((format(printf, 3, 4))) static int fail(tr *t, size_t at, const char *fmt, ...) {
    char m[200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m, sizeof m, fmt, ap);
    va_end(ap);
    snprintf(t->msg, t->msg_size, "%s (at offset %zu)", m, at);
    return -1;
}

static int oom(tr *t) {
    snprintf(t->msg, t->msg_size, "out of memory translating the pattern");
    return -1;
}

/* ---- what PCRE2 matches --------------------------------------------------------------------- */

/* the code point that starts at byte off of t->all (every code point in order, UTF-8) */
static uint32_t all_cp(size_t off) {
    const size_t two = 0x80, three = two + 2 * 0x780, four = three + 3 * (0x10000 - 0x800 - 0x800);
    if (off < two) return (uint32_t)off;
    if (off < three) return (uint32_t)(0x80 + (off - two) / 2);
    if (off < four) {
        uint32_t cp = (uint32_t)(0x800 + (off - three) / 3);
        return cp >= 0xD800 ? cp + 0x800 : cp;
    }
    return (uint32_t)(0x10000 + (off - four) / 4);
}

static int make_all(tr *t) {
    t->all = malloc(4 * 0x110000);
    if (!t->all) return -1;
    size_t k = 0;
    for (uint32_t c = 0; c <= 0x10FFFF; c++) {
        if (c >= 0xD800 && c <= 0xDFFF) continue;
        uint8_t *p = t->all + k;
        if (c < 0x80) {
            p[0] = (uint8_t)c;
            k += 1;
        } else if (c < 0x800) {
            p[0] = (uint8_t)(0xC0 | (c >> 6));
            p[1] = (uint8_t)(0x80 | (c & 0x3F));
            k += 2;
        } else if (c < 0x10000) {
            p[0] = (uint8_t)(0xE0 | (c >> 12));
            p[1] = (uint8_t)(0x80 | ((c >> 6) & 0x3F));
            p[2] = (uint8_t)(0x80 | (c & 0x3F));
            k += 3;
        } else {
            p[0] = (uint8_t)(0xF0 | (c >> 18));
            p[1] = (uint8_t)(0x80 | ((c >> 12) & 0x3F));
            p[2] = (uint8_t)(0x80 | ((c >> 6) & 0x3F));
            p[3] = (uint8_t)(0x80 | (c & 0x3F));
            k += 4;
        }
    }
    t->all_len = k;
    return 0;
}

/* the code points PCRE2 matches with the one-character pattern atom (a class or an escape) */
static int pcre_set(tr *t, const char *atom, size_t at, rset *out) {
    if (!t->all && make_all(t)) return oom(t);
    buf p = {0};
    put(t, &p, atom, strlen(atom));
    put(t, &p, "+", 1);
    if (t->oom) return oom(t);
    int err;
    PCRE2_SIZE erroff;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)p.p, p.n, PCRE2_UTF | PCRE2_UCP | (t->caseless ? PCRE2_CASELESS : 0),
                                   &err, &erroff, NULL);
    free(p.p);
    if (!re) {
        PCRE2_UCHAR m[160];
        pcre2_get_error_message(err, m, sizeof m);
        return fail(t, at, "PCRE2 cannot compile '%s': %s", atom, (const char *)m);
    }
    int jit = pcre2_jit_compile(re, PCRE2_JIT_COMPLETE) == 0;
    pcre2_match_data *md = pcre2_match_data_create(1, NULL);
    int rc = md ? 0 : oom(t);
    size_t off = 0;
    while (!rc && off < t->all_len) {
        int m = jit ? pcre2_jit_match(re, t->all, t->all_len, off, 0, md, NULL)
                    : pcre2_match(re, t->all, t->all_len, off, PCRE2_NO_UTF_CHECK, md, NULL);
        if (m == PCRE2_ERROR_NOMATCH) break;
        if (m < 0) {
            rc = fail(t, at, "PCRE2 failed on '%s' (error %d)", atom, m);
            break;
        }
        const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        uint32_t last = ov[1] < t->all_len ? all_cp(ov[1]) - 1 : 0x10FFFF;
        if (last == 0xDFFF) last = 0xD7FF;
        if (rs_add(out, all_cp(ov[0]), last)) rc = oom(t);
        off = ov[1] > off ? ov[1] : off + 1;
    }
    pcre2_match_data_free(md);
    pcre2_code_free(re);
    if (!rc && rs_norm(out)) rc = oom(t);
    return rc;
}

/* an explicit class of the code points of s */
static void put_list(tr *t, buf *b, const rset *s) {
    put(t, b, t->caseless ? "(?-i:[" : "[", t->caseless ? 6 : 1);
    for (size_t i = 0; i < s->n; i++) {
        if (s->r[i].lo == s->r[i].hi) putf(t, b, "\\x{%X}", s->r[i].lo);
        else putf(t, b, "\\x{%X}-\\x{%X}", s->r[i].lo, s->r[i].hi);
    }
    put(t, b, t->caseless ? "])" : "]", t->caseless ? 2 : 1);
}

/* pcre_set with a cache: each distinct atom is run over every code point once (past
 * MAX_CACHE atoms the result lives in t->scratch until the next call) */
static int pcre_set_cached(tr *t, const char *atom, size_t at, const rset **out) {
    for (int k = 0; k < t->n_cache; k++)
        if (t->cache[k].caseless == t->caseless && strcmp(t->cache[k].atom, atom) == 0) {
            *out = &t->cache[k].set;
            return 0;
        }
    if (t->n_cache == MAX_CACHE) {
        t->scratch.n = 0;
        *out = &t->scratch;
        return pcre_set(t, atom, at, &t->scratch);
    }
    probed *p = &t->cache[t->n_cache];
    *p = (probed){.atom = strdup(atom), .caseless = t->caseless};
    if (!p->atom) return oom(t);
    if (pcre_set(t, atom, at, &p->set)) {
        free(p->atom);
        rs_free(&p->set);
        return -1;
    }
    t->n_cache++;
    *out = &p->set;
    return 0;
}

/* Write atom (one character: a class or an escape, in PCRE2's syntax) so that it matches the
 * code points of want, correcting what PCRE2's tables make of it. */
static int put_atom(tr *t, buf *b, const char *atom, const rset *want, size_t at) {
    const rset *got;
    rset extra = {0}, missing = {0}, ex_cn = {0}, ex_rest = {0}, mi_cn = {0}, mi_rest = {0};
    int rc = pcre_set_cached(t, atom, at, &got);
    if (!rc && (rs_minus(got, want, &extra) || rs_minus(want, got, &missing))) rc = oom(t);
    if (!rc && !extra.n && !missing.n) {
        put(t, b, atom, strlen(atom));
    } else if (!rc && want->n <= SMALL_SET) {   /* \s, \S: the list itself is simplest and fast */
        put_list(t, b, want);
        extra.n = missing.n = 0;
    } else if (!rc) {
        if (!t->cn_done) {   /* what this PCRE2 does not know */
            int saved = t->caseless;
            t->caseless = 0;
            rc = pcre_set(t, "\\p{Cn}", at, &t->cn);
            t->caseless = saved;
            t->cn_done = !rc;
        }
        if (!rc && (rs_intersect(&extra, &t->cn, &ex_cn) || rs_minus(&extra, &t->cn, &ex_rest) ||
                    rs_intersect(&missing, &t->cn, &mi_cn) || rs_minus(&missing, &t->cn, &mi_rest)))
            rc = oom(t);
    }
    if (!rc && (extra.n || missing.n)) {
        put(t, b, "(?:", 3);
        put(t, b, atom, strlen(atom));
        if (ex_rest.n) {   /* checked after the atom matched, so other characters pay nothing */
            put(t, b, "(?<!", 4);
            put_list(t, b, &ex_rest);
            put(t, b, ")", 1);
        }
        if (ex_cn.n) {
            put(t, b, "(?<!(?=\\p{Cn})", 14);
            put_list(t, b, &ex_cn);
            put(t, b, ")", 1);
        }
        if (mi_cn.n) {
            put(t, b, "|(?=\\p{Cn})", 11);
            put_list(t, b, &mi_cn);
        }
        if (mi_rest.n) {
            put(t, b, "|", 1);
            put_list(t, b, &mi_rest);
        }
        put(t, b, ")", 1);
    }
    rset *sets[] = {&extra, &missing, &ex_cn, &ex_rest, &mi_cn, &mi_rest};
    for (size_t k = 0; k < sizeof sets / sizeof *sets; k++) rs_free(sets[k]);
    return rc;
}

/* the PCRE2 text of a set item, inside a class or alone. Oniguruma's \w is written as the
 * categories it is made of, so that only a few code points need correcting (PCRE2's own \w
 * leaves out the marks and Pc). */
static void put_item(tr *t, buf *b, const item *it, int in_class) {
    static const char word[] = "\\p{L}\\p{M}\\p{Nd}\\p{Nl}\\p{Pc}";
    if (it->is_set && it->kind == SET_WORD && (!it->neg || !in_class)) {
        put(t, b, in_class ? "" : it->neg ? "[^" : "[", in_class ? 0 : it->neg ? 2 : 1);
        put(t, b, word, sizeof word - 1);
        put(t, b, "]", in_class ? 0 : 1);
        return;
    }
    if (!it->is_set) {
        if (it->lo == it->hi) putf(t, b, "\\x{%X}", it->lo);
        else putf(t, b, "\\x{%X}-\\x{%X}", it->lo, it->hi);
        return;
    }
    if (it->kind == SET_GC) {
        putf(t, b, "\\%c{%s}", it->neg ? 'P' : 'p', it->pcre);
        return;
    }
    static const char names[] = "swd";
    char c = names[it->kind - SET_SPACE];
    putf(t, b, "\\%c", it->neg ? c - 'a' + 'A' : c);
}

/* ---- the parser ------------------------------------------------------------------------------- */

static int utf8_at(tr *t, size_t i, uint32_t *cp) {
    int l = tok_utf8_len((const uint8_t *)t->pat + i, t->len - i, cp);
    if (!l) return fail(t, i, "invalid UTF-8 in the pattern");
    return l;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* \x{H..}, \xHH, \uHHHH at t->i (the backslash): the code point, t->i past it */
static int hex_escape(tr *t, uint32_t *cp) {
    size_t at = t->i, i = t->i + 2;
    uint32_t v = 0;
    int n = 0, max = t->pat[t->i + 1] == 'u' ? 4 : 2;
    if (t->pat[t->i + 1] == 'x' && i < t->len && t->pat[i] == '{') {
        for (i++; i < t->len && hexval(t->pat[i]) >= 0 && n < 8; i++, n++) v = v * 16 + (uint32_t)hexval(t->pat[i]);
        if (i >= t->len || t->pat[i] != '}' || n == 0) return fail(t, at, "a malformed \\x{...} escape");
        i++;
    } else {
        for (; i < t->len && hexval(t->pat[i]) >= 0 && n < max; i++, n++) v = v * 16 + (uint32_t)hexval(t->pat[i]);
        if (n == 0 || (max == 4 && n != 4)) return fail(t, at, "a malformed \\%c escape", t->pat[t->i + 1]);
    }
    if (v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) return fail(t, at, "\\x{%X} is not a Unicode scalar value", v);
    *cp = v;
    t->i = i;
    return 0;
}

/* \p{Name}, \p{^Name}, \P{Name}, \pL at t->i (the backslash) -> a set item, t->i past it */
static int property(tr *t, item *it) {
    size_t at = t->i, i = t->i + 2;
    char name[40];
    size_t k = 0;
    int neg = t->pat[t->i + 1] == 'P';
    if (i < t->len && t->pat[i] == '{') {
        size_t j = i + 1;
        if (j < t->len && t->pat[j] == '^') {
            neg = !neg;
            j++;
        }
        for (; j < t->len && t->pat[j] != '}'; j++) {
            char c = t->pat[j];
            if (c == ' ' || c == '_' || c == '-') continue;
            if (k + 1 < sizeof name) name[k++] = (char)(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
        }
        if (j >= t->len) return fail(t, at, "\\p{ without its closing }");
        i = j + 1;
    } else if (i < t->len) {
        char c = t->pat[i++];
        name[k++] = (char)(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
    }
    name[k] = 0;
    for (size_t g = 0; g < sizeof GC_NAMES / sizeof *GC_NAMES; g++) {
        if (strcmp(GC_NAMES[g].name, name) == 0) {
            *it = (item){.is_set = 1, .kind = SET_GC, .gc_mask = GC_NAMES[g].mask, .neg = neg};
            snprintf(it->pcre, sizeof it->pcre, "%s", GC_NAMES[g].pcre);
            t->i = i;
            return 0;
        }
    }
    return fail(t, at, "the property '%.*s' is not supported (lunar knows the general categories: L, Lu, Ll, Lt, Lm, "
                "Lo, LC, M, Mn, Mc, Me, N, Nd, Nl, No, P.., S.., Z.., C.. and their long names)",
                (int)(i - at), t->pat + at);
}

/* a set escape (\s \S \w \W \d \D) at t->i -> item */
static void perl_class(tr *t, item *it) {
    char c = t->pat[t->i + 1];
    char lc = (char)(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
    *it = (item){.is_set = 1, .kind = lc == 's' ? SET_SPACE : lc == 'w' ? SET_WORD : SET_DIGIT, .neg = c != lc};
    t->i += 2;
}

/* the code point of a one-character escape (\t, \x41, \., ...) at t->i, or -1 */
static int literal_escape(tr *t, uint32_t *cp) {
    char c = t->pat[t->i + 1];
    static const char from[] = "tnrfvae", to[] = "\t\n\r\f\v\a\x1b";
    const char *p = strchr(from, c);
    if (c && p) {
        *cp = (uint8_t)to[p - from];
        t->i += 2;
        return 0;
    }
    if (c == 'x' || c == 'u') return hex_escape(t, cp);
    if (c == '0') {   /* \0, \0o, \0oo */
        uint32_t v = 0;
        size_t i = t->i + 2;
        for (int n = 0; n < 2 && i < t->len && t->pat[i] >= '0' && t->pat[i] <= '7'; n++, i++) v = v * 8 + (uint32_t)(t->pat[i] - '0');
        *cp = v;
        t->i = i;
        return 0;
    }
    if ((unsigned char)c < 0x80 && !((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'))) {
        *cp = (uint8_t)c;
        t->i += 2;
        return 0;
    }
    return 1;   /* not a literal */
}

static int caseless_literal(tr *t, uint32_t cp, size_t at) {
    if (!t->caseless) return 0;
    if (cp >= 0x80)
        return fail(t, at, "the non-ASCII character U+%04X under (?i) is not supported (lunar does not fold its case "
                    "as HF's Oniguruma does)", cp);
    int c = cp >= 'A' && cp <= 'Z' ? (int)cp - 'A' + 'a' : (int)cp;
    static const char *pairs[] = {"ss", "st", "ff", "fi", "fl"};
    for (int k = 0; k < 5 && t->prev_lit >= 0; k++)
        if (pairs[k][0] == t->prev_lit && pairs[k][1] == c)
            return fail(t, at, "'%s' under (?i) is not supported (HF's Oniguruma also matches the one character "
                        "that folds to it, such as 'ß' for 'ss')", pairs[k]);
    t->prev_lit = c;
    return 0;
}

static int push_item(item **items, size_t *n, size_t *cap, item it) {
    if (*n == *cap) {
        size_t c = *cap ? 2 * *cap : 16;
        item *q = realloc(*items, c * sizeof *q);
        if (!q) return -1;
        *items = q;
        *cap = c;
    }
    (*items)[(*n)++] = it;
    return 0;
}

/* a bracket class at t->i ('[') -> written to the output */
static int bracket(tr *t) {
    size_t at = t->i, i = t->i + 1;
    int neg = 0, has_set = 0;
    if (i < t->len && t->pat[i] == '^') {
        neg = 1;
        i++;
    }
    item *items = NULL;
    size_t n = 0, cap = 0;
    int rc = 0, first = 1;
    t->i = i;
    while (!rc) {
        if (t->i >= t->len) {
            rc = fail(t, at, "a character class without its closing ]");
            break;
        }
        char c = t->pat[t->i];
        if (c == ']' && !first) break;
        first = 0;
        size_t here = t->i;
        item it = {0};
        uint32_t cp = 0;
        if (c == '[') {
            rc = fail(t, here, t->i + 1 < t->len && t->pat[t->i + 1] == ':'
                                   ? "POSIX bracket classes ([:alpha:]) are not supported"
                                   : "nested character classes are not supported");
            break;
        }
        if (c == '&' && t->i + 1 < t->len && t->pat[t->i + 1] == '&') {
            rc = fail(t, here, "class intersection (&&) is not supported");
            break;
        }
        if (c == '\\' && t->i + 1 < t->len) {
            char d = t->pat[t->i + 1];
            if (d == 'p' || d == 'P') {
                if ((rc = property(t, &it))) break;
            } else if (strchr("sSwWdD", d)) {
                perl_class(t, &it);
            } else if (d == 'h' || d == 'H') {   /* Oniguruma: a hex digit */
                static const tok_range hex[] = {{'0', '9'}, {'A', 'F'}, {'a', 'f'}};
                static const tok_range nonhex[] = {{0, '0' - 1}, {'9' + 1, 'A' - 1}, {'F' + 1, 'a' - 1}, {'f' + 1, 0xD7FF},
                                                   {0xE000, 0x10FFFF}};
                const tok_range *r = d == 'h' ? hex : nonhex;
                int nr = d == 'h' ? 3 : 5;
                t->i += 2;
                for (int k = 0; k < nr && !rc; k++)
                    if (push_item(&items, &n, &cap, (item){.lo = r[k].lo, .hi = r[k].hi})) rc = oom(t);
                continue;
            } else if (d == 'b') {
                cp = 8;
                t->i += 2;
            } else {
                int l = literal_escape(t, &cp);
                if (l < 0) {
                    rc = -1;
                    break;
                }
                if (l > 0) {
                    rc = fail(t, here, "\\%c in a character class is not supported", d);
                    break;
                }
            }
        } else {
            int l = utf8_at(t, t->i, &cp);
            if (l < 0) {
                rc = -1;
                break;
            }
            t->i += (size_t)l;
        }
        if (!it.is_set) {
            it.lo = it.hi = cp;
            /* a range a-b */
            if (t->i + 1 < t->len && t->pat[t->i] == '-' && t->pat[t->i + 1] != ']') {
                size_t dash = t->i;
                t->i++;
                uint32_t hi = 0;
                if (t->pat[t->i] == '\\') {
                    int l = t->i + 1 < t->len ? literal_escape(t, &hi) : 1;
                    if (l < 0) {
                        rc = -1;
                        break;
                    }
                    if (l > 0) {
                        rc = fail(t, dash, "a range must end with a character");
                        break;
                    }
                } else {
                    int l = utf8_at(t, t->i, &hi);
                    if (l < 0) {
                        rc = -1;
                        break;
                    }
                    t->i += (size_t)l;
                }
                if (hi < cp) {
                    rc = fail(t, dash, "the range U+%04X-U+%04X is out of order", cp, hi);
                    break;
                }
                it.hi = hi;
            }
            if (t->caseless && it.hi >= 0x80) {
                rc = fail(t, here, "non-ASCII characters in a class under (?i) are not supported (lunar does not fold "
                          "their case as HF's Oniguruma does)");
                break;
            }
        } else {
            has_set = 1;
            if (t->caseless) {
                rc = fail(t, here, "\\p, \\s, \\w or \\d in a character class under (?i) is not supported (HF's "
                          "Oniguruma folds the case of the whole class)");
                break;
            }
        }
        if (push_item(&items, &n, &cap, it)) rc = oom(t);
    }
    if (!rc) t->i++;   /* the ] */
    /* the class in PCRE2's syntax, and what HF matches */
    buf text = {0};
    rset want = {0}, any = {0};
    if (!rc) {
        put(t, &text, neg ? "[^" : "[", neg ? 2 : 1);
        for (size_t k = 0; k < n; k++) put_item(t, &text, &items[k], 1);
        put(t, &text, "]", 1);
        if (t->oom) rc = oom(t);
    }
    if (!rc && !has_set) {
        put(t, &t->out, text.p, text.n);
    } else if (!rc) {
        for (size_t k = 0; k < n && !rc; k++)
            if (item_set(&items[k], &any)) rc = oom(t);
        if (!rc && (rs_norm(&any) || (neg ? rs_complement(&any, &want) : rs_add_set(&want, &any)))) rc = oom(t);
        if (!rc) rc = put_atom(t, &t->out, text.p, &want, at);
    }
    free(text.p);
    free(items);
    rs_free(&want);
    rs_free(&any);
    t->prev_lit = -1;
    return rc;
}

/* a one-item atom (\p{..}, \s, \w, \d, ...) -> written to b */
static int set_atom(tr *t, buf *b, const item *it, size_t at) {
    buf text = {0};
    rset want = {0};
    put_item(t, &text, it, 0);
    int rc = t->oom || item_set(it, &want) || rs_norm(&want) ? oom(t) : put_atom(t, b, text.p, &want, at);
    free(text.p);
    rs_free(&want);
    return rc;
}

/* \b or \B: a word boundary of Oniguruma's \w */
static int boundary(tr *t, int not, size_t at) {
    item w = {.is_set = 1, .kind = SET_WORD};
    buf wb = {0};
    int rc = set_atom(t, &wb, &w, at);
    if (!rc) {
        const char *W = wb.p;
        buf *o = &t->out;
        put(t, o, "(?:(?<=", 7);
        put(t, o, W, wb.n);
        put(t, o, not ? ")(?=" : ")(?!", 4);
        put(t, o, W, wb.n);
        put(t, o, ")|(?<!", 6);
        put(t, o, W, wb.n);
        put(t, o, not ? ")(?!" : ")(?=", 4);
        put(t, o, W, wb.n);
        put(t, o, "))", 2);
        if (t->oom) rc = oom(t);
    }
    free(wb.p);
    return rc;
}

/* ( at t->i: a group, maybe with option letters */
static int group(tr *t) {
    size_t at = t->i, i = t->i + 1;
    if (i + 1 < t->len && t->pat[i] == '?' && t->pat[i + 1] == '#') {   /* a comment */
        const char *e = memchr(t->pat + i, ')', t->len - i);
        if (!e) return fail(t, at, "a (?# comment without its closing )");
        t->i = (size_t)(e - t->pat) + 1;
        return 0;
    }
    int caseless = t->caseless;
    size_t j = i;
    if (j < t->len && t->pat[j] == '?') {
        int on = 1;
        for (j++; j < t->len && ((t->pat[j] >= 'a' && t->pat[j] <= 'z') || (t->pat[j] >= 'A' && t->pat[j] <= 'Z') ||
                                t->pat[j] == '-');
             j++) {
            if (t->pat[j] == '-') on = 0;
            if (t->pat[j] == 'i') caseless = on;
        }
        if (j < t->len && t->pat[j] == ')' && j > i + 1) {   /* (?i): to the end of the enclosing group */
            put(t, &t->out, t->pat + at, j + 1 - at);
            t->caseless = caseless;
            t->i = j + 1;
            t->prev_lit = -1;
            return 0;
        }
        if (!(j < t->len && t->pat[j] == ':' && j > i + 1)) caseless = t->caseless;   /* (?=, (?<name> ... */
    }
    /* the group's opening as written: (, (?:, (?i-m:, (?=, (?<!, (?<name>, (?P<name>, (?'name' */
    size_t end = i;
    if (i < t->len && t->pat[i] == '?') {
        if (j < t->len && t->pat[j] == ':') {
            end = j + 1;
        } else if (j == i + 1 && j < t->len && t->pat[j] && strchr("=!>|", t->pat[j])) {
            end = j + 1;
        } else if (j + 1 < t->len && t->pat[j] == '<' && (t->pat[j + 1] == '=' || t->pat[j + 1] == '!')) {
            end = j + 2;
        } else if (j < t->len && (t->pat[j] == '<' || t->pat[j] == '\'')) {
            const char *e = memchr(t->pat + j + 1, t->pat[j] == '<' ? '>' : '\'', t->len - j - 1);
            end = e ? (size_t)(e - t->pat) + 1 : j + 1;
        } else {
            end = j;
        }
    }
    if (t->depth == MAX_DEPTH) return fail(t, at, "groups nested more than %d deep", MAX_DEPTH);
    t->stack[t->depth++] = t->caseless;
    t->caseless = caseless;
    put(t, &t->out, t->pat + at, end - at);
    t->i = end;
    t->prev_lit = -1;
    return 0;
}

static int translate(tr *t) {
    while (t->i < t->len && !t->oom) {
        size_t at = t->i;
        char c = t->pat[t->i];
        if (c == '[') {
            if (bracket(t)) return -1;
            continue;
        }
        if (c == '(') {
            if (group(t)) return -1;
            continue;
        }
        if (c == ')') {
            if (t->depth > 0) t->caseless = t->stack[--t->depth];
            put(t, &t->out, ")", 1);
            t->i++;
            t->prev_lit = -1;
            continue;
        }
        if (c == '\\' && t->i + 1 < t->len) {
            char d = t->pat[t->i + 1];
            item it;
            uint32_t cp;
            if (d == 'p' || d == 'P') {
                if (property(t, &it) || set_atom(t, &t->out, &it, at)) return -1;
                t->prev_lit = -1;
            } else if (strchr("sSwWdD", d)) {
                perl_class(t, &it);
                if (set_atom(t, &t->out, &it, at)) return -1;
                t->prev_lit = -1;
            } else if (d == 'h' || d == 'H') {
                put(t, &t->out, d == 'h' ? "[0-9A-Fa-f]" : "[^0-9A-Fa-f]", d == 'h' ? 11 : 12);
                t->i += 2;
                t->prev_lit = -1;
            } else if (d == 'b' || d == 'B') {
                if (boundary(t, d == 'B', at)) return -1;
                t->i += 2;
                t->prev_lit = -1;
            } else if (d == 'X') {
                return fail(t, at, "\\X (a grapheme cluster) is not supported");
            } else if (d == 'Q') {   /* \Q...\E: literal text */
                size_t e = t->i + 2;
                while (e < t->len && !(t->pat[e] == '\\' && e + 1 < t->len && t->pat[e + 1] == 'E')) e++;
                for (size_t k = t->i + 2; k < e;) {
                    int l = utf8_at(t, k, &cp);
                    if (l < 0 || caseless_literal(t, cp, k)) return -1;
                    k += (size_t)l;
                }
                size_t end = e < t->len ? e + 2 : t->len;
                put(t, &t->out, t->pat + t->i, end - t->i);
                t->i = end;
            } else {
                size_t before = t->i;
                int l = literal_escape(t, &cp);
                if (l < 0) return -1;
                if (l == 0) {
                    if (caseless_literal(t, cp, at)) return -1;
                    putf(t, &t->out, "\\x{%X}", cp);
                } else {   /* backreferences, anchors (\A \z \G ...): as written */
                    put(t, &t->out, t->pat + before, 2);
                    t->i = before + 2;
                    t->prev_lit = -1;
                }
            }
            continue;
        }
        if ((unsigned char)c >= 0x80) {
            uint32_t cp;
            int l = utf8_at(t, t->i, &cp);
            if (l < 0 || caseless_literal(t, cp, at)) return -1;
            put(t, &t->out, t->pat + t->i, (size_t)l);
            t->i += (size_t)l;
            continue;
        }
        if (strchr(".^$|*+?{}", c)) {
            t->prev_lit = -1;
        } else if (caseless_literal(t, (uint8_t)c, at)) {
            return -1;
        }
        put(t, &t->out, &c, 1);
        t->i++;
    }
    return t->oom ? oom(t) : 0;
}

char *tok_regex_translate(const char *pat, size_t len, size_t *out_len, char *msg, size_t msg_size) {
    tr t = {.pat = pat, .len = len, .prev_lit = -1, .msg = msg, .msg_size = msg_size};
    int rc = translate(&t);
    free(t.all);
    for (int k = 0; k < t.n_cache; k++) {
        free(t.cache[k].atom);
        rs_free(&t.cache[k].set);
    }
    rs_free(&t.scratch);
    rs_free(&t.cn);
    if (rc) {
        free(t.out.p);
        return NULL;
    }
    if (!t.out.p) {   /* an empty pattern */
        put(&t, &t.out, "", 0);
        if (t.oom) {
            oom(&t);
            return NULL;
        }
    }
    *out_len = t.out.n;
    return t.out.p;
}
