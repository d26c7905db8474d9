-- lunar.ops.attention: fused attention over per-query key sets and the DSA index score
-- (contracts in host/include/lunar/ops.h). Token-major layouts, no (T, T) matrix in memory.
--   attention(q, k, v, {keys=, mask=, scale=, out=, lse=})              -> o, lse
--       q (B, S, NH, Dq), k (B, T, Hk, Dq), v (B, T, Hk, Dv) (Hk divides NH); keys (B, S, K)
--       0-based key ids per query (DSA top-k; < 0 = none) or nil = all T keys; mask (B, S, T)
--       additive f32 (lunar.nn.masks) or nil; scale default Dq^-0.5. o (B, S, NH, Dv) in q's
--       dtype, lse (B, NH, S) f32. Keys masked with finfo.min cost nothing; a query with no
--       attendable key is uniform over all T keys (HF eager).
--   attention_backward(dout, o, lse, q, k, v, {keys=, mask=, scale=, dq=, dk=, dv=}) -> dq, dk, dv
--       the same keys, mask and scale as the forward; dk, dv summed over the sharing heads.
--   index_scores(qi, ki, w, {mask=, scale=, topk=, scores=true, out=})   -> scores, topk
--       qi (B, S, Hi, Di), ki (B, T, Di), w (B, S, Hi) f32: scores (B, S, T) f32 =
--       sum_h w * relu(scale * qi.ki) + mask (masked keys keep the mask value, uncomputed);
--       scale default Di^-0.5; topk = k also returns the (B, S, k) i64 ids of the k largest
--       scores per row (the set ops.topk selects, ties to the lower id) in increasing id order;
--       scores = false skips the scores.
--   attention_paged(q, k, v, table, lengths, {block_size=, keys=, scale=, out=})   -> o
--       decode attention over a paged KV cache, read in place: q (B, NH, Dq), one query per
--       sequence; k (R, Hk * Dq), v (R, Hk * Dv) the cache's rows (R = blocks * block_size; v
--       may be a narrowed view of k); table (B, NB) i64 each sequence's blocks, lengths (B) i64
--       its tokens; keys (B, K) i64 the positions to attend (increasing; nil = all below the
--       length); scale default Dq^-0.5. o (B, NH, Dv). Each sequence is computed on its own in a
--       fixed order (the same bits in any batch); the cache keeps its dtype (never copied).
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local C = core.ops
local check = tensor.check

local M = {}

local function dims4(t, role, op)
    check(t, role, op)
    if t:dim() ~= 4 then
        tensor.fail(('%s: %s must be 4-dim, got (%s)'):format(op, role, table.concat(t:size(), ', ')))
    end
    return t:size()
end

function M.attention(q, k, v, opts)
    opts = opts or {}
    local qs = dims4(q, 'q', 'attention')
    local vs = dims4(v, 'v', 'attention')
    local B, S, NH, Dq = qs[1], qs[2], qs[3], qs[4]
    local o = opts.out or core.empty({B, S, NH, vs[4]}, q:dtype(), q:device())
    local lse = opts.lse or core.empty({B, NH, S}, 'f32', q:device())
    C.attention_forward(o, lse, q, k, v, opts.keys, opts.mask, opts.scale or Dq ^ -0.5)
    return o, lse
end

function M.attention_backward(dout, o, lse, q, k, v, opts)
    opts = opts or {}
    dims4(q, 'q', 'attention_backward')
    dims4(k, 'k', 'attention_backward')
    dims4(v, 'v', 'attention_backward')
    local dq = opts.dq or core.empty(q:size(), q:dtype(), q:device())
    local dk = opts.dk or core.empty(k:size(), k:dtype(), k:device())
    local dv = opts.dv or core.empty(v:size(), v:dtype(), v:device())
    C.attention_backward(dq, dk, dv, dout, o, lse, q, k, v, opts.keys, opts.mask, opts.scale or q:size(4) ^ -0.5)
    return dq, dk, dv
end

function M.attention_paged(q, k, v, tbl, lengths, opts)
    opts = opts or {}
    check(q, 'q', 'attention_paged')
    check(v, 'v', 'attention_paged')
    if q:dim() ~= 3 or v:dim() ~= 2 then
        tensor.fail(('attention_paged: q must be 3-dim (B, NH, Dq) and v 2-dim (rows, Hk * Dv), got q (%s) and v (%s)'):format(
            table.concat(q:size(), ', '), table.concat(v:size(), ', ')))
    end
    local bs = opts.block_size
    if type(bs) ~= 'number' or bs < 1 or bs ~= math.floor(bs) then
        tensor.fail(('attention_paged: block_size must be a positive integer, got %s'):format(tostring(bs)))
    end
    local NH, Dq = q:size(2), q:size(3)
    check(k, 'k', 'attention_paged')
    local Hk = k:dim() == 2 and math.max(1, math.floor(k:size(2) / Dq)) or 1
    local o = opts.out or core.empty({q:size(1), NH, math.floor(v:size(2) / Hk)}, q:dtype(), q:device())
    return C.attention_paged(o, q, k, v, tbl, lengths, opts.keys, bs, opts.scale or Dq ^ -0.5)
end

function M.index_scores(qi, ki, w, opts)
    opts = opts or {}
    local qs = dims4(qi, 'qi', 'index_scores')
    check(ki, 'ki', 'index_scores')
    local B, S, T = qs[1], qs[2], ki:size(2)
    local scores
    if opts.scores ~= false then scores = opts.out or core.empty({B, S, T}, 'f32', qi:device()) end
    local topk
    if opts.topk then
        if type(opts.topk) == 'number' then topk = core.empty({B, S, opts.topk}, 'i64', qi:device())
        else topk = opts.topk end
    end
    C.index_scores(scores, topk, qi, ki, w, opts.mask, opts.scale or qs[4] ^ -0.5)
    return scores, topk
end

return M
