/* unicode.c: lookups in the Unicode 16.0 tables of unicode_tables.c. */
#include "unicode.h"

static int in_ranges(const tok_range *r, int n, uint32_t cp) {
    int lo = 0, hi = n - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (cp < r[mid].lo) hi = mid - 1;
        else if (cp > r[mid].hi) lo = mid + 1;
        else return 1;
    }
    return 0;
}

tok_gc tok_gc_of(uint32_t cp) {
    if (cp > 0x10FFFF) return TOK_Cn;
    int lo = 0, hi = tok_gc_run_count - 1;   /* the last run whose first <= cp */
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (tok_gc_runs[mid].first <= cp) lo = mid;
        else hi = mid - 1;
    }
    return (tok_gc)tok_gc_runs[lo].gc;
}

int tok_is_white_space(uint32_t cp) { return in_ranges(tok_white_space, tok_white_space_count, cp); }

int tok_is_rust_word(uint32_t cp) {
    const uint32_t word = TOK_GC_L | TOK_GC_M | TOK_GC_BIT(TOK_Nl) | TOK_GC_BIT(TOK_Nd) | TOK_GC_BIT(TOK_Pc);
    if (word & TOK_GC_BIT(tok_gc_of(cp))) return 1;
    return cp == 0x200C || cp == 0x200D || in_ranges(tok_alphabetic_other, tok_alphabetic_other_count, cp);
}
