-- lunar.generate.flash: generation for GLM-5.3-Flash (lunar.model.glm5_next), the family's side
-- of lunar.generate.decode: what its cache keeps (lunar.generate.cache reads cache_layout), the
-- prefill of packed prompts and the decode step of one new token per sequence. The model's own
-- modules and weights run both (the training forward's layer, Model:layer_forward), and the
-- logits are those of a full forward of each whole sequence (tests/lua/test_generate_flash.lua).
--
--   M.cache_layout(model) -> per layer the cache entries (lunar.generate.cache's form):
--     KDA layers      per sequence: `state` (Hk, Dk, Dk) the delta rule's state, `conv_q`,
--                     `conv_k`, `conv_v` (Kc - 1, Q) the short convs' last inputs (f32)
--     NoPE MLA layers per token: `kv` (kv_lora_rank) the latent after kv_a_layernorm (the
--                     model's dtype); decode absorbs kv_b_proj (lunar.generate.attention)
--     full DSA layers also `pk` (index_head_dim, f32) per pool of index_kpool tokens: the pooled
--                     indexer key, written once, when the pool's last token arrives (a complete
--                     pool never changes: its tokens are anchored at the sequence's start); and
--                     per sequence `open` (kp, 2, Di) f32: the raw keys and gates of the pool
--                     still filling
--   M.prefill(model, cache, seqs, lists, slots_list, opts) -> out     (decode.prefill's result)
--   M.step(model, cache, seqs, list, slots_list, starts, opts) -> out (decode.step's result)
--
-- Prefill runs the prompts as one packed row (cu_seqlens: every prompt a document, its KDA state,
-- conv history and pools starting afresh) through the training layers with b.for_cache, which
-- keep what the cache needs: each document's final state and conv inputs, the latents, the
-- indexer's raw keys, gates and pooled keys.
--
-- A decode step runs the same layers on the new tokens: KDA from and back to each sequence's
-- slot (lunar.nn.KDA:step: lunar.ops.conv1d_step and kda_step update the cache's state in
-- place), NoPE MLA absorbed over the latents, and the k-pool selection of the new query
-- over its sequence's pooled keys: with n tokens, the floor(n / kp) complete pools are the
-- candidates; when there are more than index_topk / kp of them the indexer scores them
-- (lunar.ops.index_scores, the training op) and keeps the best; the tail (the n mod kp newest
-- tokens) is added as training adds it. Every product of a step is row-invariant, the scores and
-- the attention are computed per sequence, so a sequence's bits do not depend on the others of
-- its step. The key lists are built on the host from the sequences' lengths and the top-k pools.
local lunar = require 'lunar'
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local ops = require 'lunar.ops'
local gattn = require 'lunar.generate.attention'
local gpar = require 'lunar.generate.parallel'

local fail = tensor.fail

local M = {}

local ROW_INVARIANT = {row_invariant = true}
local MASKED = -3.4028234663852886e38   -- finfo(f32).min: no pool there

function M.cache_layout(model)
    local layout = {}
    for i, L in ipairs(model.layers) do
        local a = L.attn
        if L.kind == 'kda' then
            local W = a.Kc - 1
            layout[i] = {
                {'state', per = 'sequence', shape = {a.Hk, a.Dk, a.Dk}, dtype = 'f32'},
                {'conv_q', per = 'sequence', shape = {W, a.Q}, dtype = 'f32'},
                {'conv_k', per = 'sequence', shape = {W, a.Q}, dtype = 'f32'},
                {'conv_v', per = 'sequence', shape = {W, a.Q}, dtype = 'f32'},
            }
        else
            local rows = {{'kv', a.Rkv}}
            local ix = a.indexer
            if ix then
                rows[2] = {'pk', ix.Di, per = 'pool', every = ix.kp, dtype = 'f32'}
                rows[3] = {'open', per = 'sequence', shape = {ix.kp, 2, ix.Di}, dtype = 'f32'}
            end
            layout[i] = rows
        end
    end
    return layout
end

-- streams X (n_rows, hc_mult, H) -> logits (n_rows, V): the head reads the streams' mean (under
-- tensor parallel the logits whole and the same bits on every member: lunar.generate.parallel)
local function head(model, X, lopts)
    local h = ops.mean(X, 2)
    local hn = model.norm:forward(h)
    return gpar.logits(gpar.of(model), (model.lm_head:forward(hn, lopts)))
end

-- the embedding of ids (N) i64 copied into the streams (N, hc_mult, H)
local function streams(model, ids)
    local x = model.embed:forward(ids)
    local N, H = x:size(1), x:size(2)
    local X = core.empty({N, model.n, H}, x:dtype(), x:device())
    X:copy_(x:view(N, 1, H):expand(N, model.n, H))
    return X
end

-- a DSA layer's selection: the training forward's (B, T, W) keys, or a step's {keys =, none =}
local function free_selection(sel)
    if tensor.is_tensor(sel) then sel:free()
    elseif type(sel) == 'table' and tensor.is_tensor(sel.keys) then sel.keys:free() end
end

-- runs every layer on X through layer(L, cl, X, prev_sel) -> X3, sel, routing idx; frees each
-- layer's temporaries; returns the last streams and the routing ({[layer] = (N, K) i64})
local function run_layers(model, cache, X, want_routing, layer)
    local prev, routing = nil, {}
    for i, L in ipairs(model.layers) do
        local cl = cache.layers[i]
        local nX, sel, idx = lunar.scope(layer, L, cl, X, prev)
        X:free()
        X = nX
        if prev ~= sel then free_selection(prev) end
        prev = sel
        if idx then
            if want_routing then routing[i - 1] = idx else idx:free() end
        end
    end
    free_selection(prev)
    return X, want_routing and routing or nil
end

-- ---- prefill ------------------------------------------------------------------------------------

-- copies row r of src into slot `slot` (0-based) of the per-sequence tensor dst
local function put(dst, slot, src, r) dst:select(1, slot + 1):copy_(src:select(1, r)) end

local function store_kda(cl, cache, seqs, s)
    for d, id in ipairs(seqs) do
        local slot = cache:slot(id)
        put(cl.state, slot, s.state, d)
        put(cl.conv_q, slot, s.hist_out.q, d)
        put(cl.conv_k, slot, s.hist_out.k, d)
        put(cl.conv_v, slot, s.hist_out.v, d)
    end
end

-- the indexer's cache rows of a packed prefill (one batch row, a document per sequence): the
-- pooled keys of every complete pool, the raw keys and gates of each document's open pool
local function store_index(ix, cl, cache, seqs, b, index)
    local kp = ix.kp
    local docs = b.docs[1]
    local rows, from = {}, {}
    for p, pool in ipairs(index.rows[1]) do
        local d = docs[pool.doc]
        rows[#rows + 1] = cache:pool_row(seqs[pool.doc], (pool.start - d[1]) / kp, kp)
        from[#from + 1] = p - 1
    end
    if #rows > 0 then
        local dev = index.ki:device()
        local pooled = ops.index_select(index.pooled:select(1, 1), 1, core.from_flat(from, {#from}, 'i64', dev))
        cache:write(cl.pk, core.from_flat(rows, {#rows}, 'i64', dev), pooled)
    end
    for di, d in ipairs(docs) do
        local n = d[2] - d[1]
        local open = cl.open:select(1, cache:slot(seqs[di]) + 1)
        for j = 0, n % kp - 1 do
            local t = d[1] + n - n % kp + j
            open:select(1, j + 1):select(1, 1):copy_(index.ki:select(1, t + 1))
            open:select(1, j + 1):select(1, 2):copy_(index.gi:select(1, t + 1))
        end
    end
end

function M.prefill(model, cache, seqs, lists, slots_list, opts)
    local dev = model:device()
    local flat, cu, last = {}, {0}, {}
    for i, list in ipairs(lists) do
        for _, t in ipairs(list) do flat[#flat + 1] = t end
        cu[i + 1] = #flat
        last[i] = #flat - 1
    end
    local N = #flat
    local b = model:prepare({input_ids = core.from_flat(flat, {1, N}, 'i64'),
                             cu_seqlens = core.from_flat(cu, {#cu}, 'i64')})
    b.for_cache = true
    local slots = core.from_flat(slots_list, {N}, 'i64', dev)
    local X = streams(model, b.ids)
    local hidden, routing = run_layers(model, cache, X, opts.routing, function(L, cl, Xin, prev)
        local X3, s, sel, r = model:layer_forward(L, Xin, b, prev, nil)
        local sa = s.s_attn
        if L.kind == 'kda' then
            store_kda(cl, cache, seqs, sa)
        else
            cache:write(cl.kv, slots, sa.k_lat)
            if cl.pk then store_index(L.attn.indexer, cl, cache, seqs, b, sa.index) end
        end
        return X3, sel, r and r.idx
    end)
    local out = {cu_seqlens = cu, routing = routing}
    out.logits = head(model, ops.index_select(hidden, 1, core.from_flat(last, {#last}, 'i64', dev)))
    if opts.all_logits then out.all_logits = head(model, hidden) end
    return out
end

-- ---- decode step ----------------------------------------------------------------------------------

-- the new token's raw key and gate into its sequence's open pool; a pool completed by it has
-- its pooled key written to the cache
local function index_write(ix, cl, cache, xn, step)
    local kp = ix.kp
    local ki, gi = ix:token_keys(xn, ROW_INVARIANT)
    local done, rows = {}, {}
    for k, id in ipairs(step.seqs) do
        local n = step.view.lens[k]
        local j = (n - 1) % kp
        local open = cl.open:select(1, step.slot_list[k] + 1):select(1, j + 1)
        open:select(1, 1):copy_(ki:select(1, k))
        open:select(1, 2):copy_(gi:select(1, k))
        if j == kp - 1 then
            done[#done + 1] = step.slot_list[k]
            rows[#rows + 1] = cache:pool_row(id, n / kp - 1, kp)
        end
    end
    if #done > 0 then
        local dev = xn:device()
        local M_, Di = #done, ix.Di
        local open = ops.index_select(cl.open, 1, core.from_flat(done, {M_}, 'i64', dev))   -- (M, kp, 2, Di)
        local pooled = ix:pool_keys(open:narrow(3, 1, 1):contiguous():view(M_, kp, Di),
                                    open:narrow(3, 2, 1):contiguous():view(M_, kp, Di))
        cache:write(cl.pk, core.from_flat(rows, {#rows}, 'i64', dev), pooled)
    end
end

-- the k-pool selection of the step's queries -> {keys = (B, 1, W) positions, or false when every
-- sequence attends all its tokens; none = the rows (1-based) that select no key, or nil}. Without
-- the tail, a sequence shorter than one pool selects nothing; transformers' eager attention then
-- averages the values of every token uniformly (its additive mask is finfo.min everywhere), and
-- so does lunar's training forward: such a row attends all its tokens with a zero query.
local function index_select(ix, cl, cache, xn, q_resid, step)
    local kp, v = ix.kp, step.view
    local K = math.floor(ix.topk / kp)
    local scored, all, none = {}, true, nil
    for k = 1, v.B do
        local n = v.lens[k]
        if math.floor(n / kp) > K then scored[#scored + 1] = k end
        if not ix.tail and n % kp ~= 0 then all = false end
        if not ix.tail and n < kp then
            none = none or {}
            none[#none + 1] = k
        end
    end
    if #scored == 0 and all then return {keys = false} end
    local dev = xn:device()
    local best = {}
    if #scored > 0 then
        local M_, Hi, Di = #scored, ix.Hi, ix.Di
        local rows, ids = {}, {}
        for i, k in ipairs(scored) do rows[i], ids[i] = k - 1, step.seqs[k] end
        local pick = core.from_flat(rows, {M_}, 'i64', dev)
        local sub = cache:view(ids)
        local pooled = cache:gather(cl.pk, sub)                                   -- (M, Pmax, Di)
        local Pmax = pooled:size(2)
        local mask = {}
        for i, k in ipairs(scored) do
            local np = math.floor(v.lens[k] / kp)
            for p = 0, Pmax - 1 do mask[#mask + 1] = p < np and 0 or MASKED end
        end
        local qi = ix.wq_b:forward(ops.index_select(q_resid, 1, pick), ROW_INVARIANT):view(M_, 1, Hi, Di)
        local w = ops.mul(ix.weights_proj:forward(ops.index_select(xn, 1, pick), ROW_INVARIANT):float(), Hi ^ -0.5)
        local _, topk = ops.index_scores(qi, pooled, w:view(M_, 1, Hi),
            {mask = core.from_flat(mask, {M_, 1, Pmax}, 'f32', dev), scale = Di ^ -0.5, topk = K, scores = false})
        local list = topk:to('cpu'):tolist_flat()
        for i, k in ipairs(scored) do
            local l = {}
            for j = 1, K do l[j] = list[(i - 1) * K + j] end
            best[k] = l
        end
    end
    local width = ix:width()
    local keys = {}
    for k = 1, v.B do
        local n = v.lens[k]
        local row = {}
        local pools = best[k]
        if not pools then
            pools = {}
            for p = 0, math.floor(n / kp) - 1 do pools[#pools + 1] = p end
        end
        for _, p in ipairs(pools) do
            for j = 0, kp - 1 do row[#row + 1] = p * kp + j end
        end
        if ix.tail or n < kp then
            for t = n - n % kp, n - 1 do row[#row + 1] = t end
        end
        for j = 1, width do keys[#keys + 1] = row[j] or -1 end
    end
    return {keys = core.from_flat(keys, {v.B, 1, width}, 'i64', dev), none = none}
end

-- one NoPE MLA layer for the step: latent written, selection, absorbed attention
local function dsa_step(a, cl, cache, xn, step, prev_sel)
    local B = step.view.B
    local q_resid = (a.q_a_layernorm:forward((a.q_a_proj:forward(xn, ROW_INVARIANT))))
    local k_lat = (a.kv_a_layernorm:forward((a.kv_a_proj:forward(xn, ROW_INVARIANT))))
    cache:write(cl.kv, step.slots, k_lat)
    local sel
    if a.indexer then
        index_write(a.indexer, cl, cache, xn, step)
        sel = index_select(a.indexer, cl, cache, xn, q_resid, step)
    else
        if prev_sel == nil then
            fail(('decode: %s is a shared DSA layer with no full DSA layer before it'):format(a.name))
        end
        sel = prev_sel
    end
    local q = a.q_b_proj:forward(q_resid, ROW_INVARIANT):view({B, a.NH, a.Dn})
    for _, k in ipairs(sel.none or {}) do q:select(1, k):fill_(0) end
    -- (tensor parallel: this member's heads' partial sum, made whole)
    return step.decode_heads:forward(gattn.absorbed(a, cl.kv, cache, q, step, sel.keys)), sel
end

function M.step(model, cache, seqs, list, slots_list, _, opts)
    local B, dev = #seqs, model:device()
    local slot_list, seg = {}, {0}
    for k, id in ipairs(seqs) do slot_list[k], seg[k + 1] = cache:slot(id), k end
    local step = {
        view = cache:view(seqs), seqs = seqs, slots = core.from_flat(slots_list, {B}, 'i64', dev),
        slot_list = slot_list, state_slots = core.from_flat(slot_list, {B}, 'i64', dev),
        seg = core.from_flat(seg, {B + 1}, 'i64', dev), linear = ROW_INVARIANT, decode_heads = model.par.decode_heads,
    }
    local X = streams(model, core.from_flat(list, {B}, 'i64', dev))
    local hidden, routing = run_layers(model, cache, X, opts.routing, function(L, cl, Xin, prev)
        local sel
        local dec = {linear = ROW_INVARIANT, attend = function(_, xn, prev_sel)
            local a
            -- KDA: each sequence's state and conv inputs read and updated in its slot
            if L.kind == 'kda' then a = L.attn:step(xn, cl, step.state_slots, ROW_INVARIANT)
            else a, sel = dsa_step(L.attn, cl, cache, xn, step, prev_sel) end
            return a, sel
        end}
        local X3, _, _, r = model:layer_forward(L, Xin, nil, prev, nil, dec)
        return X3, sel, r and r.idx
    end)
    return {logits = head(model, hidden, ROW_INVARIANT), routing = routing}
end

return M
