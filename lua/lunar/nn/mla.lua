-- lunar.nn.MLA: GLM-5 multi-head latent attention of one layer (glm5-architecture.md section 5,
-- V-latest = state E of section 11: interleaved RoPE written in half-split order for q_rot and
-- k_rot), with its DSA indexer (lunar.nn.dsa) on "full" layers and IndexShare on "shared" ones.
--
-- Weights under `name` (".../self_attn"), [out, in]:
--   q_a_proj (Rq, H) [+bias], q_a_layernorm (Rq; RMSNorm eps 1e-6), q_b_proj (NH*(Dn+Dr), Rq),
--   kv_a_proj_with_mqa (Rkv+Dr, H) [+bias], kv_a_layernorm (Rkv; eps 1e-6),
--   kv_b_proj (NH*(Dn+Dv), Rkv), o_proj (H, NH*Dv) [+bias]; biases when cfg.attention_bias.
--   indexer.* on full layers (lunar.nn.dsa).
--
--   attn = MLA.new(store, name, cfg, {indexer = 'full'|'shared'|'none', indexer_loss_coeff = 0,
--                                     indexer_loss = 'sparse'|'dense', par = ctx})
--       ctx (lunar.parallel.context): under tensor parallel this rank's heads (q_b_proj and
--       kv_b_proj column parallel by heads, o_proj row parallel) and the mappings that reduce its
--       partial sums; the low-rank projections, their norms and the indexer stay whole (the
--       indexer's heads split too with the context's split_indexer)
--       cfg: HF config fields hidden_size, num_attention_heads, q_lora_rank, kv_lora_rank,
--       qk_nope_head_dim, qk_rope_head_dim, v_head_dim, attention_bias, rope_parameters (for
--       YaRN's mscale only), and for the indexer index_topk, index_n_heads, index_head_dim.
--       indexer defaults to 'full' when cfg.index_topk is set, else 'none' (plain causal MLA).
--   out, saved, topk = attn:forward(x, batch, prev_topk)
--       x (N, H) = input_layernorm output, N = B*T; batch = {B =, T =, positions = (B, T) i64,
--       mask = (B, T, T) additive (lunar.nn.masks), inv_freq = (Dr/2) f32[, rope_scale = 1]
--       [, attention_mask = (B, T) for the indexer loss' valid queries]}.
--       'full': runs the indexer and returns its top-k (B, T, k) i64; 'shared': uses prev_topk
--       (error if nil) and returns it; 'none': topk is nil. Every key outside the top-k is set
--       to finfo.min in the mask, so a key is attended iff causally visible AND selected.
--       When T <= index_topk every key is selected and the mask is used as is (and without a KL
--       loss the indexer is not even run: topk is then 0 .. T-1 for every query); the same when
--       batch.longest_doc (packed rows: the longest document) is <= index_topk. batch.key_lists
--       (B, T, K) i64 (with batch.max_visible, the longest list): the keys each query sees, for a
--       row whose layout the mask alone would make costly (a shared prompt, lunar.rl.batch); the
--       attention reads only those (AND the mask; not the mask at all when batch.key_lists_exact
--       says the lists are exactly the visible keys), and a DSA layer whose lists all fit in
--       index_topk takes them as its selection.
--       saved.indexer_loss is the indexer KL loss (full layers with a coefficient > 0).
--   dx, indexer_loss = attn:backward(dout, saved, need_dx)
--       dout (N, H). Parameter gradients accumulate (+=); the indexer's parameters get only the
--       KL-loss gradient (none at all when the coefficient is 0); q_resid gets gradient only
--       through q_b_proj. need_dx = false skips dx.
--   attn.scaling = (Dn+Dr)^-0.5 (times YaRN's mscale^2 when rope_parameters asks for it).
local lunar_core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local ops = require 'lunar.ops'
local context = require 'lunar.parallel.context'
local Linear = require 'lunar.nn.linear'
local RMSNorm = require 'lunar.nn.rmsnorm'
local attention = require 'lunar.nn.attention'
local masks = require 'lunar.nn.masks'
local DSA = require 'lunar.nn.dsa'

local MLA = {}
MLA.__index = MLA

local function need(cfg, key, who)
    local v = cfg[key]
    if type(v) ~= 'number' then tensor.fail(('%s: config field %s must be a number, got %s'):format(who, key, tostring(v))) end
    return v
end

-- HF yarn_apply_mscale: scaling * mscale^2 when rope_type ~= default and mscale_all_dim is set
local function softmax_scale(cfg, dqk)
    local s = dqk ^ -0.5
    local rp = cfg.rope_parameters
    if type(rp) == 'table' and (rp.rope_type or 'default') ~= 'default' and (rp.mscale_all_dim or 0) ~= 0 then
        local factor = rp.factor or 1
        local m = factor <= 1 and 1 or (0.1 * rp.mscale_all_dim * math.log(factor) + 1)
        s = s * m * m
    end
    return s
end

function MLA.new(store, name, cfg, opts)
    opts = opts or {}
    local who = 'MLA ' .. name
    local bias = cfg.attention_bias and true or false
    local par = opts.par or context.NONE
    -- tensor parallel: this rank's heads
    local NH = par:heads(cfg, 'num_attention_heads', who)
    local io = par:block('attention')
    local self = setmetatable({
        store = store, name = name, par = par,
        -- the partial sums (output, input gradient) all-reduced here, or by the decoder layer
        -- (sequence parallel reduce-scatters them)
        input = io.input, output = io.output,
        H = need(cfg, 'hidden_size', who), NH = NH,
        Rq = need(cfg, 'q_lora_rank', who), Rkv = need(cfg, 'kv_lora_rank', who),
        Dn = need(cfg, 'qk_nope_head_dim', who), Dr = need(cfg, 'qk_rope_head_dim', who),
        Dv = need(cfg, 'v_head_dim', who),
        q_a_proj = Linear.new(store, name .. '.q_a_proj', {bias = bias}),
        q_a_layernorm = RMSNorm.new(store, name .. '.q_a_layernorm', 1e-6),
        q_b_proj = Linear.new(store, name .. '.q_b_proj'),
        kv_a_proj = Linear.new(store, name .. '.kv_a_proj_with_mqa', {bias = bias}),
        kv_a_layernorm = RMSNorm.new(store, name .. '.kv_a_layernorm', 1e-6),
        kv_b_proj = Linear.new(store, name .. '.kv_b_proj'),
        o_proj = Linear.new(store, name .. '.o_proj', {bias = bias}),
        indexer_type = opts.indexer or (cfg.index_topk and 'full' or 'none'),
        indexer_loss_coeff = opts.indexer_loss_coeff or 0,
        indexer_loss = opts.indexer_loss or 'sparse',
    }, MLA)
    self.Dqk = self.Dn + self.Dr
    self.scaling = softmax_scale(cfg, self.Dqk)
    local it = self.indexer_type
    if it ~= 'full' and it ~= 'shared' and it ~= 'none' then
        tensor.fail(('%s: indexer must be full, shared or none, got %s'):format(who, tostring(it)))
    end
    if self.indexer_loss ~= 'sparse' and self.indexer_loss ~= 'dense' then
        tensor.fail(('%s: indexer_loss must be sparse or dense, got %s'):format(who, tostring(self.indexer_loss)))
    end
    -- (split_indexer: the indexer's heads split over tp too, its scores all-reduced, B x T x T)
    if it == 'full' then self.indexer = DSA.new(store, name .. '.indexer', cfg, {par = par}) end
    if it ~= 'none' then self.index_topk = need(cfg, 'index_topk', who) end
    return self
end

local function rope_opts(batch) return {layout = 'interleaved_to_half', scale = batch.rope_scale or 1} end

-- tensor parallel: the whole parameters whose gradients cover this rank's heads only (everything
-- before q_b_proj and kv_b_proj, which feed the heads; the indexer gets no LM-loss gradient)
function MLA:tp_partial()
    local out = {}
    for _, m in ipairs({self.q_a_proj, self.kv_a_proj}) do
        out[#out + 1] = m.name .. '.weight'
        out[#out + 1] = m.name .. '.bias'
    end
    out[#out + 1] = self.name .. '.q_a_layernorm.weight'
    out[#out + 1] = self.name .. '.kv_a_layernorm.weight'
    return self.par:partial(out)
end

function MLA:forward(x, batch, prev_topk)
    local B, T, NH, Dn, Dr, Dv, Dqk, Rkv = batch.B, batch.T, self.NH, self.Dn, self.Dr, self.Dv, self.Dqk, self.Rkv
    local N = B * T
    if x:dim() ~= 2 or x:size(1) ~= N or x:size(2) ~= self.H then
        tensor.fail(('MLA %s: x must be (B*T, H) = (%d, %d), got (%s)'):format(self.name, N, self.H, table.concat(x:size(), ', ')))
    end
    if batch.inv_freq:numel() * 2 ~= Dr then
        tensor.fail(('MLA %s: inv_freq has %d entries, expected qk_rope_head_dim/2 = %d'):format(
            self.name, batch.inv_freq:numel(), Dr / 2))
    end
    x = self.input:forward(x)
    local saved = {batch = batch}
    -- q path: q_resid = q_a_layernorm(q_a_proj(x)); q = q_b_proj(q_resid), per head [nope | rope]
    local qa
    qa, saved.qa = self.q_a_proj:forward(x)
    local q_resid
    q_resid, saved.qn = self.q_a_layernorm:forward(qa)
    local q
    q, saved.qb = self.q_b_proj:forward(q_resid)
    local q4 = q:view({B, T, NH, Dqk})
    local query = lunar_core.empty({B, T, NH, Dqk}, q:dtype(), q:device())
    query:narrow(4, 1, Dn):copy_(q4:narrow(4, 1, Dn))
    ops.rope(q4:narrow(4, Dn + 1, Dr), batch.positions, batch.inv_freq,
        {layout = 'interleaved_to_half', scale = batch.rope_scale or 1, out = query:narrow(4, Dn + 1, Dr)})
    -- kv path: ckv = [latent Rkv | k_rot Dr]; k_lat = kv_a_layernorm(latent); kvb = kv_b_proj(k_lat)
    local ckv
    ckv, saved.kva = self.kv_a_proj:forward(x)
    local k_lat
    k_lat, saved.kvn = self.kv_a_layernorm:forward(ckv:narrow(2, 1, Rkv))
    local k_rot = ops.rope(ckv:narrow(2, Rkv + 1, Dr):reshape({B, T, 1, Dr}), batch.positions, batch.inv_freq,
        rope_opts(batch))
    local kvb
    kvb, saved.kvb = self.kv_b_proj:forward(k_lat)
    local kvb4 = kvb:view({B, T, NH, Dn + Dv})
    local key = lunar_core.empty({B, T, NH, Dqk}, kvb:dtype(), kvb:device())
    key:narrow(4, 1, Dn):copy_(kvb4:narrow(4, 1, Dn))
    key:narrow(4, Dn + 1, Dr):copy_(k_rot:expand({B, T, NH, Dr}))
    -- DSA selection
    local topk, isaved
    local mask = batch.mask
    local kl = self.indexer_type == 'full' and self.indexer_loss_coeff > 0
    if self.indexer_type == 'full' then
        if batch.key_lists and batch.max_visible <= self.index_topk and not kl then
            -- a row whose queries see listed keys (shared-prompt packing), no more than
            -- index_topk each: every visible key is selected, and the lists are the selection
            topk = batch.key_lists
        elseif T <= self.index_topk and not kl then
            -- every key is selected whatever the scores (section 6.3), so the scores are not
            -- computed: topk[b, s] = 0 .. T-1 (HF returns the same set in score order)
            topk = lunar_core.empty({B, T, T}, 'i64', x:device())
            topk:copy_(lunar_core.empty({1, 1, T}, 'i64', x:device()):arange_(0, 1):expand({B, T, T}))
        elseif batch.longest_doc and batch.longest_doc <= self.index_topk and not kl then
            -- a packed row of documents that all fit in index_topk: each query sees at most
            -- index_topk keys (its own document's), so it selects every key it sees, as above; the
            -- selection is the mask itself (an (B, T, T) view of 0 .. T-1, no per-query list)
            topk = lunar_core.empty({1, 1, T}, 'i64', x:device()):arange_(0, 1):expand({B, T, T})
        else
            topk, isaved = self.indexer:forward(x, q_resid, batch, {keep = kl, scores = kl})
            if kl then saved.isaved = isaved end
        end
    elseif self.indexer_type == 'shared' then
        if prev_topk == nil then
            tensor.fail(('MLA %s: a shared (IndexShare) layer needs the top-k of a previous full layer'):format(self.name))
        end
        topk = prev_topk
    end
    local keys = (topk ~= nil and topk:size(3) < T) and topk or nil
    if self.indexer_type == 'none' and batch.key_lists then keys = batch.key_lists end
    local v = kvb4:narrow(4, Dn + 1, Dv):contiguous()
    local o
    if not kl then
        -- fused, token-major: each query attends its top-k keys that the mask shows
        local asaved
        -- exact key lists (every key listed is visible, and only those) make the mask redundant:
        -- its visible entries add 0, so the attention skips reading it
        local amask = (keys ~= nil and keys == batch.key_lists and batch.key_lists_exact) and nil or mask
        o, asaved = attention.forward_tokens(query, key, v, amask, self.scaling, {keys = keys})
        saved.att = asaved
    else
        -- the indexer KL loss needs the probabilities: the dense path (heads first)
        local qh = query:transpose(2, 3):contiguous()
        local kh = key:transpose(2, 3):contiguous()
        local vh = v:transpose(2, 3):contiguous()
        local amask = keys and masks.select(mask, keys) or mask
        local asaved
        o, asaved = attention.forward_dense(qh, kh, vh, amask, self.scaling)
        saved.att = asaved
        o = o:transpose(2, 3)
        -- indexer KL loss (detached target from the main attention)
        local valid = masks.query_valid(mask, batch.attention_mask)
        local p, smask
        if self.indexer_loss == 'sparse' then
            p, smask = DSA.target(asaved.P), amask
        else
            local Sc = attention.scores(qh, kh, self.scaling)
            ops.add_(Sc, mask:unsqueeze(2))
            p, smask = DSA.target(ops.softmax(Sc)), mask
            Sc:free()
        end
        saved.indexer_loss = self.indexer:kl_loss(isaved, p, smask, valid, self.indexer_loss_coeff)
    end
    -- (B, T, NH, Dv) -> (N, NH*Dv) head-major features -> o_proj
    local of = o:contiguous():view({N, NH * Dv})
    local out
    out, saved.o = self.o_proj:forward(of)
    return self.output:forward(out), saved, topk   -- the heads' partial sums
end

function MLA:backward(dout, saved, need_dx)
    local batch = saved.batch
    local B, T, NH, Dn, Dr, Dv, Dqk, Rkv = batch.B, batch.T, self.NH, self.Dn, self.Dr, self.Dv, self.Dqk, self.Rkv
    local N = B * T
    local indexer_loss = saved.indexer_loss
    if saved.isaved then self.indexer:backward(saved.isaved) end
    local dof = self.o_proj:backward(self.output:backward(dout), saved.o)
    local dq, dk, dv
    if saved.att.dense then
        local dqh, dkh, dvh = attention.backward_dense(dof:view({B, T, NH, Dv}):transpose(2, 3), saved.att)
        dq, dk, dv = dqh:transpose(2, 3), dkh:transpose(2, 3), dvh:transpose(2, 3)
    else
        dq, dk, dv = attention.backward_tokens(dof:view({B, T, NH, Dv}), saved.att)
    end
    -- dkvb (B, T, NH, Dn+Dv) = [dk_nope | dv], d k_rot = sum over heads of dk[..., Dn:]
    local dkvb = lunar_core.empty({B, T, NH, Dn + Dv}, dk:dtype(), dk:device())
    dkvb:narrow(4, 1, Dn):copy_(dk:narrow(4, 1, Dn))
    dkvb:narrow(4, Dn + 1, Dv):copy_(dv)
    local dkrot = ops.sum(dk:narrow(4, Dn + 1, Dr), 3)                 -- (B, T, Dr)
    local dk_lat = self.kv_b_proj:backward(dkvb:view({N, NH * (Dn + Dv)}), saved.kvb)
    local dckv = lunar_core.empty({N, Rkv + Dr}, dk_lat:dtype(), dk_lat:device())
    dckv:narrow(2, 1, Rkv):copy_(self.kv_a_layernorm:backward(dk_lat, saved.kvn))
    ops.rope_backward(dkrot:view({B, T, 1, Dr}), batch.positions, batch.inv_freq,
        {layout = 'interleaved_to_half', scale = batch.rope_scale or 1, out = dckv:narrow(2, Rkv + 1, Dr):view({B, T, 1, Dr})})
    local dx = self.kv_a_proj:backward(dckv, saved.kva, need_dx)
    -- q: [dq_nope | RoPE^-1(dq_rot)] -> q_b_proj -> q_a_layernorm -> q_a_proj
    local dq4 = lunar_core.empty({B, T, NH, Dqk}, dq:dtype(), dq:device())
    dq4:narrow(4, 1, Dn):copy_(dq:narrow(4, 1, Dn))
    ops.rope_backward(dq:narrow(4, Dn + 1, Dr), batch.positions, batch.inv_freq,
        {layout = 'interleaved_to_half', scale = batch.rope_scale or 1, out = dq4:narrow(4, Dn + 1, Dr)})
    local dq_resid = self.q_b_proj:backward(dq4:view({N, NH * Dqk}), saved.qb)
    local dqa = self.q_a_layernorm:backward(dq_resid, saved.qn)
    local dx2 = self.q_a_proj:backward(dqa, saved.qa, need_dx)
    if need_dx == false then return nil, indexer_loss end
    -- tensor parallel: this rank's heads' share of dx (the whole sub-modules before the heads ran
    -- on this rank's share of their output gradient; their parameter gradients are reduced once a
    -- step, model:reduce_tp_grads)
    return self.input:backward(ops.add_(dx, dx2)), indexer_loss
end

return MLA
