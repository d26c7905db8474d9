/* checkpoint.c: Hugging Face checkpoints made of one safetensors file or of shards listed in a
 * `*.safetensors.index.json` (see lunar/safetensors.h). */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "io.h"
#include "lunar/safetensors.h"

#define INDEX_NAME  "model.safetensors.index.json"
#define SINGLE_NAME "model.safetensors"

typedef struct ck_entry {
    const lunar_safetensors_info *info;
    int                           shard;
} ck_entry;

struct lunar_checkpoint {
    char               *path;
    int                 n_shards;
    lunar_safetensors **shards;
    int                 n;
    ck_entry           *entries;   /* sorted by name */
};

static int is_dir(const char *p) {
    struct stat sb;
    return stat(p, &sb) == 0 && S_ISDIR(sb.st_mode);
}

static int is_file(const char *p) {
    struct stat sb;
    return stat(p, &sb) == 0 && S_ISREG(sb.st_mode);
}

static int ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

static char *join(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s", dir, name);
    return p;
}

static char *dir_of(const char *path) {
    const char *s = strrchr(path, '/');
    if (!s) return strdup(".");
    if (s == path) return strdup("/");
    return strndup(path, (size_t)(s - path));
}

static int cmp_entry(const void *a, const void *b) {
    return strcmp(((const ck_entry *)a)->info->name, ((const ck_entry *)b)->info->name);
}

void lunar_checkpoint_close(lunar_ctx *ctx, lunar_checkpoint *c) {
    if (!c) return;
    for (int i = 0; i < c->n_shards; i++) lunar_safetensors_close(ctx, c->shards[i]);
    free(c->shards);
    free(c->entries);
    free(c->path);
    free(c);
}

/* In a directory without the standard names: the only file ending in suffix, if exactly one. */
static lunar_status find_single(lunar_ctx *ctx, const char *dir, const char *suffix, const char *exclude_suffix,
                                char **out, int *count) {
    *out = NULL;
    *count = 0;
    DIR *d = opendir(dir);
    if (!d) return LUNAR_FAIL(ctx, LUNAR_ERR_IO, "%s: cannot list the directory: %s", dir, strerror(errno));
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (!ends_with(de->d_name, suffix)) continue;
        if (exclude_suffix && ends_with(de->d_name, exclude_suffix)) continue;
        if (++*count == 1) *out = join(dir, de->d_name);
    }
    closedir(d);
    if (*count != 1) {
        free(*out);
        *out = NULL;
    }
    return LUNAR_OK;
}

/* a shard file name from an index: a relative path that does not climb out of the directory */
static int shard_name_ok(const char *s) {
    if (!*s || s[0] == '/') return 0;
    for (const char *p = s; *p;) {
        const char *slash = strchr(p, '/');
        size_t len = slash ? (size_t)(slash - p) : strlen(p);
        if (len == 2 && p[0] == '.' && p[1] == '.') return 0;
        if (!slash) break;
        p = slash + 1;
    }
    return 1;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(const char *const *)a, *(const char *const *)b); }

static lunar_status open_index(lunar_ctx *ctx, lunar_checkpoint *c, const char *index_path) {
    cJSON *root = NULL;
    LUNAR_TRY(lunar_json_read_file(ctx, index_path, &root));
    lunar_status st = LUNAR_OK;
    const cJSON *wm = cJSON_IsObject(root) ? cJSON_GetObjectItemCaseSensitive(root, "weight_map") : NULL;
    const char **shard_names = NULL;
    char *dir = NULL;
    if (!cJSON_IsObject(root)) st = LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: the index is not a JSON object", index_path);
    else if (!wm) st = LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: the index has no weight_map", index_path);
    else if (!cJSON_IsObject(wm))
        st = LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: weight_map must be an object mapping tensor names to shard files",
                        index_path);
    int n = st == LUNAR_OK ? cJSON_GetArraySize(wm) : 0;
    if (st == LUNAR_OK) {
        shard_names = calloc((size_t)(n ? n : 1), sizeof *shard_names);
        c->entries = calloc((size_t)(n ? n : 1), sizeof *c->entries);
        dir = dir_of(index_path);
        if (!shard_names || !c->entries || !dir) st = LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory", index_path);
    }
    /* every value a valid shard name; the distinct shards, sorted */
    int k = 0;
    for (const cJSON *e = st == LUNAR_OK ? wm->child : NULL; e && st == LUNAR_OK; e = e->next) {
        if (!cJSON_IsString(e))
            st = LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: weight_map entry for tensor '%s' is not a file name", index_path,
                            e->string);
        else if (!shard_name_ok(e->valuestring))
            st = LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT,
                            "%s: weight_map entry for tensor '%s' names the shard '%s', which is not a file inside the "
                            "checkpoint directory", index_path, e->string, e->valuestring);
        else shard_names[k++] = e->valuestring;
    }
    if (st == LUNAR_OK) {
        const char **names = malloc(sizeof *names * (size_t)(n ? n : 1));
        if (!names) st = LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory", index_path);
        else {
            int j = 0;
            for (const cJSON *e = wm->child; e; e = e->next) names[j++] = e->string;
            qsort(names, (size_t)n, sizeof *names, cmp_str);
            for (int i = 1; i < n && st == LUNAR_OK; i++)
                if (strcmp(names[i], names[i - 1]) == 0)
                    st = LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: tensor '%s' appears twice in weight_map", index_path, names[i]);
            free(names);
        }
    }
    int ns = 0;
    if (st == LUNAR_OK) {
        qsort(shard_names, (size_t)k, sizeof *shard_names, cmp_str);
        for (int i = 0; i < k; i++)
            if (ns == 0 || strcmp(shard_names[i], shard_names[ns - 1]) != 0) shard_names[ns++] = shard_names[i];
        /* every shard must exist before any is opened, so a missing one is reported as such */
        for (int i = 0; i < ns && st == LUNAR_OK; i++) {
            char *p = join(dir, shard_names[i]);
            if (!p) st = LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory", index_path);
            else if (!is_file(p)) {
                const char *example = "";
                int users = 0;
                for (const cJSON *e = wm->child; e; e = e->next)
                    if (strcmp(e->valuestring, shard_names[i]) == 0 && users++ == 0) example = e->string;
                st = LUNAR_FAIL(ctx, LUNAR_ERR_IO,
                                "%s: shard '%s' (holding tensor '%s'%s) does not exist (looked for %s)", index_path,
                                shard_names[i], example, users > 1 ? " and others" : "", p);
            }
            free(p);
        }
    }
    if (st == LUNAR_OK) {
        c->shards = calloc((size_t)(ns ? ns : 1), sizeof *c->shards);
        if (!c->shards) st = LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory", index_path);
    }
    for (int i = 0; i < ns && st == LUNAR_OK; i++) {
        char *p = join(dir, shard_names[i]);
        if (!p) st = LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory", index_path);
        else st = lunar_safetensors_open(ctx, &c->shards[i], p);
        if (st == LUNAR_OK) c->n_shards++;
        else if (p) lunar_ctx_prefix_error(ctx, "%s: shard '%s'", index_path, shard_names[i]);
        free(p);
    }
    /* every listed tensor must be in its shard */
    for (const cJSON *e = st == LUNAR_OK ? wm->child : NULL; e && st == LUNAR_OK; e = e->next) {
        int lo = 0, hi = ns - 1, si = -1;
        while (lo <= hi) {
            int mid = lo + (hi - lo) / 2, cmp = strcmp(e->valuestring, shard_names[mid]);
            if (cmp == 0) { si = mid; break; }
            if (cmp < 0) hi = mid - 1;
            else lo = mid + 1;
        }
        const lunar_safetensors_info *info = si >= 0 ? lunar_safetensors_find(c->shards[si], e->string) : NULL;
        if (!info) {
            st = LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: tensor '%s' is mapped to shard '%s', but that shard has no such tensor",
                            index_path, e->string, e->valuestring);
        } else {
            c->entries[c->n].info = info;
            c->entries[c->n].shard = si;
            c->n++;
        }
    }
    free(shard_names);
    free(dir);
    cJSON_Delete(root);
    return st;
}

lunar_status lunar_checkpoint_open(lunar_ctx *ctx, lunar_checkpoint **out, const char *path) {
    *out = NULL;
    lunar_checkpoint *c = calloc(1, sizeof *c);
    if (!c) return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory", path);
    lunar_status st = LUNAR_OK;
    char *file = NULL;
    if (is_dir(path)) {
        char *idx = join(path, INDEX_NAME), *single = join(path, SINGLE_NAME);
        if (!idx || !single) st = LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory", path);
        else if (is_file(idx)) file = idx, idx = NULL;
        else if (is_file(single)) file = single, single = NULL;
        else {
            int ni = 0, nf = 0;
            st = find_single(ctx, path, ".safetensors.index.json", NULL, &file, &ni);
            if (st == LUNAR_OK && !file) st = find_single(ctx, path, ".safetensors", NULL, &file, &nf);
            if (st == LUNAR_OK && !file) {
                if (ni > 1 || nf > 1)
                    st = LUNAR_FAIL(ctx, LUNAR_ERR_IO,
                                    "%s: no " INDEX_NAME " or " SINGLE_NAME ", and %d index files and %d .safetensors "
                                    "files to choose from: pass the file to load",
                                    path, ni, nf);
                else
                    st = LUNAR_FAIL(ctx, LUNAR_ERR_IO, "%s: no " INDEX_NAME ", " SINGLE_NAME " or other .safetensors file here",
                                    path);
            }
        }
        free(idx);
        free(single);
    } else {
        file = strdup(path);
        if (!file) st = LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory", path);
    }
    if (st == LUNAR_OK) {
        c->path = file;
        file = NULL;
        if (ends_with(c->path, ".json")) {
            st = open_index(ctx, c, c->path);
        } else {
            c->shards = calloc(1, sizeof *c->shards);
            if (!c->shards) st = LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory", path);
            else st = lunar_safetensors_open(ctx, &c->shards[0], c->path);
            if (st == LUNAR_OK) {
                c->n_shards = 1;
                int n = lunar_safetensors_count(c->shards[0]);
                c->entries = calloc((size_t)(n ? n : 1), sizeof *c->entries);
                if (!c->entries) st = LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory", path);
                for (int i = 0; i < n && st == LUNAR_OK; i++) {
                    c->entries[i].info = lunar_safetensors_entry(c->shards[0], i);
                    c->entries[i].shard = 0;
                    c->n++;
                }
            }
        }
    }
    free(file);
    if (st != LUNAR_OK) {
        lunar_checkpoint_close(ctx, c);
        return st;
    }
    qsort(c->entries, (size_t)c->n, sizeof *c->entries, cmp_entry);
    *out = c;
    return LUNAR_OK;
}

const char *lunar_checkpoint_path(const lunar_checkpoint *c) { return c->path; }
int lunar_checkpoint_count(const lunar_checkpoint *c) { return c->n; }
int lunar_checkpoint_shard_count(const lunar_checkpoint *c) { return c->n_shards; }

const lunar_safetensors *lunar_checkpoint_shard(const lunar_checkpoint *c, int i) {
    return i >= 0 && i < c->n_shards ? c->shards[i] : NULL;
}

const lunar_safetensors_info *lunar_checkpoint_entry(const lunar_checkpoint *c, int i, const lunar_safetensors **shard) {
    if (i < 0 || i >= c->n) return NULL;
    if (shard) *shard = c->shards[c->entries[i].shard];
    return c->entries[i].info;
}

const lunar_safetensors_info *lunar_checkpoint_find(const lunar_checkpoint *c, const char *name,
                                                    const lunar_safetensors **shard) {
    int lo = 0, hi = c->n - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2, cmp = strcmp(name, c->entries[mid].info->name);
        if (cmp == 0) return lunar_checkpoint_entry(c, mid, shard);
        if (cmp < 0) hi = mid - 1;
        else lo = mid + 1;
    }
    return NULL;
}

lunar_status lunar_checkpoint_tensor(lunar_ctx *ctx, lunar_tensor *out, const lunar_checkpoint *c, const char *name) {
    const lunar_safetensors *shard;
    memset(out, 0, sizeof *out);
    if (!lunar_checkpoint_find(c, name, &shard))
        return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "%s: no tensor '%s' in this checkpoint", c->path, name);
    return lunar_safetensors_tensor(ctx, out, shard, name);
}

/* ---- writing ---------------------------------------------------------------------------------- */

typedef struct wm_item {
    const char *name;
    int         shard;
} wm_item;

static int cmp_wm(const void *a, const void *b) { return strcmp(((const wm_item *)a)->name, ((const wm_item *)b)->name); }

/* model-NNNNN-of-NNNNN.safetensors */
static int is_shard_name(const char *s) {
    static const char pat[] = "model-#####-of-#####.safetensors";
    if (strlen(s) != sizeof pat - 1) return 0;
    for (size_t i = 0; pat[i]; i++) {
        if (pat[i] == '#' ? (s[i] < '0' || s[i] > '9') : s[i] != pat[i]) return 0;
    }
    return 1;
}

/* removes files of an earlier save that the new layout does not use */
static lunar_status remove_stale(lunar_ctx *ctx, const char *dir, int n_shards, int sharded) {
    lunar_status st = LUNAR_OK;
    DIR *d = opendir(dir);
    if (!d) return LUNAR_FAIL(ctx, LUNAR_ERR_IO, "%s: cannot list the directory: %s", dir, strerror(errno));
    struct dirent *de;
    char keep_tail[32];
    snprintf(keep_tail, sizeof keep_tail, "-of-%05d.safetensors", n_shards);
    int removed = 0;
    while ((de = readdir(d)) != NULL && st == LUNAR_OK) {
        const char *nm = de->d_name;
        int stale;
        if (is_shard_name(nm)) {
            int idx = atoi(nm + 6);
            stale = !sharded || !ends_with(nm, keep_tail) || idx < 1 || idx > n_shards;
        } else {
            stale = sharded ? strcmp(nm, SINGLE_NAME) == 0 : strcmp(nm, INDEX_NAME) == 0;
        }
        if (!stale) continue;
        char *p = join(dir, nm);
        if (!p) st = LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory", dir);
        else if (unlink(p) != 0 && errno != ENOENT)
            st = LUNAR_FAIL(ctx, LUNAR_ERR_IO, "%s: cannot remove the stale file '%s' of an earlier save: %s", dir, nm,
                            strerror(errno));
        else removed++;
        free(p);
    }
    closedir(d);
    if (st == LUNAR_OK && removed) {
        char *p = join(dir, "x");
        if (p) st = lunar_fsync_parent_dir(ctx, p);
        free(p);
    }
    return st;
}

lunar_status lunar_checkpoint_save(lunar_ctx *ctx, const char *dir, int n, const char *const *names,
                                   const lunar_tensor *const *tensors, uint64_t max_shard_bytes,
                                   const lunar_safetensors_write_opts *opts) {
    if (max_shard_bytes == 0) return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "%s: max_shard_bytes must be positive", dir);
    if (n < 0) return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "%s: negative tensor count", dir);
    for (int i = 0; i < n; i++) {
        if (!names[i] || !tensors[i]) return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "%s: tensor %d has no name or no tensor", dir, i);
        if (lunar_tensor_check(ctx, tensors[i]) != LUNAR_OK) {
            lunar_ctx_prefix_error(ctx, "%s: tensor '%s'", dir, names[i]);
            return lunar_ctx_status(ctx);
        }
    }
    {   /* names unique across shards */
        const char **sorted = malloc(sizeof *sorted * (size_t)(n ? n : 1));
        if (!sorted) return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory", dir);
        memcpy(sorted, names, sizeof *sorted * (size_t)n);
        qsort(sorted, (size_t)n, sizeof *sorted, cmp_str);
        for (int i = 1; i < n; i++)
            if (strcmp(sorted[i], sorted[i - 1]) == 0) {
                lunar_status st = LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "%s: tensor name '%s' is given twice", dir, sorted[i]);
                free(sorted);
                return st;
            }
        free(sorted);
    }
    LUNAR_TRY(lunar_mkdir_p(ctx, dir));
    /* plan: shard[i] = index of the shard tensor i goes to */
    int *shard = calloc((size_t)(n ? n : 1), sizeof *shard);
    if (!shard) return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory", dir);
    int ns = 0;
    uint64_t cur = 0, total = 0;
    for (int i = 0; i < n; i++) {
        uint64_t b = (uint64_t)lunar_tensor_nbytes(tensors[i]);
        if (ns == 0 || (cur > 0 && cur + b > max_shard_bytes)) {
            ns++;
            cur = 0;
        }
        shard[i] = ns - 1;
        cur += b;
        total += b;
    }
    if (ns == 0) ns = 1;
    lunar_status st = LUNAR_OK;
    const char **sn = malloc(sizeof *sn * (size_t)(n ? n : 1));
    const lunar_tensor **st_t = malloc(sizeof *st_t * (size_t)(n ? n : 1));
    char *path = malloc(strlen(dir) + 64);
    if (!sn || !st_t || !path) st = LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory", dir);
    for (int s = 0; s < ns && st == LUNAR_OK; s++) {
        int k = 0;
        for (int i = 0; i < n; i++)
            if (shard[i] == s) {
                sn[k] = names[i];
                st_t[k] = tensors[i];
                k++;
            }
        if (ns == 1) sprintf(path, "%s/%s", dir, SINGLE_NAME);
        else sprintf(path, "%s/model-%05d-of-%05d.safetensors", dir, s + 1, ns);
        st = lunar_safetensors_save(ctx, path, k, sn, st_t, opts);
    }
    if (st == LUNAR_OK && ns > 1) {
        /* the index: keys sorted, 2-space indent, like transformers' save_pretrained */
        wm_item *order = malloc(sizeof *order * (size_t)n);
        lunar_buf b = {0};
        if (!order) st = LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory", dir);
        else {
            for (int i = 0; i < n; i++) order[i] = (wm_item){names[i], shard[i]};
            qsort(order, (size_t)n, sizeof *order, cmp_wm);
            lunar_buf_printf(&b, "{\n  \"metadata\": {\n    \"total_size\": %llu\n  },\n  \"weight_map\": {",
                             (unsigned long long)total);
            for (int i = 0; i < n; i++) {
                lunar_buf_puts(&b, i ? ",\n    " : "\n    ");
                lunar_json_put_string(&b, order[i].name, strlen(order[i].name));
                lunar_buf_printf(&b, ": \"model-%05d-of-%05d.safetensors\"", order[i].shard + 1, ns);
            }
            lunar_buf_puts(&b, "\n  }\n}\n");
            sprintf(path, "%s/%s", dir, INDEX_NAME);
            if (b.oom) st = LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory building the index", dir);
            else st = lunar_write_file_atomic(ctx, path, b.data, b.len);
        }
        lunar_buf_free(&b);
        free(order);
    }
    if (st == LUNAR_OK) st = remove_stale(ctx, dir, ns, ns > 1);
    free(shard);
    free(sn);
    free(st_t);
    free(path);
    return st;
}
