-- lunar.generate.attention: the attention of one decoder layer for generation, over the paged
-- KV cache (lunar.generate.cache), with the weights of the layer's training module (lunar.nn.MLA
-- or lunar.nn.GQA) read from the parameter store at every call. docs/generation.md.
--
--   local gattn = require 'lunar.generate.attention'
--   gattn.store_prefill(layer, cache_layer, cache, xn, batch, slots)
--       after the training module's forward on a packed prompt batch (lunar.model's
--       prepare(): positions, inv_freq), writes the layer's cache rows for its N tokens:
--       xn (N, H) the layer's normed input, slots (N) i64 the rows (cache:append).
--   local out, sel = gattn.decode(layer, cache_layer, cache, xn, step, prev_sel)
--       one new token per sequence: xn (B, H); step = {view = cache:view(ids), slots = (B) i64,
--       positions = (B, 1) i64, inv_freq =, rope_scale = 1}. Writes the new token's rows, then
--       attends over each sequence's cached tokens (its own new one included). Returns the
--       attention output (B, H) before the residual and, on GLM-5, the DSA selection `sel`:
--       (B, 1, index_topk) i64 positions, or false when every cached token is selected;
--       IndexShare layers return prev_sel unchanged. Under tensor parallel (the layer's heads
--       split) the output is this member's partial sum: the caller all-reduces it.
--
-- GLM-5 (MLA, weight-absorbed). kv_b_proj (NH * (Dn + Dv), Rkv) is W_uk (NH, Dn, Rkv) over
-- W_uv (NH, Dv, Rkv). A query's nope score against a cached latent c is q_nope . (W_uk c) =
-- (W_uk^T q_nope) . c, so each head's query becomes q_abs = W_uk^T q_nope (Rkv) and the cache row
-- [c | k_rot] serves as the key of every head: score = [q_abs | q_rot] . [c | k_rot] * scaling.
-- The value of head h is W_uv c, so the attention output is W_uv (sum_t p_t c_t): the
-- probabilities weight the latents (one key and value head shared by all NH query heads, the
-- fused attention op's Hk = 1) and W_uv maps each head's result once. Nothing per cached token is
-- ever expanded. A LoRA adapter on kv_b_proj (W + s B A) takes the same route through its two
-- factors (W_uk^T q + s A^T (B_uk^T q), and likewise for the output).
--
-- DSA at decode: the new token's indexer query scores every cached indexer key of its sequence
-- (lunar.ops.index_scores, the training op, with the length mask) and keeps the index_topk best;
-- while no sequence of the step holds more than index_topk tokens every token is selected and
-- nothing is scored, as training does for T <= index_topk. IndexShare layers reuse the selection
-- of the full layer before them.
--
-- GLM-4.x (GQA): the cache holds the keys after qk-norm and partial RoPE, and the values; the new
-- token's query attends over them with the fused attention op (Hk = num_key_value_heads).
--
-- Every cache read is one gather of the step's sequences' blocks into a dense (B, Lpad, width)
-- block (lunar.generate.cache:gather), freed with the layer's other temporaries.
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local ops = require 'lunar.ops'

local fail = tensor.fail

local M = {}

local function rope_opts(layout, step) return {layout = layout, scale = step.rope_scale or 1} end

-- ---- writes of a prompt batch (prefill) -------------------------------------------------------

-- the cache row [kv_a_layernorm(latent) | RoPE(k_rot)] of MLA attention a for x (N, H), as its
-- forward computes them (lopts: the Linears' options, row_invariant at decode)
local function mla_rows(a, x, positions, inv_freq, ropt, lopts)
    local N, Rkv, Dr = x:size(1), a.Rkv, a.Dr
    local ckv = a.kv_a_proj:forward(x, lopts)
    local k_lat = a.kv_a_layernorm:forward(ckv:narrow(2, 1, Rkv))
    local k_rot = ops.rope(ckv:narrow(2, Rkv + 1, Dr):reshape({N, 1, Dr}), positions:reshape(N), inv_freq, ropt)
    local rows = core.empty({N, Rkv + Dr}, k_lat:dtype(), x:device())
    rows:narrow(2, 1, Rkv):copy_(k_lat)
    rows:narrow(2, Rkv + 1, Dr):copy_(k_rot:view({N, Dr}))
    return rows
end

-- the indexer key RoPE(LayerNorm(wk x)) (N, Di) of DSA indexer ix, as its forward computes it
local function indexer_keys(ix, x, positions, inv_freq, ropt, lopts)
    local N, Di = x:size(1), ix.Di
    local kpre = ix.wk:forward(x, lopts)
    local kn = ops.layernorm(kpre, ix.store:get(ix.knw), ix.store:get(ix.knb), ix.eps)
    return ops.rope(kn:view({N, 1, Di}), positions:reshape(N), inv_freq, ropt):view({N, Di})
end

-- GQA keys after qk-norm and RoPE, and the values, of x (N, H): (N, nkv * hd) each
local function gqa_rows(a, x, positions, inv_freq, ropt, lopts)
    local N, nkv, hd = x:size(1), a.nkv, a.hd
    local k = a.k_proj:forward(x, lopts)
    local v = a.v_proj:forward(x, lopts)
    if a.k_norm then k = a.k_norm:forward(k:view({N * nkv, hd})) end
    local kr = ops.rope(k:view({N, nkv, hd}), positions:reshape(N), inv_freq, ropt)
    return kr:view({N, nkv * hd}), v
end

function M.store_prefill(layer, cl, cache, xn, batch, slots)
    local a = layer.attn
    local step = {rope_scale = batch.rope_scale}
    if cl.kv then
        local ropt = rope_opts('interleaved_to_half', step)
        cache:write(cl.kv, slots, mla_rows(a, xn, batch.positions, batch.inv_freq, ropt))
        if cl.ik then cache:write(cl.ik, slots, indexer_keys(a.indexer, xn, batch.positions, batch.inv_freq, ropt)) end
    else
        local k, v = gqa_rows(a, xn, batch.positions, batch.inv_freq, rope_opts('half', step))
        cache:write(cl.k, slots, k)
        cache:write(cl.v, slots, v)
    end
end

-- ---- decode -----------------------------------------------------------------------------------

-- The kv_b_proj adapter's factors for the absorbed products, or nil. Dropout is a training-time
-- perturbation that the absorbed form cannot apply: refused rather than skipped.
local function kvb_adapter(a)
    local ad = a.store:adapter(a.kv_b_proj.name)
    if not ad then return nil end
    if ad.dropout > 0 and ad.set.training then
        fail(('decode: the LoRA adapter on %s has dropout %g and its set is in training mode; '
            .. 'call set:eval() before generating'):format(a.kv_b_proj.name, ad.dropout))
    end
    local P = ad.set.params
    return {A = P:get(ad.a_name), B = P:get(ad.b_name), scale = ad.scale}
end

-- DSA selection of a full layer for the step: (B, 1, k) positions or false (all selected)
local function dsa_select(a, cl, cache, xn, q_resid, step)
    local v = step.view
    if v.max_len <= a.index_topk then return false end
    local ix = a.indexer
    local B, Hi, Di = v.B, ix.Hi, ix.Di
    local ropt = rope_opts('interleaved_to_half', step)
    local qi = ix.wq_b:forward(q_resid, step.linear)
    local qr = ops.rope(qi:view({B, 1, Hi, Di}), step.positions, step.inv_freq, ropt)
    local wts = ix.weights_proj:forward(xn, step.linear)
    if wts:dtype() ~= 'f32' then wts = wts:to('f32') end
    ops.mul_(wts, Hi ^ -0.5)
    local keys = cache:gather(cl.ik, v)
    -- (the indexer's heads split over tp, split_indexer: this member's heads' part of the scores
    -- summed over tp, then the top-k every member shares, as training does; by position: the
    -- paged attention reads its keys in increasing order)
    local _, sel = ix.select:select(qr, keys, wts:view({B, 1, Hi}), v.mask, Di ^ -0.5, a.index_topk,
        {scores = false, sorted = true, name = ix.name})
    keys:free()
    return sel
end

local function mla_decode(a, cl, cache, xn, step, prev_sel)
    local B, NH, Dn, Dr = step.view.B, a.NH, a.Dn, a.Dr
    local ropt = rope_opts('interleaved_to_half', step)
    -- the new token's cache rows (and indexer key), written before the read: it attends to itself
    local lo = step.linear
    cache:write(cl.kv, step.slots, mla_rows(a, xn, step.positions, step.inv_freq, ropt, lo))
    local q_resid = a.q_a_layernorm:forward(a.q_a_proj:forward(xn, lo))
    if cl.ik then cache:write(cl.ik, step.slots, indexer_keys(a.indexer, xn, step.positions, step.inv_freq, ropt, lo)) end
    local sel
    if a.indexer_type == 'full' then
        sel = dsa_select(a, cl, cache, xn, q_resid, step)
    elseif a.indexer_type == 'shared' then
        if prev_sel == nil then
            fail(('decode: %s is an IndexShare layer with no full indexer layer before it'):format(a.name))
        end
        sel = prev_sel
    else
        sel = false
    end
    local q = a.q_b_proj:forward(q_resid, lo):view({B, NH, Dn + Dr})
    return M.absorbed(a, cl.kv, cache, q, step, sel, ropt), sel
end

-- The weight-absorbed attention of MLA layer a (the header) for one query per sequence:
-- q (B, NH, Dn + Dr) the q_b_proj output, kv the cache's latent rows [c | k_rot] (Dr = 0: the
-- latent alone, GLM-5.3-Flash's NoPE MLA), sel (B, 1, K) positions or false (all), ropt the
-- rotary options of the query's rotated part (Dr > 0 only). -> o_proj's output (B, H).
function M.absorbed(a, kv, cache, q, step, sel, ropt)
    local v = step.view
    local B, NH, Dn, Dv, Rkv = v.B, a.NH, a.Dn, a.Dv, a.Rkv
    local Dr = a.Dr or 0
    local lo = step.linear
    local dt, dev = q:dtype(), q:device()
    -- absorbed query [W_uk^T q_nope | RoPE(q_rot)] (B, 1, NH, Rkv + Dr)
    local W = a.store:get(a.kv_b_proj.wname):view({NH, Dn + Dv, Rkv})
    local ad = kvb_adapter(a)
    local qq = core.empty({B, 1, NH, Rkv + Dr}, dt, dev)
    local q_nope = q:narrow(3, 1, Dn):transpose(1, 2)                    -- (NH, B, Dn)
    local q_abs = qq:view({B, NH, Rkv + Dr}):narrow(3, 1, Rkv):transpose(1, 2)  -- (NH, B, Rkv)
    ops.gemm(q_nope, W:narrow(2, 1, Dn), {out = q_abs, row_invariant = true})
    if ad then
        -- + s (q_nope B_uk) A: B (NH * (Dn + Dv), r) viewed (NH, Dn + Dv, r)
        local r = ad.A:size(1)
        local qb = ops.gemm(q_nope:to(ad.B:dtype()), ad.B:view({NH, Dn + Dv, r}):narrow(2, 1, Dn),
            {row_invariant = true})                                                                 -- (NH, B, r)
        local d = ops.gemm(qb, ad.A, {alpha = ad.scale, row_invariant = true})                       -- (NH, B, Rkv)
        ops.add_(q_abs, d)
    end
    if Dr > 0 then
        ops.rope(q:narrow(3, Dn + 1, Dr):unsqueeze(2), step.positions, step.inv_freq,
            {layout = ropt.layout, scale = ropt.scale, out = qq:narrow(4, Rkv + 1, Dr)})
    end
    -- attention over the latents, read in place: one key/value head for all NH query heads
    local o = ops.attention_paged(qq:view({B, NH, Rkv + Dr}), kv, kv:narrow(2, 1, Rkv), v.table, v.lengths,
        {block_size = cache.block_size, keys = sel and sel:view({B, sel:size(3)}) or nil, scale = a.scaling})  -- (B, NH, Rkv)
    -- per head W_uv (sum_t p_t c_t): (NH, B, Rkv) x (NH, Dv, Rkv)^T -> (B, NH, Dv)
    local ob = core.empty({B, NH, Dv}, dt, dev)
    local o_t = o:view({B, NH, Rkv}):transpose(1, 2)
    ops.gemm(o_t, W:narrow(2, Dn + 1, Dv), {trans_b = true, out = ob:transpose(1, 2), row_invariant = true})
    if ad then
        local r = ad.A:size(1)
        local oa = ops.gemm(o_t:to(ad.A:dtype()), ad.A, {trans_b = true, row_invariant = true})   -- (NH, B, r)
        local d = ops.gemm(oa, ad.B:view({NH, Dn + Dv, r}):narrow(2, Dn + 1, Dv),
            {trans_b = true, alpha = ad.scale, row_invariant = true})
        ops.add_(ob:transpose(1, 2), d)
    end
    return (a.o_proj:forward(ob:view({B, NH * Dv}), lo))
end

local function gqa_decode(a, cl, cache, xn, step)
    local v = step.view
    local B, NH, nkv, hd = v.B, a.NH, a.nkv, a.hd
    local ropt = rope_opts('half', step)
    local k, val = gqa_rows(a, xn, step.positions, step.inv_freq, ropt, step.linear)
    cache:write(cl.k, step.slots, k)
    cache:write(cl.v, step.slots, val)
    local q = a.q_proj:forward(xn, step.linear)
    if a.q_norm then q = a.q_norm:forward(q:view({B * NH, hd})) end
    local qh = ops.rope(q:view({B, 1, NH, hd}), step.positions, step.inv_freq, ropt)
    local o = ops.attention_paged(qh:view({B, NH, hd}), cl.k, cl.v, v.table, v.lengths,
        {block_size = cache.block_size, scale = a.scaling})                                 -- (B, NH, hd)
    return a.o_proj:forward(o:view({B, NH * hd}), step.linear)
end

-- the dense mask of the DSA indexer's reads (cache:mask), made before the layers' scopes when a
-- layer of the step will score: a full indexer layer whose index_topk some sequence exceeds
function M.prepare_step(model, cache, v)
    for _, L in ipairs(model.layers) do
        local a = L.attn
        if a.indexer_type == 'full' and v.max_len > a.index_topk then
            cache:mask(v)
            return
        end
    end
end

function M.decode(layer, cl, cache, xn, step, prev_sel)
    if cl.kv then return mla_decode(layer.attn, cl, cache, xn, step, prev_sel) end
    return gqa_decode(layer.attn, cl, cache, xn, step), nil
end

return M
