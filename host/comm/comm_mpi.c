/* comm_mpi.c: process groups over MPI; collectives on CPU tensors through MPI, on CUDA tensors
 * through NCCL (comm_nccl.cu), after the same validation, cross-rank signature check and
 * staging of non-contiguous tensors.
 *
 * Every collective follows the same steps:
 *   1. local checks (validity, devices, dtypes, shapes against each other, counts), naming the
 *      op, the group and the tensors;
 *   2. the signature check across the group (see sig_check), so every member fails together;
 *   3. a group of one member is done locally (a copy at most), without MPI or NCCL, unless the
 *      tensor is on CUDA and the group's NCCL communicator was made explicitly (nccl_init);
 *   4. contiguous staging tensors (the tensor itself when it already is one), f32 for CPU
 *      reductions of bf16/f16/f8;
 *   5. the MPI or NCCL call, then the copy back into the caller's tensor.
 *
 * Builds without MPI (LUNAR_WITH_MPI undefined) have only the single-rank world and its splits,
 * all made without MPI: CPU collectives are copies there and the MPI transport below is never
 * reached (its names then expand to an error).
 */
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef LUNAR_WITH_MPI
#include <mpi.h>
#endif

#include "comm_nccl.h"
#include "lunar/comm.h"
#include "lunar/ops.h"

struct lunar_comm {
    char        name[LUNAR_COMM_NAME_MAX];
    int         rank, size, local_rank;
    int         use_mpi;        /* 0: a single-rank group made without MPI */
#ifdef LUNAR_WITH_MPI
    MPI_Comm    mpi;            /* MPI_COMM_NULL when !use_mpi */
#endif
    int         checks;
    int        *world_ranks;    /* size entries */
    lunar_nccl *nccl;           /* CUDA builds: made on the first CUDA collective, or by nccl_init */
};

/* tags of point-to-point messages: the signature goes ahead of the data */
#define TAG_HEADER 4101
#define TAG_DATA   4102
/* MPI counts are ints: all-reduce and broadcast are done in chunks of this many elements */
#define MPI_CHUNK  ((int64_t)1 << 30)

/* ---- names, environment ---------------------------------------------------------------------- */

static const char *const op_names[LUNAR_COMM_OP_COUNT] = {"sum", "avg", "max", "min"};

const char *lunar_comm_op_name(lunar_comm_op op) {
    return (op >= 0 && op < LUNAR_COMM_OP_COUNT) ? op_names[op] : "?";
}

int lunar_comm_op_from_name(const char *name, lunar_comm_op *out) {
    for (int i = 0; name && i < LUNAR_COMM_OP_COUNT; i++)
        if (strcmp(name, op_names[i]) == 0) {
            *out = (lunar_comm_op)i;
            return 1;
        }
    return 0;
}

static const char *env_first(const char *const *names) {
    for (; *names; names++) {
        const char *v = getenv(*names);
        if (v && *v) return v;
    }
    return NULL;
}

int lunar_comm_env_launched(void) {
    static const char *const names[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", NULL};
    return env_first(names) != NULL;
}

int lunar_comm_env_rank(void) {
    static const char *const names[] = {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID", NULL};
    const char *v = lunar_comm_env_launched() ? env_first(names) : NULL;
    return v ? atoi(v) : 0;
}

int lunar_comm_env_size(void) {
    static const char *const names[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS", NULL};
    const char *v = lunar_comm_env_launched() ? env_first(names) : NULL;
    int n = v ? atoi(v) : 1;
    return n > 0 ? n : 1;
}

int lunar_comm_env_local_rank(void) {
    static const char *const names[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", NULL};
    const char *v = lunar_comm_env_launched() ? env_first(names) : NULL;
    return v ? atoi(v) : -1;
}

#ifdef LUNAR_WITH_MPI
int lunar_comm_mpi_active(void) {
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    return init && !fin;
}

void lunar_comm_finalize(void) {
    if (lunar_comm_mpi_active()) MPI_Finalize();
}

void lunar_comm_abort(int code) {
    if (lunar_comm_mpi_active()) MPI_Abort(MPI_COMM_WORLD, code);
}
#else
int lunar_comm_mpi_active(void) { return 0; }
void lunar_comm_finalize(void) {}
void lunar_comm_abort(int code) { (void)code; }
#endif

/* ---- errors ---------------------------------------------------------------------------------- */

/* "<op> (group '<name>', <n> ranks): <message>" */
static lunar_status failc(lunar_ctx *ctx, lunar_status st, int line, const lunar_comm *c, const char *op,
                          const char *fmt, ...) __attribute__((format(printf, 6, 7)));
static lunar_status failc(lunar_ctx *ctx, lunar_status st, int line, const lunar_comm *c, const char *op,
                          const char *fmt, ...) {
    char msg[1536];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return lunar_fail(ctx, st, __FILE__, line, "%s (group '%s', %d rank%s): %s", op, c->name, c->size,
                      c->size == 1 ? "" : "s", msg);
}
#define FAILC(ctx, st, c, op, ...) failc((ctx), (st), __LINE__, (c), (op), __VA_ARGS__)

/* "f32 (4, 8) on cpu" */
static void describe(const lunar_tensor *t, char *buf, size_t n) {
    char sh[160], dev[32];
    lunar_tensor_shape_str(t, sh, sizeof sh);
    lunar_device_format(lunar_tensor_device(t), dev, sizeof dev);
    snprintf(buf, n, "'%s' %s %s on %s", lunar_tensor_label(t), lunar_dtype_name(t->dtype), sh, dev);
}

static lunar_status check_tensor(lunar_ctx *ctx, const lunar_comm *c, const char *op, const char *role,
                                 const lunar_tensor *t) {
    lunar_status st = lunar_tensor_check(ctx, t);
    if (st != LUNAR_OK) lunar_ctx_prefix_error(ctx, "%s (group '%s'): %s", op, c->name, role);
    return st;
}

/* Tensors written by a collective: an expanded view (stride 0) cannot take different values. */
static lunar_status check_writable(lunar_ctx *ctx, const lunar_comm *c, const char *op, const char *role,
                                   const lunar_tensor *t) {
    for (int i = 0; i < t->ndim; i++)
        if (t->stride[i] == 0 && t->shape[i] > 1) {
            char a[256];
            describe(t, a, sizeof a);
            return FAILC(ctx, LUNAR_ERR_ARG, c, op, "%s %s is an expanded view and cannot be written", role, a);
        }
    return LUNAR_OK;
}

static lunar_status check_pair(lunar_ctx *ctx, const lunar_comm *c, const char *op, const lunar_tensor *out,
                               const lunar_tensor *in) {
    LUNAR_TRY(check_tensor(ctx, c, op, "out", out));
    LUNAR_TRY(check_tensor(ctx, c, op, "in", in));
    LUNAR_TRY(check_writable(ctx, c, op, "out", out));
    char a[256], b[256];
    describe(out, a, sizeof a);
    describe(in, b, sizeof b);
    if (!lunar_device_equal(lunar_tensor_device(out), lunar_tensor_device(in)))
        return FAILC(ctx, LUNAR_ERR_DEVICE, c, op, "out %s and in %s are on different devices", a, b);
    if (out->dtype != in->dtype)
        return FAILC(ctx, LUNAR_ERR_DTYPE, c, op, "out %s and in %s have different dtypes", a, b);
    if (in->ndim < 1 || out->ndim != in->ndim)
        return FAILC(ctx, LUNAR_ERR_SHAPE, c, op, "out %s and in %s need the same number of dims (at least 1)", a, b);
    for (int i = 1; i < in->ndim; i++)
        if (out->shape[i] != in->shape[i])
            return FAILC(ctx, LUNAR_ERR_SHAPE, c, op, "out %s and in %s differ past the first dim", a, b);
    return LUNAR_OK;
}

static int is_cuda(const lunar_tensor *t) { return lunar_tensor_device(t).type == LUNAR_DEVICE_CUDA; }

/* ---- reductions: which ops a dtype takes, and in which dtype they run ------------------------- */

static lunar_status check_reduce(lunar_ctx *ctx, const lunar_comm *c, const char *op, const lunar_tensor *t,
                                 lunar_comm_op rop) {
    if (rop < 0 || rop >= LUNAR_COMM_OP_COUNT)
        return FAILC(ctx, LUNAR_ERR_ARG, c, op, "unknown reduce op %d", (int)rop);
    if (rop == LUNAR_COMM_AVG && !lunar_dtype_is_float(t->dtype))
        return FAILC(ctx, LUNAR_ERR_DTYPE, c, op, "op avg needs a floating dtype, '%s' is %s", lunar_tensor_label(t),
                     lunar_dtype_name(t->dtype));
    if (rop == LUNAR_COMM_SUM && t->dtype == LUNAR_DTYPE_BOOL)
        return FAILC(ctx, LUNAR_ERR_DTYPE, c, op, "op sum is not defined for bool '%s' (use max or min)",
                     lunar_tensor_label(t));
    return LUNAR_OK;
}

/* MPI has no 16- or 8-bit floats, NCCL no float8 reductions on every arch: those run in f32. */
static lunar_dtype reduce_dtype(const lunar_tensor *t) {
    switch (t->dtype) {
    case LUNAR_DTYPE_F8E4M3:
    case LUNAR_DTYPE_F8E5M2:
        return LUNAR_DTYPE_F32;
    case LUNAR_DTYPE_BF16:
    case LUNAR_DTYPE_F16:
        return is_cuda(t) ? t->dtype : LUNAR_DTYPE_F32;
    default:
        return t->dtype;
    }
}

/* ---- staging --------------------------------------------------------------------------------- */

/* A contiguous tensor of dtype dt for t: t itself when it already is one (and force is 0), else
 * a temporary that holds t's values when copy is set. */
typedef struct stage {
    lunar_tensor t;
    int          temp;
} stage;

static lunar_status stage_make(lunar_ctx *ctx, stage *s, const lunar_tensor *t, lunar_dtype dt, int copy, int force) {
    memset(s, 0, sizeof *s);
    if (!force && t->dtype == dt && lunar_tensor_is_contiguous(t)) {
        lunar_tensor_share(&s->t, t);
        return LUNAR_OK;
    }
    s->temp = 1;
    LUNAR_TRY(lunar_tensor_new(ctx, &s->t, dt, lunar_tensor_device(t), t->ndim, t->shape));
    return copy ? lunar_copy(ctx, &s->t, t) : LUNAR_OK;
}

static lunar_status stage_back(lunar_ctx *ctx, lunar_tensor *t, const stage *s) {
    return s->temp ? lunar_copy(ctx, t, &s->t) : LUNAR_OK;
}

static void stage_release(lunar_ctx *ctx, stage *s) { lunar_tensor_release(ctx, &s->t); }

/* ---- signatures: one small all-reduce that catches mismatched calls ---------------------------- */

enum {
    K_ALL_REDUCE = 1, K_ALL_GATHER, K_REDUCE_SCATTER, K_BROADCAST, K_ALL_TO_ALL, K_BARRIER, K_ALL_REDUCE_START,
    K_REDUCE_SCATTER_START, K_SEND
};
static const char *const kind_names[] = {"?", "all_reduce", "all_gather", "reduce_scatter", "broadcast",
                                         "all_to_all", "barrier", "all_reduce_start", "reduce_scatter_start",
                                         "send"};

enum {
    SIG_KIND = 0, SIG_DTYPE, SIG_DEV, SIG_NDIM, SIG_SHAPE,
    SIG_EXTRA = SIG_SHAPE + LUNAR_MAX_DIMS,   /* reduce op or root */
    SIG_BAD_PEER, SIG_BAD_WANT, SIG_BAD_GOT,  /* all_to_all count mismatch seen by this member */
    SIG_N
};
#define SIG_ANY_ROWS (-2)   /* dim 0 that may differ between members (all_to_all) */

static void sig_make(int64_t *s, int kind, const lunar_tensor *t, int any_rows, int64_t extra) {
    for (int i = 0; i < SIG_N; i++) s[i] = -1;
    s[SIG_KIND] = kind;
    s[SIG_EXTRA] = extra;
    s[SIG_BAD_WANT] = s[SIG_BAD_GOT] = 0;
    if (!t) return;
    s[SIG_DTYPE] = t->dtype;
    s[SIG_DEV] = lunar_tensor_device(t).type;
    s[SIG_NDIM] = t->ndim;
    for (int i = 0; i < t->ndim; i++) s[SIG_SHAPE + i] = t->shape[i];
    if (any_rows && t->ndim > 0) s[SIG_SHAPE] = SIG_ANY_ROWS;
}

/* "all_reduce of f32 (4, 8) on cpu, op sum"; without the kind: "f32 (4, 8) on cpu" */
static void sig_format(const int64_t *s, int with_kind, char *buf, size_t n) {
    int kind = (s[SIG_KIND] >= 1 && s[SIG_KIND] <= K_SEND) ? (int)s[SIG_KIND] : 0;
    int len = 0;
    buf[0] = 0;
    if (with_kind) len = snprintf(buf, n, "%s", kind_names[kind]);
    if (s[SIG_NDIM] >= 0 && len < (int)n) {
        len += snprintf(buf + len, n - (size_t)len, "%s%s (", with_kind ? " of " : "",
                        (s[SIG_DTYPE] >= 0 && s[SIG_DTYPE] < LUNAR_DTYPE_COUNT) ? lunar_dtype_name((lunar_dtype)s[SIG_DTYPE]) : "?");
        for (int i = 0; i < s[SIG_NDIM] && i < LUNAR_MAX_DIMS && len < (int)n; i++) {
            if (s[SIG_SHAPE + i] == SIG_ANY_ROWS) len += snprintf(buf + len, n - (size_t)len, "%s*", i ? ", " : "");
            else len += snprintf(buf + len, n - (size_t)len, "%s%lld", i ? ", " : "", (long long)s[SIG_SHAPE + i]);
        }
        if (len < (int)n)
            len += snprintf(buf + len, n - (size_t)len, ") on %s", s[SIG_DEV] == LUNAR_DEVICE_CUDA ? "cuda" : "cpu");
    }
    if (len < (int)n && (kind == K_ALL_REDUCE || kind == K_REDUCE_SCATTER || kind == K_ALL_REDUCE_START
                         || kind == K_REDUCE_SCATTER_START) && s[SIG_EXTRA] >= 0)
        len += snprintf(buf + len, n - (size_t)len, ", op %s", lunar_comm_op_name((lunar_comm_op)s[SIG_EXTRA]));
    if (len < (int)n && kind == K_BROADCAST) snprintf(buf + len, n - (size_t)len, ", root %lld", (long long)s[SIG_EXTRA]);
}

/* 1 for a group made through MPI. Always 0 in builds without MPI, so the compiler drops the
 * paths that need MPI there. */
static int via_mpi(const lunar_comm *c) {
#ifdef LUNAR_WITH_MPI
    return c->use_mpi;
#else
    (void)c;
    return 0;
#endif
}

static int checked(const lunar_comm *c) { return c->checks && via_mpi(c) && c->size > 1; }

static lunar_comm *comm_alloc(int size, const char *name) {
    lunar_comm *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->world_ranks = calloc((size_t)(size > 0 ? size : 1), sizeof *c->world_ranks);
    if (!c->world_ranks) {
        free(c);
        return NULL;
    }
    snprintf(c->name, sizeof c->name, "%s", name && *name ? name : "group");
    c->checks = 1;
    c->size = size;
    c->local_rank = -1;
    return c;
}

/* ---- the MPI transport ------------------------------------------------------------------------
 * Everything that calls MPI. Reached only for groups made through MPI (use_mpi) with more than
 * one member: the collectives below return earlier for a group of one. */

#ifdef LUNAR_WITH_MPI

static lunar_status mpi_status(lunar_ctx *ctx, int rc, const lunar_comm *c, const char *op, const char *call) {
    if (rc == MPI_SUCCESS) return LUNAR_OK;
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    msg[0] = 0;
    MPI_Error_string(rc, msg, &len);
    return FAILC(ctx, LUNAR_ERR_COMM, c, op, "%s failed: %s", call, msg);
}

static MPI_Datatype mpi_reduce_type(lunar_dtype dt) {
    switch (dt) {
    case LUNAR_DTYPE_F32: return MPI_FLOAT;
    case LUNAR_DTYPE_F64: return MPI_DOUBLE;
    case LUNAR_DTYPE_I8: return MPI_INT8_T;
    case LUNAR_DTYPE_I32: return MPI_INT32_T;
    case LUNAR_DTYPE_I64: return MPI_INT64_T;
    default: return MPI_UINT8_T;   /* u8, bool */
    }
}

static MPI_Op mpi_op(lunar_comm_op op) {
    switch (op) {
    case LUNAR_COMM_MAX: return MPI_MAX;
    case LUNAR_COMM_MIN: return MPI_MIN;
    default: return MPI_SUM;   /* sum, avg (divided afterwards) */
    }
}

/* An unsigned integer type of the element size, for moves (counts stay in elements). */
static MPI_Datatype mpi_unit(size_t elem_size) {
    switch (elem_size) {
    case 2: return MPI_UINT16_T;
    case 4: return MPI_UINT32_T;
    case 8: return MPI_UINT64_T;
    default: return MPI_UINT8_T;
    }
}

/* t /= n for a contiguous f32 or f64 CPU tensor (avg after an MPI sum) */
static void divide(lunar_tensor *t, int n) {
    int64_t count = lunar_tensor_numel(t);
    if (t->dtype == LUNAR_DTYPE_F64) {
        double *p = lunar_tensor_data(t);
        for (int64_t i = 0; i < count; i++) p[i] /= (double)n;
    } else {
        float *p = lunar_tensor_data(t);
        for (int64_t i = 0; i < count; i++) p[i] /= (float)n;
    }
}

static lunar_status check_count(lunar_ctx *ctx, const lunar_comm *c, const char *op, int64_t n) {
    if (n > INT_MAX)
        return FAILC(ctx, LUNAR_ERR_UNSUPPORTED, c, op, "%lld elements exceed MPI's int count; split the tensor",
                     (long long)n);
    return LUNAR_OK;
}

/* buf (n values) = the element-wise max over the group, in place */
static lunar_status mpi_max_i64(lunar_ctx *ctx, lunar_comm *c, const char *op, const char *what, int64_t *buf, int n) {
    return mpi_status(ctx, MPI_Allreduce(MPI_IN_PLACE, buf, n, MPI_INT64_T, MPI_MAX, c->mpi), c, op, what);
}

/* all = every member's mine (n values each), in rank order */
static lunar_status mpi_gather_i64(lunar_ctx *ctx, lunar_comm *c, const char *op, const char *what,
                                   const int64_t *mine, int64_t *all, int n) {
    return mpi_status(ctx, MPI_Allgather(mine, n, MPI_INT64_T, all, n, MPI_INT64_T, c->mpi), c, op, what);
}

/* theirs[j] = what member j has in mine[me] (one value per member both ways) */
static lunar_status mpi_transpose_i64(lunar_ctx *ctx, lunar_comm *c, const char *op, const char *what,
                                      const int64_t *mine, int64_t *theirs) {
    return mpi_status(ctx, MPI_Alltoall(mine, 1, MPI_INT64_T, theirs, 1, MPI_INT64_T, c->mpi), c, op, what);
}

#ifdef LUNAR_WITH_NCCL
/* root's n bytes at buf to every member (the NCCL id) */
static lunar_status mpi_bcast_bytes(lunar_ctx *ctx, lunar_comm *c, const char *op, const char *what, void *buf,
                                    int n, int root) {
    return mpi_status(ctx, MPI_Bcast(buf, n, MPI_BYTE, root, c->mpi), c, op, what);
}
#endif

/* send nsend elements of send_size bytes to dst and/or receive nrecv elements of recv_size bytes
 * from src (either buffer may be NULL) */
static lunar_status mpi_exchange(lunar_ctx *ctx, lunar_comm *c, const char *op, int tag, void *recv, int64_t nrecv,
                                 size_t recv_size, int src, const void *send, int64_t nsend, size_t send_size,
                                 int dst) {
    LUNAR_TRY(check_count(ctx, c, op, nsend > nrecv ? nsend : nrecv));
    MPI_Datatype ru = mpi_unit(recv_size), su = mpi_unit(send_size);
    int rc;
    const char *call;
    if (send && recv) {
        call = "MPI_Sendrecv";
        rc = MPI_Sendrecv(send, (int)nsend, su, dst, tag, recv, (int)nrecv, ru, src, tag, c->mpi, MPI_STATUS_IGNORE);
    } else if (send) {
        call = "MPI_Send";
        rc = MPI_Send(send, (int)nsend, su, dst, tag, c->mpi);
    } else {
        call = "MPI_Recv";
        rc = MPI_Recv(recv, (int)nrecv, ru, src, tag, c->mpi, MPI_STATUS_IGNORE);
    }
    return mpi_status(ctx, rc, c, op, tag == TAG_HEADER ? "header exchange" : call);
}

/* t (contiguous, a reduce dtype) = op over the group, in chunks of MPI_CHUNK elements */
static lunar_status mpi_all_reduce(lunar_ctx *ctx, lunar_comm *c, const char *op, lunar_tensor *t, lunar_comm_op rop) {
    int64_t count = lunar_tensor_numel(t);
    size_t el = lunar_dtype_size(t->dtype);
    char *p = lunar_tensor_data(t);
    for (int64_t off = 0; off < count; off += MPI_CHUNK) {
        int k = (int)(count - off < MPI_CHUNK ? count - off : MPI_CHUNK);
        LUNAR_TRY(mpi_status(ctx, MPI_Allreduce(MPI_IN_PLACE, p + (size_t)off * el, k, mpi_reduce_type(t->dtype),
                                                mpi_op(rop), c->mpi), c, op, "MPI_Allreduce"));
    }
    if (rop == LUNAR_COMM_AVG) divide(t, c->size);
    return LUNAR_OK;
}

static lunar_status mpi_all_gather(lunar_ctx *ctx, lunar_comm *c, const char *op, lunar_tensor *out,
                                   const lunar_tensor *in) {
    int64_t count = lunar_tensor_numel(in);
    LUNAR_TRY(check_count(ctx, c, op, count * c->size));
    MPI_Datatype u = mpi_unit(lunar_dtype_size(in->dtype));
    return mpi_status(ctx, MPI_Allgather(lunar_tensor_data(in), (int)count, u, lunar_tensor_data(out), (int)count, u,
                                         c->mpi), c, op, "MPI_Allgather");
}

static lunar_status mpi_reduce_scatter(lunar_ctx *ctx, lunar_comm *c, const char *op, lunar_tensor *out,
                                       const lunar_tensor *in, lunar_comm_op rop) {
    int64_t count = lunar_tensor_numel(out);
    LUNAR_TRY(check_count(ctx, c, op, count));
    LUNAR_TRY(mpi_status(ctx, MPI_Reduce_scatter_block(lunar_tensor_data(in), lunar_tensor_data(out), (int)count,
                                                       mpi_reduce_type(in->dtype), mpi_op(rop), c->mpi),
                         c, op, "MPI_Reduce_scatter_block"));
    if (rop == LUNAR_COMM_AVG) divide(out, c->size);
    return LUNAR_OK;
}

static lunar_status mpi_broadcast(lunar_ctx *ctx, lunar_comm *c, const char *op, lunar_tensor *t, int root) {
    int64_t count = lunar_tensor_numel(t);
    size_t el = lunar_dtype_size(t->dtype);
    char *p = lunar_tensor_data(t);
    for (int64_t off = 0; off < count; off += MPI_CHUNK) {
        int k = (int)(count - off < MPI_CHUNK ? count - off : MPI_CHUNK);
        LUNAR_TRY(mpi_status(ctx, MPI_Bcast(p + (size_t)off * el, k, mpi_unit(el), root, c->mpi), c, op, "MPI_Bcast"));
    }
    return LUNAR_OK;
}

/* counts and displacements in rows, with a row datatype, so they stay far from INT_MAX */
static lunar_status mpi_all_to_all(lunar_ctx *ctx, lunar_comm *c, const char *op, lunar_tensor *out,
                                   const lunar_tensor *in, const int64_t *send_rows, const int64_t *recv_rows,
                                   int64_t row_elems) {
    int64_t send_total = in->shape[0], recv_total = out->shape[0];
    LUNAR_TRY(check_count(ctx, c, op, row_elems));
    LUNAR_TRY(check_count(ctx, c, op, send_total > recv_total ? send_total : recv_total));
    int *v = malloc((size_t)c->size * 4 * sizeof *v);
    if (!v) return FAILC(ctx, LUNAR_ERR_OOM, c, op, "out of host memory");
    int *sc = v, *sd = v + c->size, *rc = v + 2 * c->size, *rd = v + 3 * c->size;
    int64_t so = 0, ro = 0;
    for (int j = 0; j < c->size; j++) {
        sc[j] = (int)send_rows[j], sd[j] = (int)so, so += send_rows[j];
        rc[j] = (int)recv_rows[j], rd[j] = (int)ro, ro += recv_rows[j];
    }
    MPI_Datatype row = MPI_DATATYPE_NULL;
    lunar_status st = mpi_status(ctx, MPI_Type_contiguous((int)row_elems, mpi_unit(lunar_dtype_size(in->dtype)), &row),
                                 c, op, "MPI_Type_contiguous");
    if (st == LUNAR_OK) st = mpi_status(ctx, MPI_Type_commit(&row), c, op, "MPI_Type_commit");
    if (st == LUNAR_OK)
        st = mpi_status(ctx, MPI_Alltoallv(lunar_tensor_data(in), sc, sd, row, lunar_tensor_data(out), rc, rd, row,
                                           c->mpi), c, op, "MPI_Alltoallv");
    if (row != MPI_DATATYPE_NULL) MPI_Type_free(&row);
    free(v);
    return st;
}

/* non-blocking: t (contiguous, a reduce dtype) = op over the group, in place; *r completes it */
static lunar_status mpi_iall_reduce(lunar_ctx *ctx, lunar_comm *c, const char *op, lunar_tensor *t, lunar_comm_op rop,
                                    MPI_Request *r) {
    int64_t count = lunar_tensor_numel(t);
    LUNAR_TRY(check_count(ctx, c, op, count));
    return mpi_status(ctx, MPI_Iallreduce(MPI_IN_PLACE, lunar_tensor_data(t), (int)count, mpi_reduce_type(t->dtype),
                                          mpi_op(rop), c->mpi, r), c, op, "MPI_Iallreduce");
}

/* non-blocking uneven reduce-scatter; counts (size ints) must live until the request completes */
static lunar_status mpi_ireduce_scatter(lunar_ctx *ctx, lunar_comm *c, const char *op, lunar_tensor *out,
                                        const lunar_tensor *in, const int *counts, lunar_comm_op rop, MPI_Request *r) {
    return mpi_status(ctx, MPI_Ireduce_scatter(lunar_tensor_data(in), lunar_tensor_data(out), counts,
                                               mpi_reduce_type(in->dtype), mpi_op(rop), c->mpi, r),
                      c, op, "MPI_Ireduce_scatter");
}

static lunar_status mpi_request_test(lunar_ctx *ctx, lunar_comm *c, const char *op, MPI_Request *r, int *done) {
    return mpi_status(ctx, MPI_Test(r, done, MPI_STATUS_IGNORE), c, op, "MPI_Test");
}

static lunar_status mpi_request_wait(lunar_ctx *ctx, lunar_comm *c, const char *op, MPI_Request *r) {
    return mpi_status(ctx, MPI_Wait(r, MPI_STATUS_IGNORE), c, op, "MPI_Wait");
}

static lunar_status mpi_barrier(lunar_ctx *ctx, lunar_comm *c) {
    return mpi_status(ctx, MPI_Barrier(c->mpi), c, "barrier", "MPI_Barrier");
}

/* The world under a launcher: initialises MPI if nobody did yet and wraps a duplicate of
 * MPI_COMM_WORLD whose errors come back as codes. */
static lunar_status mpi_world(lunar_ctx *ctx, lunar_comm **out) {
    int init = 0, fin = 0, rc = MPI_SUCCESS;
    MPI_Finalized(&fin);
    if (fin) return LUNAR_FAIL(ctx, LUNAR_ERR_COMM, "lunar.dist.init: MPI was already finalised");
    MPI_Initialized(&init);
    if (!init) {
        int provided = 0;
        rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_SERIALIZED, &provided);
        if (rc != MPI_SUCCESS) return LUNAR_FAIL(ctx, LUNAR_ERR_COMM, "lunar.dist.init: MPI_Init_thread failed (%d)", rc);
    }
    int size = 1, rank = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    lunar_comm *c = comm_alloc(size, "world");
    if (!c) return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "lunar.dist.init: out of host memory");
    c->use_mpi = 1;
    c->mpi = MPI_COMM_NULL;
    c->rank = rank;
    for (int i = 0; i < size; i++) c->world_ranks[i] = i;
    /* our own duplicate, so MPI errors come back as codes without changing MPI_COMM_WORLD */
    rc = MPI_Comm_dup(MPI_COMM_WORLD, &c->mpi);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_set_errhandler(c->mpi, MPI_ERRORS_RETURN);
    if (rc == MPI_SUCCESS) {
        c->local_rank = lunar_comm_env_local_rank();
        if (c->local_rank < 0) {
            MPI_Comm node = MPI_COMM_NULL;
            rc = MPI_Comm_split_type(c->mpi, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
            if (rc == MPI_SUCCESS) rc = MPI_Comm_rank(node, &c->local_rank);
            if (node != MPI_COMM_NULL) MPI_Comm_free(&node);
        }
    }
    if (rc != MPI_SUCCESS) {
        lunar_status st = mpi_status(ctx, rc, c, "lunar.dist.init", "setting up the world communicator");
        lunar_comm_free(ctx, c);
        return st;
    }
    *out = c;
    return LUNAR_OK;
}

static lunar_status mpi_split(lunar_ctx *ctx, lunar_comm **out, lunar_comm *parent, int color, int key,
                              const char *name) {
    MPI_Comm m = MPI_COMM_NULL;
    LUNAR_TRY(mpi_status(ctx, MPI_Comm_split(parent->mpi, color, key, &m), parent, "split", "MPI_Comm_split"));
    int size = 1, rank = 0;
    MPI_Comm_size(m, &size);
    MPI_Comm_rank(m, &rank);
    lunar_comm *c = comm_alloc(size, name);
    if (!c) {
        MPI_Comm_free(&m);
        return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "split: out of host memory");
    }
    c->use_mpi = 1;
    c->mpi = m;
    c->rank = rank;
    c->local_rank = parent->local_rank;
    c->checks = parent->checks;
    int me = parent->world_ranks[parent->rank];
    int rc = MPI_Comm_set_errhandler(m, MPI_ERRORS_RETURN);
    if (rc == MPI_SUCCESS) rc = MPI_Allgather(&me, 1, MPI_INT, c->world_ranks, 1, MPI_INT, m);
    if (rc != MPI_SUCCESS) {
        lunar_status st = mpi_status(ctx, rc, c, "split", "MPI_Allgather of world ranks");
        lunar_comm_free(ctx, c);
        return st;
    }
    *out = c;
    return LUNAR_OK;
}

static void mpi_release(lunar_comm *c) {
    if (c->use_mpi && c->mpi != MPI_COMM_NULL && lunar_comm_mpi_active()) MPI_Comm_free(&c->mpi);
}

#else   /* !LUNAR_WITH_MPI: never reached (every group has one member and no MPI communicator) */

#define NO_MPI(ctx, c, op) FAILC((ctx), LUNAR_ERR_UNSUPPORTED, (c), (op), "this lunar was built without MPI")
#define mpi_max_i64(ctx, c, op, ...)        NO_MPI(ctx, c, op)
#define mpi_gather_i64(ctx, c, op, ...)     NO_MPI(ctx, c, op)
#define mpi_transpose_i64(ctx, c, op, ...)  NO_MPI(ctx, c, op)
#define mpi_bcast_bytes(ctx, c, op, ...)    NO_MPI(ctx, c, op)
#define mpi_exchange(ctx, c, op, ...)       NO_MPI(ctx, c, op)
#define mpi_all_reduce(ctx, c, op, ...)     NO_MPI(ctx, c, op)
#define mpi_all_gather(ctx, c, op, ...)     NO_MPI(ctx, c, op)
#define mpi_reduce_scatter(ctx, c, op, ...) NO_MPI(ctx, c, op)
#define mpi_broadcast(ctx, c, op, ...)      NO_MPI(ctx, c, op)
#define mpi_all_to_all(ctx, c, op, ...)     NO_MPI(ctx, c, op)
#define mpi_barrier(ctx, c)                 NO_MPI(ctx, c, "barrier")
#define mpi_iall_reduce(ctx, c, op, ...)    NO_MPI(ctx, c, op)
#define mpi_ireduce_scatter(ctx, c, op, ...) NO_MPI(ctx, c, op)
#define mpi_request_test(ctx, c, op, ...)   NO_MPI(ctx, c, op)
#define mpi_request_wait(ctx, c, op, ...)   NO_MPI(ctx, c, op)
#define divide(t, n)                        ((void)(t), (void)(n))
#define mpi_split(ctx, out, parent, ...)    NO_MPI(ctx, parent, "split")
#define mpi_release(c)                      ((void)(c))

#endif   /* LUNAR_WITH_MPI */

/* Compares this member's signature with every other member's (max of s and of -s in one
 * all-reduce). The result is the same everywhere, so on a mismatch all members gather the
 * signatures and fail with the same message. */
static lunar_status sig_check(lunar_ctx *ctx, lunar_comm *c, const char *op, const int64_t *mine) {
    if (!checked(c)) return LUNAR_OK;
    int64_t buf[2 * SIG_N];
    for (int i = 0; i < SIG_N; i++) {
        buf[i] = mine[i];
        buf[SIG_N + i] = -mine[i];
    }
    LUNAR_TRY(mpi_max_i64(ctx, c, op, "signature check (MPI_Allreduce)", buf, 2 * SIG_N));
    int same = 1;
    for (int i = 0; i < SIG_N; i++) same &= buf[i] == -buf[SIG_N + i];
    if (same) return LUNAR_OK;

    int64_t *all = malloc((size_t)c->size * SIG_N * sizeof *all);
    if (!all) return FAILC(ctx, LUNAR_ERR_OOM, c, op, "out of host memory for the signature check");
    lunar_status st = mpi_gather_i64(ctx, c, op, "signature check (MPI_Allgather)", mine, all, SIG_N);
    if (st == LUNAR_OK) {
        int bad = -1;
        for (int r = 0; r < c->size && bad < 0; r++)
            if (all[r * SIG_N + SIG_BAD_PEER] >= 0) bad = r;
        if (bad >= 0) {
            const int64_t *s = all + bad * SIG_N;
            st = FAILC(ctx, LUNAR_ERR_SHAPE, c, op, "rank %d expects %lld rows from rank %lld, which sends %lld", bad,
                       (long long)s[SIG_BAD_WANT], (long long)s[SIG_BAD_PEER], (long long)s[SIG_BAD_GOT]);
        } else {
            int r = 1;
            while (r < c->size && memcmp(all, all + r * SIG_N, SIG_N * sizeof *all) == 0) r++;
            if (r == c->size) r = 1;   /* cannot happen: the all-reduce saw a difference */
            char a[320], b[320];
            sig_format(all, 1, a, sizeof a);
            sig_format(all + r * SIG_N, 1, b, sizeof b);
            st = FAILC(ctx, LUNAR_ERR_SHAPE, c, op, "members disagree: rank 0 calls %s, rank %d calls %s", a, r, b);
        }
    }
    free(all);
    return st;
}

/* ---- groups ---------------------------------------------------------------------------------- */

lunar_status lunar_comm_init_world(lunar_ctx *ctx, lunar_comm **out) {
    *out = NULL;
    if (lunar_comm_env_launched() && lunar_comm_env_size() > 1) {
#ifdef LUNAR_WITH_MPI
        return mpi_world(ctx, out);
#else
        return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED,
                          "lunar.dist.init: started by a launcher with %d ranks, but this lunar was built without MPI "
                          "(LUNAR_WITH_MPI=OFF); rebuild it with MPI, or run one process for a single-rank world",
                          lunar_comm_env_size());
#endif
    }
#ifdef LUNAR_WITH_MPI
    if (lunar_comm_env_launched()) return mpi_world(ctx, out);
#endif
    /* alone: a single-rank world without MPI */
    lunar_comm *c = comm_alloc(1, "world");
    if (!c) return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "lunar.dist.init: out of host memory");
    c->local_rank = 0;
    *out = c;
    return LUNAR_OK;
}

lunar_status lunar_comm_split(lunar_ctx *ctx, lunar_comm **out, lunar_comm *parent, int color, int key,
                              const char *name) {
    *out = NULL;
    if (color < 0)
        return FAILC(ctx, LUNAR_ERR_ARG, parent, "split", "color %d is negative (every member joins a group)", color);
    if (via_mpi(parent)) return mpi_split(ctx, out, parent, color, key, name);
    lunar_comm *c = comm_alloc(1, name);
    if (!c) return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "split: out of host memory");
    c->world_ranks[0] = parent->world_ranks[0];
    c->local_rank = parent->local_rank;
    c->checks = parent->checks;
    *out = c;
    return LUNAR_OK;
}

void lunar_comm_free(lunar_ctx *ctx, lunar_comm *c) {
    (void)ctx;
    if (!c) return;
#ifdef LUNAR_WITH_NCCL
    if (c->nccl) lunar_nccl_free(c->nccl);
#endif
    mpi_release(c);
    free(c->world_ranks);
    free(c);
}

int lunar_comm_rank(const lunar_comm *c) { return c->rank; }
int lunar_comm_size(const lunar_comm *c) { return c->size; }
const char *lunar_comm_name(const lunar_comm *c) { return c->name; }
const int *lunar_comm_world_ranks(const lunar_comm *c) { return c->world_ranks; }
int lunar_comm_local_rank(const lunar_comm *c) { return c->local_rank < 0 ? 0 : c->local_rank; }
int lunar_comm_uses_mpi(const lunar_comm *c) { return c->use_mpi; }
int lunar_comm_uses_nccl(const lunar_comm *c) { return c->nccl != NULL; }
void lunar_comm_set_checks(lunar_comm *c, int on) { c->checks = on ? 1 : 0; }
int lunar_comm_checks(const lunar_comm *c) { return c->checks; }

/* ---- NCCL bootstrap -------------------------------------------------------------------------- */

#ifdef LUNAR_WITH_NCCL
/* The group's NCCL communicator on `device`, made now if needed: rank 0 creates the id and
 * broadcasts it over the group's MPI communicator (with a flag, so a failure there does not
 * leave the others waiting), then every member calls ncclCommInitRank. A single-rank group
 * without MPI uses its own id. Collective. */
static lunar_status nccl_ready(lunar_ctx *ctx, lunar_comm *c, int device, const char *op) {
    if (c->nccl) {
        if (lunar_nccl_device(c->nccl) != device)
            return FAILC(ctx, LUNAR_ERR_DEVICE, c, op, "the group's NCCL communicator is on cuda:%d, the tensor on cuda:%d",
                         lunar_nccl_device(c->nccl), device);
        return LUNAR_OK;
    }
    unsigned char buf[LUNAR_NCCL_ID_BYTES + 1];
    memset(buf, 0, sizeof buf);
    lunar_status st = LUNAR_OK;
    if (c->rank == 0) {
        st = lunar_nccl_unique_id(ctx, buf);
        buf[LUNAR_NCCL_ID_BYTES] = st == LUNAR_OK;
    }
    if (via_mpi(c))
        LUNAR_TRY(mpi_bcast_bytes(ctx, c, op, "MPI_Bcast of the NCCL id", buf, (int)sizeof buf, 0));
    if (st != LUNAR_OK) return st;
    if (!buf[LUNAR_NCCL_ID_BYTES]) return FAILC(ctx, LUNAR_ERR_COMM, c, op, "rank 0 could not create the NCCL id");
    st = lunar_nccl_init(ctx, &c->nccl, buf, c->size, c->rank, device);
    if (st != LUNAR_OK) lunar_ctx_prefix_error(ctx, "%s (group '%s')", op, c->name);
    return st;
}
#endif

lunar_status lunar_comm_nccl_init(lunar_ctx *ctx, lunar_comm *c, int device) {
#ifdef LUNAR_WITH_NCCL
    return nccl_ready(ctx, c, device, "nccl_init");
#else
    (void)device;
    return FAILC(ctx, LUNAR_ERR_UNSUPPORTED, c, "nccl_init", "this lunar was built without NCCL");
#endif
}

/* The NCCL communicator for tensor t (CUDA builds), or an error. */
static lunar_status nccl_for(lunar_ctx *ctx, lunar_comm *c, const lunar_tensor *t, const char *op, lunar_nccl **n) {
#ifdef LUNAR_WITH_NCCL
    LUNAR_TRY(nccl_ready(ctx, c, lunar_tensor_device(t).index, op));
    *n = c->nccl;
    return LUNAR_OK;
#else
    (void)t;
    *n = NULL;
    return FAILC(ctx, LUNAR_ERR_UNSUPPORTED, c, op, "collectives on CUDA tensors need a lunar built with NCCL");
#endif
}

#ifndef LUNAR_WITH_NCCL
/* never called: without NCCL, nccl_for fails first */
#define NO_CUDA(ctx) LUNAR_FAIL((ctx), LUNAR_ERR_UNSUPPORTED, "NCCL is not built in")
#define lunar_nccl_all_reduce(ctx, ...) NO_CUDA(ctx)
#define lunar_nccl_all_gather(ctx, ...) NO_CUDA(ctx)
#define lunar_nccl_reduce_scatter(ctx, ...) NO_CUDA(ctx)
#define lunar_nccl_reduce_scatter_v(ctx, ...) NO_CUDA(ctx)
#define lunar_nccl_broadcast(ctx, ...) NO_CUDA(ctx)
#define lunar_nccl_all_to_all(ctx, ...) NO_CUDA(ctx)
#define lunar_nccl_send_recv(ctx, ...) NO_CUDA(ctx)
#endif

/* A group of one finishes locally (a copy at most), except for CUDA tensors once the group has
 * an NCCL communicator, which only nccl_init makes for such a group: then NCCL runs the
 * collective on one rank, which is how a single GPU tests the NCCL path. */
static int local_only(const lunar_comm *c, const lunar_tensor *t) {
    return c->size == 1 && !(c->nccl && is_cuda(t));
}

/* ---- collectives ----------------------------------------------------------------------------- */

lunar_status lunar_comm_all_reduce(lunar_ctx *ctx, lunar_comm *c, lunar_tensor *t, lunar_comm_op op) {
    const char *name = "all_reduce";
    LUNAR_TRY(check_tensor(ctx, c, name, "tensor", t));
    LUNAR_TRY(check_writable(ctx, c, name, "tensor", t));
    LUNAR_TRY(check_reduce(ctx, c, name, t, op));
    int64_t sig[SIG_N];
    sig_make(sig, K_ALL_REDUCE, t, 0, op);
    LUNAR_TRY(sig_check(ctx, c, name, sig));
    if (local_only(c, t)) return LUNAR_OK;

    stage s;
    lunar_status st = stage_make(ctx, &s, t, reduce_dtype(t), 1, 0);
    if (st == LUNAR_OK && is_cuda(t)) {
        lunar_nccl *n;
        st = nccl_for(ctx, c, t, name, &n);
        if (st == LUNAR_OK) st = lunar_nccl_all_reduce(ctx, n, &s.t, op);
    } else if (st == LUNAR_OK) {
        st = mpi_all_reduce(ctx, c, name, &s.t, op);
    }
    if (st == LUNAR_OK) st = stage_back(ctx, t, &s);
    stage_release(ctx, &s);
    return st;
}

lunar_status lunar_comm_all_gather(lunar_ctx *ctx, lunar_comm *c, lunar_tensor *out, const lunar_tensor *in) {
    const char *name = "all_gather";
    LUNAR_TRY(check_pair(ctx, c, name, out, in));
    if (out->shape[0] != (int64_t)c->size * in->shape[0]) {
        char a[256], b[256];
        describe(out, a, sizeof a);
        describe(in, b, sizeof b);
        return FAILC(ctx, LUNAR_ERR_SHAPE, c, name, "out %s needs %lld rows (%d ranks x %lld rows of in %s)", a,
                     (long long)c->size * in->shape[0], c->size, (long long)in->shape[0], b);
    }
    int64_t sig[SIG_N];
    sig_make(sig, K_ALL_GATHER, in, 0, -1);
    LUNAR_TRY(sig_check(ctx, c, name, sig));
    if (local_only(c, in)) return lunar_copy(ctx, out, in);

    stage si, so;
    memset(&so, 0, sizeof so);
    lunar_status st = stage_make(ctx, &si, in, in->dtype, 1, in->storage == out->storage);
    if (st == LUNAR_OK) st = stage_make(ctx, &so, out, out->dtype, 0, 0);
    if (st == LUNAR_OK && is_cuda(in)) {
        lunar_nccl *n;
        st = nccl_for(ctx, c, in, name, &n);
        if (st == LUNAR_OK) st = lunar_nccl_all_gather(ctx, n, &so.t, &si.t);
    } else if (st == LUNAR_OK) {
        st = mpi_all_gather(ctx, c, name, &so.t, &si.t);
    }
    if (st == LUNAR_OK) st = stage_back(ctx, out, &so);
    stage_release(ctx, &si);
    stage_release(ctx, &so);
    return st;
}

lunar_status lunar_comm_reduce_scatter(lunar_ctx *ctx, lunar_comm *c, lunar_tensor *out, const lunar_tensor *in,
                                       lunar_comm_op op) {
    const char *name = "reduce_scatter";
    LUNAR_TRY(check_pair(ctx, c, name, out, in));
    LUNAR_TRY(check_reduce(ctx, c, name, in, op));
    if (in->shape[0] % c->size != 0 || out->shape[0] != in->shape[0] / c->size) {
        char a[256], b[256];
        describe(out, a, sizeof a);
        describe(in, b, sizeof b);
        if (in->shape[0] % c->size != 0)
            return FAILC(ctx, LUNAR_ERR_SHAPE, c, name, "in %s: %lld rows do not split evenly over %d ranks", b,
                         (long long)in->shape[0], c->size);
        return FAILC(ctx, LUNAR_ERR_SHAPE, c, name, "out %s needs %lld rows (in %s has %lld rows over %d ranks)", a,
                     (long long)(in->shape[0] / c->size), b, (long long)in->shape[0], c->size);
    }
    int64_t sig[SIG_N];
    sig_make(sig, K_REDUCE_SCATTER, in, 0, op);
    LUNAR_TRY(sig_check(ctx, c, name, sig));
    if (local_only(c, in)) return lunar_copy(ctx, out, in);

    lunar_dtype rdt = reduce_dtype(in);
    stage si, so;
    memset(&so, 0, sizeof so);
    lunar_status st = stage_make(ctx, &si, in, rdt, 1, in->storage == out->storage);
    if (st == LUNAR_OK) st = stage_make(ctx, &so, out, rdt, 0, 0);
    if (st == LUNAR_OK && is_cuda(in)) {
        lunar_nccl *n;
        st = nccl_for(ctx, c, in, name, &n);
        if (st == LUNAR_OK) st = lunar_nccl_reduce_scatter(ctx, n, &so.t, &si.t, op);
    } else if (st == LUNAR_OK) {
        st = mpi_reduce_scatter(ctx, c, name, &so.t, &si.t, op);
    }
    if (st == LUNAR_OK) st = stage_back(ctx, out, &so);
    stage_release(ctx, &si);
    stage_release(ctx, &so);
    return st;
}

lunar_status lunar_comm_broadcast(lunar_ctx *ctx, lunar_comm *c, lunar_tensor *t, int root) {
    const char *name = "broadcast";
    LUNAR_TRY(check_tensor(ctx, c, name, "tensor", t));
    LUNAR_TRY(check_writable(ctx, c, name, "tensor", t));
    if (root < 0 || root >= c->size)
        return FAILC(ctx, LUNAR_ERR_ARG, c, name, "root %d is not a rank of the group (0..%d)", root, c->size - 1);
    int64_t sig[SIG_N];
    sig_make(sig, K_BROADCAST, t, 0, root);
    LUNAR_TRY(sig_check(ctx, c, name, sig));
    if (local_only(c, t)) return LUNAR_OK;

    stage s;
    lunar_status st = stage_make(ctx, &s, t, t->dtype, c->rank == root, 0);
    if (st == LUNAR_OK && is_cuda(t)) {
        lunar_nccl *n;
        st = nccl_for(ctx, c, t, name, &n);
        if (st == LUNAR_OK) st = lunar_nccl_broadcast(ctx, n, &s.t, root);
    } else if (st == LUNAR_OK) {
        st = mpi_broadcast(ctx, c, name, &s.t, root);
    }
    if (st == LUNAR_OK && c->rank != root) st = stage_back(ctx, t, &s);
    stage_release(ctx, &s);
    return st;
}

lunar_status lunar_comm_all_to_all(lunar_ctx *ctx, lunar_comm *c, lunar_tensor *out, const lunar_tensor *in,
                                   const int64_t *send_rows, const int64_t *recv_rows) {
    const char *name = "all_to_all";
    LUNAR_TRY(check_pair(ctx, c, name, out, in));
    int64_t send_total = 0, recv_total = 0;
    for (int j = 0; j < c->size; j++) {
        if (send_rows[j] < 0 || recv_rows[j] < 0)
            return FAILC(ctx, LUNAR_ERR_ARG, c, name, "negative row count for rank %d (send %lld, recv %lld)", j,
                         (long long)send_rows[j], (long long)recv_rows[j]);
        send_total += send_rows[j];
        recv_total += recv_rows[j];
    }
    if (send_total != in->shape[0] || recv_total != out->shape[0]) {
        char a[256], b[256];
        describe(out, a, sizeof a);
        describe(in, b, sizeof b);
        if (send_total != in->shape[0])
            return FAILC(ctx, LUNAR_ERR_SHAPE, c, name, "send counts add up to %lld rows but in %s has %lld",
                         (long long)send_total, b, (long long)in->shape[0]);
        return FAILC(ctx, LUNAR_ERR_SHAPE, c, name, "recv counts add up to %lld rows but out %s has %lld",
                     (long long)recv_total, a, (long long)out->shape[0]);
    }
    if (send_rows[c->rank] != recv_rows[c->rank])
        return FAILC(ctx, LUNAR_ERR_SHAPE, c, name, "rank %d sends %lld rows to itself but expects %lld", c->rank,
                     (long long)send_rows[c->rank], (long long)recv_rows[c->rank]);
    int64_t sig[SIG_N];
    sig_make(sig, K_ALL_TO_ALL, in, 1, -1);
    LUNAR_TRY(sig_check(ctx, c, name, sig));
    if (checked(c)) {
        /* what each member sends me must be what I expect from it */
        int64_t *theirs = malloc((size_t)c->size * sizeof *theirs);
        if (!theirs) return FAILC(ctx, LUNAR_ERR_OOM, c, name, "out of host memory");
        lunar_status st = mpi_transpose_i64(ctx, c, name, "count check (MPI_Alltoall)", send_rows, theirs);
        for (int j = 0; st == LUNAR_OK && j < c->size; j++)
            if (theirs[j] != recv_rows[j]) {
                sig[SIG_BAD_PEER] = j;
                sig[SIG_BAD_WANT] = recv_rows[j];
                sig[SIG_BAD_GOT] = theirs[j];
                break;
            }
        free(theirs);
        LUNAR_TRY(st);
        LUNAR_TRY(sig_check(ctx, c, name, sig));
    }
    if (local_only(c, in)) return lunar_copy(ctx, out, in);

    int64_t row_elems = 1;
    for (int i = 1; i < in->ndim; i++) row_elems *= in->shape[i];
    stage si, so;
    memset(&so, 0, sizeof so);
    lunar_status st = stage_make(ctx, &si, in, in->dtype, 1, in->storage == out->storage);
    if (st == LUNAR_OK) st = stage_make(ctx, &so, out, out->dtype, 0, 0);
    if (st == LUNAR_OK && is_cuda(in)) {
        lunar_nccl *n;
        st = nccl_for(ctx, c, in, name, &n);
        if (st == LUNAR_OK)
            st = lunar_nccl_all_to_all(ctx, n, &so.t, &si.t, send_rows, recv_rows,
                                       row_elems * (int64_t)lunar_dtype_size(in->dtype), c->size, c->rank);
    } else if (st == LUNAR_OK && row_elems > 0) {
        st = mpi_all_to_all(ctx, c, name, &so.t, &si.t, send_rows, recv_rows, row_elems);
    }
    if (st == LUNAR_OK) st = stage_back(ctx, out, &so);
    stage_release(ctx, &si);
    stage_release(ctx, &so);
    return st;
}

/* ---- point to point -------------------------------------------------------------------------- */

static lunar_status check_peer(lunar_ctx *ctx, const lunar_comm *c, const char *op, const char *role, int peer) {
    if (peer < 0 || peer >= c->size)
        return FAILC(ctx, LUNAR_ERR_ARG, c, op, "%s %d is not a rank of the group (0..%d)", role, peer, c->size - 1);
    if (peer == c->rank)
        return FAILC(ctx, LUNAR_ERR_ARG, c, op, "%s %d is this rank; send and recv need another member", role, peer);
    return LUNAR_OK;
}

/* The receiver's view of a header: the sender's tensor must match t. */
static lunar_status header_match(lunar_ctx *ctx, const lunar_comm *c, const char *op, const lunar_tensor *t, int src,
                                 const int64_t *theirs) {
    int64_t mine[SIG_N];
    sig_make(mine, K_SEND, t, 0, -1);
    if (memcmp(mine, theirs, sizeof mine) == 0) return LUNAR_OK;
    char a[320], b[320];
    sig_format(mine, 0, a, sizeof a);
    sig_format(theirs, 0, b, sizeof b);
    return FAILC(ctx, LUNAR_ERR_SHAPE, c, op, "rank %d expects %s from rank %d, which sends %s", c->rank, a, src, b);
}

/* Point-to-point core: send (to dst) and/or recv (from src); either tensor may be NULL. A group
 * of one has no peer, so past check_peer the group has several members and uses MPI. */
static lunar_status p2p(lunar_ctx *ctx, lunar_comm *c, const char *name, lunar_tensor *recv, int src,
                        const lunar_tensor *send, int dst) {
    if (send) LUNAR_TRY(check_tensor(ctx, c, name, "send tensor", send));
    if (recv) LUNAR_TRY(check_tensor(ctx, c, name, "recv tensor", recv));
    if (recv) LUNAR_TRY(check_writable(ctx, c, name, "recv tensor", recv));
    if (send) LUNAR_TRY(check_peer(ctx, c, name, "destination", dst));
    if (recv) LUNAR_TRY(check_peer(ctx, c, name, "source", src));
    if (send && recv && !lunar_device_equal(lunar_tensor_device(send), lunar_tensor_device(recv))) {
        char a[256], b[256];
        describe(send, a, sizeof a);
        describe(recv, b, sizeof b);
        return FAILC(ctx, LUNAR_ERR_DEVICE, c, name, "send tensor %s and recv tensor %s are on different devices", a, b);
    }
    if (!via_mpi(c)) return FAILC(ctx, LUNAR_ERR_COMM, c, name, "no MPI");   /* unreachable: size 1 */

    if (c->checks) {
        int64_t hs[SIG_N], hr[SIG_N];
        if (send) sig_make(hs, K_SEND, send, 0, -1);
        LUNAR_TRY(mpi_exchange(ctx, c, name, TAG_HEADER, recv ? hr : NULL, SIG_N, sizeof hr[0], src,
                               send ? hs : NULL, SIG_N, sizeof hs[0], dst));
        if (recv) LUNAR_TRY(header_match(ctx, c, name, recv, src, hr));
    }

    stage ss, sr;
    memset(&ss, 0, sizeof ss);
    memset(&sr, 0, sizeof sr);
    lunar_status st = LUNAR_OK;
    if (send) st = stage_make(ctx, &ss, send, send->dtype, 1, recv && recv->storage == send->storage);
    if (st == LUNAR_OK && recv) st = stage_make(ctx, &sr, recv, recv->dtype, 0, 0);
    const lunar_tensor *any = send ? send : recv;
    if (st == LUNAR_OK && is_cuda(any)) {
        lunar_nccl *n;
        st = nccl_for(ctx, c, any, name, &n);
        if (st == LUNAR_OK) st = lunar_nccl_send_recv(ctx, n, recv ? &sr.t : NULL, src, send ? &ss.t : NULL, dst);
    } else if (st == LUNAR_OK) {
        st = mpi_exchange(ctx, c, name, TAG_DATA, recv ? lunar_tensor_data(&sr.t) : NULL,
                          recv ? lunar_tensor_numel(recv) : 0, recv ? lunar_dtype_size(recv->dtype) : 1, src,
                          send ? lunar_tensor_data(&ss.t) : NULL, send ? lunar_tensor_numel(send) : 0,
                          send ? lunar_dtype_size(send->dtype) : 1, dst);
    }
    if (st == LUNAR_OK && recv) st = stage_back(ctx, recv, &sr);
    stage_release(ctx, &ss);
    stage_release(ctx, &sr);
    return st;
}

lunar_status lunar_comm_send(lunar_ctx *ctx, lunar_comm *c, const lunar_tensor *t, int dst) {
    return p2p(ctx, c, "send", NULL, -1, t, dst);
}

lunar_status lunar_comm_recv(lunar_ctx *ctx, lunar_comm *c, lunar_tensor *t, int src) {
    return p2p(ctx, c, "recv", t, src, NULL, -1);
}

lunar_status lunar_comm_send_recv(lunar_ctx *ctx, lunar_comm *c, lunar_tensor *recv, int src,
                                  const lunar_tensor *send, int dst) {
    return p2p(ctx, c, "send_recv", recv, src, send, dst);
}

lunar_status lunar_comm_barrier(lunar_ctx *ctx, lunar_comm *c) {
    int64_t sig[SIG_N];
    sig_make(sig, K_BARRIER, NULL, 0, -1);
    LUNAR_TRY(sig_check(ctx, c, "barrier", sig));
    if (c->size == 1 || !via_mpi(c)) return LUNAR_OK;
    return mpi_barrier(ctx, c);
}

/* ---- non-blocking collectives ---------------------------------------------------------------- */

struct lunar_comm_request {
    lunar_comm  *c;
    const char  *op;           /* "all_reduce_start", "reduce_scatter_start" */
    int          pending;      /* an MPI request is outstanding */
#ifdef LUNAR_WITH_MPI
    MPI_Request  mpi;
#endif
    int         *counts;       /* reduce_scatter: MPI's receive counts, alive until completion */
    lunar_tensor keep_in, keep_out;   /* references that keep the buffers alive until the wait */
    int          divide;       /* avg over MPI: divide keep_out by the group size at the end */
};

/* no staging for a request: the buffer is the caller's, so it must be contiguous and of a dtype
 * MPI reduces directly (on CUDA, NCCL's dtypes) */
static lunar_status check_async(lunar_ctx *ctx, const lunar_comm *c, const char *op, const char *role,
                                const lunar_tensor *t) {
    char a[256];
    describe(t, a, sizeof a);
    if (!lunar_tensor_is_contiguous(t))
        return FAILC(ctx, LUNAR_ERR_ARG, c, op, "%s %s must be contiguous (a non-blocking collective works in place)",
                     role, a);
    if (!is_cuda(t) && reduce_dtype(t) != t->dtype)
        return FAILC(ctx, LUNAR_ERR_DTYPE, c, op, "%s %s: MPI cannot reduce %s in place (use f32)", role, a,
                     lunar_dtype_name(t->dtype));
    return LUNAR_OK;
}

static lunar_status request_new(lunar_ctx *ctx, lunar_comm *c, const char *op, lunar_comm_request **out) {
    lunar_comm_request *r = calloc(1, sizeof *r);
    if (!r) return FAILC(ctx, LUNAR_ERR_OOM, c, op, "out of host memory");
    r->c = c;
    r->op = op;
    *out = r;
    return LUNAR_OK;
}

static void request_free(lunar_ctx *ctx, lunar_comm_request *r) {
    lunar_tensor_release(ctx, &r->keep_in);
    lunar_tensor_release(ctx, &r->keep_out);
    free(r->counts);
    free(r);
}

lunar_status lunar_comm_all_reduce_start(lunar_ctx *ctx, lunar_comm *c, lunar_tensor *t, lunar_comm_op op,
                                         lunar_comm_request **req) {
    const char *name = "all_reduce_start";
    *req = NULL;
    LUNAR_TRY(check_tensor(ctx, c, name, "tensor", t));
    LUNAR_TRY(check_writable(ctx, c, name, "tensor", t));
    LUNAR_TRY(check_reduce(ctx, c, name, t, op));
    LUNAR_TRY(check_async(ctx, c, name, "tensor", t));
    int64_t sig[SIG_N];
    sig_make(sig, K_ALL_REDUCE_START, t, 0, op);
    LUNAR_TRY(sig_check(ctx, c, name, sig));
    lunar_comm_request *r = NULL;
    LUNAR_TRY(request_new(ctx, c, name, &r));
    lunar_tensor_share(&r->keep_out, t);
    lunar_status st = LUNAR_OK;
    if (local_only(c, t)) {
        /* nothing to do: the group's reduction of one tensor is the tensor */
    } else if (is_cuda(t)) {
        lunar_nccl *n;
        st = nccl_for(ctx, c, t, name, &n);
        if (st == LUNAR_OK) st = lunar_nccl_all_reduce(ctx, n, t, op);
    } else {
#ifdef LUNAR_WITH_MPI
        st = mpi_iall_reduce(ctx, c, name, t, op, &r->mpi);
        r->pending = st == LUNAR_OK;
        r->divide = op == LUNAR_COMM_AVG;
#else
        st = mpi_iall_reduce(ctx, c, name, t, op, NULL);
#endif
    }
    if (st != LUNAR_OK) {
        request_free(ctx, r);
        return st;
    }
    *req = r;
    return LUNAR_OK;
}

lunar_status lunar_comm_reduce_scatter_start(lunar_ctx *ctx, lunar_comm *c, lunar_tensor *out, const lunar_tensor *in,
                                             const int64_t *counts, lunar_comm_op op, lunar_comm_request **req) {
    const char *name = "reduce_scatter_start";
    *req = NULL;
    LUNAR_TRY(check_pair(ctx, c, name, out, in));
    LUNAR_TRY(check_reduce(ctx, c, name, in, op));
    LUNAR_TRY(check_async(ctx, c, name, "in", in));
    LUNAR_TRY(check_async(ctx, c, name, "out", out));
    char a[256], b[256];
    describe(out, a, sizeof a);
    describe(in, b, sizeof b);
    if (in->ndim != 1) return FAILC(ctx, LUNAR_ERR_SHAPE, c, name, "in %s must be 1-D", b);
    int64_t total = 0;
    for (int j = 0; j < c->size; j++) {
        if (counts[j] < 0)
            return FAILC(ctx, LUNAR_ERR_ARG, c, name, "count %lld for rank %d is negative", (long long)counts[j], j);
        total += counts[j];
    }
    if (total != in->shape[0])
        return FAILC(ctx, LUNAR_ERR_SHAPE, c, name, "the counts add up to %lld elements but in %s has %lld",
                     (long long)total, b, (long long)in->shape[0]);
    if (out->shape[0] != counts[c->rank])
        return FAILC(ctx, LUNAR_ERR_SHAPE, c, name, "out %s needs %lld elements (the count of rank %d)", a,
                     (long long)counts[c->rank], c->rank);
    if (in->storage == out->storage && lunar_tensor_numel(out) > 0) {
        const char *pi = lunar_tensor_data(in), *po = lunar_tensor_data(out);
        size_t el = lunar_dtype_size(in->dtype);
        if (po < pi + (size_t)in->shape[0] * el && pi < po + (size_t)out->shape[0] * el)
            return FAILC(ctx, LUNAR_ERR_ARG, c, name, "out %s overlaps in %s", a, b);
    }
    int64_t sig[SIG_N];
    sig_make(sig, K_REDUCE_SCATTER_START, in, 0, op);
    LUNAR_TRY(sig_check(ctx, c, name, sig));
    lunar_comm_request *r = NULL;
    LUNAR_TRY(request_new(ctx, c, name, &r));
    lunar_tensor_share(&r->keep_in, in);
    lunar_tensor_share(&r->keep_out, out);
    lunar_status st = LUNAR_OK;
    if (local_only(c, in)) {
        st = lunar_copy(ctx, out, in);
    } else if (is_cuda(in)) {
        lunar_nccl *n;
        st = nccl_for(ctx, c, in, name, &n);
        if (st == LUNAR_OK) st = lunar_nccl_reduce_scatter_v(ctx, n, out, in, counts, c->size, c->rank, op);
    } else {
        r->counts = malloc((size_t)c->size * sizeof *r->counts);
        if (!r->counts) st = FAILC(ctx, LUNAR_ERR_OOM, c, name, "out of host memory");
        for (int j = 0; st == LUNAR_OK && j < c->size; j++) {
            if (counts[j] > INT_MAX)
                st = FAILC(ctx, LUNAR_ERR_UNSUPPORTED, c, name, "%lld elements for rank %d exceed MPI's int count",
                           (long long)counts[j], j);
            else
                r->counts[j] = (int)counts[j];
        }
#ifdef LUNAR_WITH_MPI
        if (st == LUNAR_OK) st = mpi_ireduce_scatter(ctx, c, name, out, in, r->counts, op, &r->mpi);
        r->pending = st == LUNAR_OK;
        r->divide = op == LUNAR_COMM_AVG;
#else
        if (st == LUNAR_OK) st = mpi_ireduce_scatter(ctx, c, name, out, in, r->counts, op, NULL);
#endif
    }
    if (st != LUNAR_OK) {
        request_free(ctx, r);
        return st;
    }
    *req = r;
    return LUNAR_OK;
}

lunar_status lunar_comm_test(lunar_ctx *ctx, lunar_comm_request *r, int *done) {
    *done = 1;
    if (!r || !r->pending) return LUNAR_OK;
#ifdef LUNAR_WITH_MPI
    LUNAR_TRY(mpi_request_test(ctx, r->c, r->op, &r->mpi, done));
    if (*done) {
        r->pending = 0;
        if (r->divide) divide(&r->keep_out, r->c->size);
        r->divide = 0;
    }
    return LUNAR_OK;
#else
    return mpi_request_test(ctx, r->c, r->op, NULL, done);
#endif
}

lunar_status lunar_comm_wait(lunar_ctx *ctx, lunar_comm_request *r) {
    if (!r) return LUNAR_OK;
    lunar_status st = LUNAR_OK;
#ifdef LUNAR_WITH_MPI
    if (r->pending) st = mpi_request_wait(ctx, r->c, r->op, &r->mpi);
#endif
    if (st == LUNAR_OK && r->divide) divide(&r->keep_out, r->c->size);
    request_free(ctx, r);
    return st;
}
