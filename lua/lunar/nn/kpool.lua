-- lunar.nn.KPool: the k-pool DSA indexer of a GLM-5.3-Flash "full" DSA layer (HF's
-- Glm5NextTextIndexer), forward only: transformers computes it under no_grad, so it trains
-- nothing and passes no gradient to x or q_resid.
--
-- Weights under `name` (".../self_attn.indexer"): wq_b (Hi*Di, Rq), wk (Di, H), k_norm.{weight,
-- bias} (Di; LayerNorm eps 1e-6), weights_proj (Hi, H), index_kpool_compress_ape (kp, Di),
-- index_kpool_compress_gate (Di, H).
--
--   keys = idx:select(x, q_resid, b)    x (N, H) the layer's normed input, q_resid (N, Rq);
--       b.B, b.T and b.docs: per batch row the list of its documents {first, stop} (0-based,
--       [first, stop); an unpacked row is one document [0, T)), b.valid_host the 0/1 of every
--       token (the attention mask). -> keys (B, T, W) i64, the raw keys each query attends (-1 =
--       none), W = index_topk + kp - 1 with the tail (kp > 1), else index_topk.
--
--   ki, gi = idx:token_keys(x[, lopts])   the raw key LayerNorm(wk x) and gate x (N, Di) f32 of
--       every token (lopts: the Linears' options; a decode step asks for row-invariant products)
--   pooled = idx:pool_keys(ki, gi)          ki, gi (M, kp, Di): each pool's tokens -> (M, Di) f32
-- With b.for_cache (generation's prefill), select also returns {ki =, gi =, pooled = (B, P, Di)
-- or nil, rows = the pools of each row, as pools_of lists them}: what the cache keeps.
--
-- Within a document, pools of kp tokens start at its first valid token; a pool is valid when
-- its kp tokens are all in the document and valid, and its pooled key is, per channel d,
-- sum_j softmax_j(gi[j, d] + ape[j, d]) ki[j, d] with ki = LayerNorm(wk x), gi = gate x. A pool is
-- a candidate for query s when it is valid and its last token is visible (<= s, valid); its
-- score is sum_h (weights_proj x_s)_h Hi^-0.5 relu(Di^-0.5 qi_h . pooled). The query takes the
-- min(index_topk / kp, pools) best pools (the non-candidates among them give no key), expanded
-- to their kp tokens, and the tail: with n visible tokens and r = n mod kp, the r newest
-- (first + n - r .. first + n - 1), those not yet in a complete pool. Pad queries attend nothing.
-- Transformers anchors the pools at the row's first valid token; lunar does the same per
-- document of a packed row (transformers cannot pack: each document then equals itself alone).
local core = require 'lunar.core'
local ops = require 'lunar.ops'
local Linear = require 'lunar.nn.linear'

local KPool = {}
KPool.__index = KPool

local MASKED = -3.4028234663852886e38   -- finfo(f32).min: a non-candidate pool

function KPool.new(store, name, cfg)
    return setmetatable({
        store = store, name = name,
        Hi = cfg.index_n_heads, Di = cfg.index_head_dim, kp = cfg.index_kpool, topk = cfg.index_topk,
        tail = cfg.index_kpool_always_select_tail ~= false and cfg.index_kpool > 1,
        wq_b = Linear.new(store, name .. '.wq_b'),
        wk = Linear.new(store, name .. '.wk'),
        weights_proj = Linear.new(store, name .. '.weights_proj'),
        gate = name .. '.index_kpool_compress_gate',
        ape = name .. '.index_kpool_compress_ape',
        knw = name .. '.k_norm.weight', knb = name .. '.k_norm.bias',
    }, KPool)
end

-- the width of the key lists select returns
function KPool:width() return self.topk + (self.tail and self.kp - 1 or 0) end

-- the pools of each row: rows[b] = {{start =, doc =}, ...} (valid pools only; start 0-based)
local function pools_of(self, b)
    local kp, T = self.kp, b.T
    local rows, P = {}, 0
    for r = 1, b.B do
        local list = {}
        for di, d in ipairs(b.docs[r]) do
            local first = d[1]
            while first < d[2] and b.valid_host[(r - 1) * T + first + 1] == 0 do first = first + 1 end
            d.anchor = first
            local p = first
            while p + kp <= d[2] do
                local ok = true
                for j = 0, kp - 1 do
                    if b.valid_host[(r - 1) * T + p + j + 1] == 0 then ok = false break end
                end
                if ok then list[#list + 1] = {start = p, doc = di} end
                p = p + kp
            end
        end
        rows[r] = list
        if #list > P then P = #list end
    end
    return rows, P
end

function KPool:token_keys(x, lopts)
    local ki = ops.layernorm(self.wk:forward(x, lopts), self.store:get(self.knw), self.store:get(self.knb), 1e-6)
    local gi = ops.gemm(x, self.store:get(self.gate), {trans_b = true, row_invariant = lopts and lopts.row_invariant})
    return ki:float(), gi:float()
end

-- per channel d: sum_j softmax_j(gi[j, d] + ape[j, d]) ki[j, d], over each pool's kp tokens
function KPool:pool_keys(ki, gi)
    local M, kp, Di = ki:size(1), self.kp, self.Di
    local gg = ops.add(gi, self.store:get(self.ape):float():view(1, kp, Di))
    local prob = ops.softmax(gg:transpose(2, 3):contiguous()):transpose(2, 3)
    return ops.sum(ops.mul(prob, ki), 2):view(M, Di)
end

function KPool:select(x, q_resid, b)
    local B, T, Hi, Di, kp = b.B, b.T, self.Hi, self.Di, self.kp
    local N = B * T
    local W = self:width()
    local rows, P = pools_of(self, b)
    local K = math.min(math.floor(self.topk / kp), P)
    local picked, cached
    local ki, gi
    if K > 0 or b.for_cache then ki, gi = self:token_keys(x) end
    if b.for_cache then cached = {ki = ki, gi = gi, rows = rows} end
    if K > 0 then
        -- pooled keys (B, P, Di): the kp tokens of each pool gathered (a row's missing pools read
        -- token 0 of the row; they are never candidates)
        local idx = {}
        for r = 1, B do
            for p = 1, P do
                local pool = rows[r][p]
                for j = 0, kp - 1 do
                    idx[#idx + 1] = (r - 1) * T + (pool and pool.start + j or 0)
                end
            end
        end
        local at = core.from_flat(idx, {#idx}, 'i64', x:device())
        local pooled = self:pool_keys(ops.index_select(ki, 1, at):view(B * P, kp, Di),
                                      ops.index_select(gi, 1, at):view(B * P, kp, Di)):view(B, P, Di)
        if cached then cached.pooled = pooled end
        -- candidates: valid pools whose last token the query sees
        local mask = {}
        for r = 1, B do
            local docs = b.docs[r]
            for s = 0, T - 1 do
                local doc = nil
                for di, d in ipairs(docs) do if s >= d[1] and s < d[2] then doc = di break end end
                local vs = b.valid_host[(r - 1) * T + s + 1] ~= 0
                for p = 1, P do
                    local pool = rows[r][p]
                    local ok = vs and pool ~= nil and pool.doc == doc and pool.start + kp - 1 <= s
                    mask[#mask + 1] = ok and 0 or MASKED
                end
            end
        end
        local m = core.from_flat(mask, {B, T, P}, 'f32', x:device())
        local qi = self.wq_b:forward(q_resid):view(B, T, Hi, Di)
        local w = ops.mul(self.weights_proj:forward(x):float(), Hi ^ -0.5):view(B, T, Hi)
        local _, topk = ops.index_scores(qi, pooled, w, {mask = m, scale = Di ^ -0.5, topk = K, scores = false})
        picked = {topk = topk:to('cpu'):tolist_flat(), mask = mask}
    end
    -- expand the pools, append the tails (host: the lists are the selection's structure)
    local out = {}
    for r = 1, B do
        local docs = b.docs[r]
        local d, seen = nil, 0   -- the query's document, and its valid tokens up to the query
        for s = 0, T - 1 do
            local row = {}
            local vs = b.valid_host[(r - 1) * T + s + 1] ~= 0
            if not (d and s >= d[1] and s < d[2]) then
                d, seen = nil, 0
                for _, dd in ipairs(docs) do if s >= dd[1] and s < dd[2] then d = dd break end end
            end
            if vs then seen = seen + 1 end
            if vs then
                if picked then
                    for k = 1, K do
                        local p = picked.topk[((r - 1) * T + s) * K + k] + 1
                        if picked.mask[((r - 1) * T + s) * P + p] == 0 then
                            local start = rows[r][p].start
                            for j = 0, kp - 1 do row[#row + 1] = start + j end
                        end
                    end
                end
                if self.tail then
                    local n = seen
                    local rem = n % kp
                    local first = d.anchor
                    for j = 0, rem - 1 do
                        local t = first + n - rem + j
                        if t <= s and b.valid_host[(r - 1) * T + t + 1] ~= 0 then row[#row + 1] = t end
                    end
                end
            end
            for j = 1, W do out[#out + 1] = row[j] or -1 end
        end
    end
    return core.from_flat(out, {B, T, W}, 'i64', x:device()), cached
end

return KPool
