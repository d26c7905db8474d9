-- lunar.nn.NopeMLA: the DSA layer of GLM-5.3-Flash (HF's Glm5NextTextAttention): multi-head
-- latent attention without rotary dims, over the keys its k-pool indexer selects
-- (lunar.nn.KPool) on "full" layers, or over the previous full layer's selection on "shared"
-- ones. The differences from GLM-5's lunar.nn.MLA: no RoPE (q is all nope, kv_a gives the latent
-- only), the q_a / kv_a norms use rms_norm_eps, scaling = qk_nope_head_dim^-0.5, and the keys a
-- query attends are exactly its selection (no causal mask on top: the selection is causal).
--
-- Weights under `name` (".../self_attn"): q_a_proj (Rq, H) [+bias], q_a_layernorm (Rq),
-- q_b_proj (NH*Dn, Rq), kv_a_proj_with_mqa (Rkv, H) [+bias], kv_a_layernorm (Rkv), kv_b_proj
-- (NH*(Dn+Dv), Rkv), o_proj (H, NH*Dv) [+bias]; indexer.* on full layers.
--
--   out, saved, keys = attn:forward(x, b, prev_keys)
--       x (N, H) = input_layernorm output, N = b.B * b.T; b as lunar.nn.KPool reads it. 'full':
--       keys = the indexer's (B, T, W) selection; 'shared': prev_keys, returned again.
--       With b.for_cache (generation's prefill) saved also keeps what the cache stores: k_lat (N,
--       Rkv) the normed latents, and on full layers index, the indexer's keys (lunar.nn.KPool).
--   dx = attn:backward(dout, saved)   parameter gradients accumulate (+=), none for the indexer.
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local ops = require 'lunar.ops'
local Linear = require 'lunar.nn.linear'
local RMSNorm = require 'lunar.nn.rmsnorm'
local attention = require 'lunar.nn.attention'
local KPool = require 'lunar.nn.kpool'
local context = require 'lunar.parallel.context'

local NopeMLA = {}
NopeMLA.__index = NopeMLA

-- opts.par (lunar.parallel.context): under tensor parallel this rank's heads (q_b_proj and
-- kv_b_proj by heads, o_proj by their columns) and the mappings that reduce the partial sums; the
-- low-rank projections, their norms and the indexer stay whole (every rank selects the same keys)
function NopeMLA.new(store, name, cfg, opts)
    opts = opts or {}
    local bias = cfg.attention_bias and true or false
    local par = opts.par or context.NONE
    local io = par:block('attention')
    local self = setmetatable({
        store = store, name = name, par = par, input = io.input, output = io.output,
        H = cfg.hidden_size, NH = par:heads(cfg, 'num_attention_heads', 'NopeMLA ' .. name),
        Rq = cfg.q_lora_rank, Rkv = cfg.kv_lora_rank, Dn = cfg.qk_nope_head_dim, Dv = cfg.v_head_dim,
        scaling = cfg.qk_nope_head_dim ^ -0.5,
        q_a_proj = Linear.new(store, name .. '.q_a_proj', {bias = bias}),
        q_a_layernorm = RMSNorm.new(store, name .. '.q_a_layernorm', cfg.rms_norm_eps),
        q_b_proj = Linear.new(store, name .. '.q_b_proj'),
        kv_a_proj = Linear.new(store, name .. '.kv_a_proj_with_mqa', {bias = bias}),
        kv_a_layernorm = RMSNorm.new(store, name .. '.kv_a_layernorm', cfg.rms_norm_eps),
        kv_b_proj = Linear.new(store, name .. '.kv_b_proj'),
        o_proj = Linear.new(store, name .. '.o_proj', {bias = bias}),
        indexer_type = opts.indexer or 'full',
    }, NopeMLA)
    if self.indexer_type == 'full' then self.indexer = KPool.new(store, name .. '.indexer', cfg)
    elseif self.indexer_type ~= 'shared' then
        tensor.fail(('NopeMLA %s: indexer must be full or shared, got %s'):format(name, tostring(self.indexer_type)))
    end
    return self
end

-- tensor parallel: the whole parameters whose gradients cover this rank's heads only: those of
-- GLM-5's MLA, whose module names this one shares (q_a, kv_a and their norms)
NopeMLA.tp_partial = require('lunar.nn.mla').tp_partial

function NopeMLA:forward(x, b, prev_keys)
    local B, T, NH, Dn, Dv = b.B, b.T, self.NH, self.Dn, self.Dv
    local N = B * T
    local sv = {}
    x = self.input:forward(x)
    local qa
    qa, sv.qa = self.q_a_proj:forward(x)
    local q_resid
    q_resid, sv.qn = self.q_a_layernorm:forward(qa)
    local q
    q, sv.qb = self.q_b_proj:forward(q_resid)
    local kva
    kva, sv.kva = self.kv_a_proj:forward(x)
    local k_lat
    k_lat, sv.kvn = self.kv_a_layernorm:forward(kva)
    local kvb
    kvb, sv.kvb = self.kv_b_proj:forward(k_lat)
    local kvb4 = kvb:view(B, T, NH, Dn + Dv)
    local key = kvb4:narrow(4, 1, Dn):contiguous()
    local v = kvb4:narrow(4, Dn + 1, Dv):contiguous()
    local keys
    if self.indexer then
        keys, sv.index = self.indexer:select(x, q_resid, b)
    else
        if prev_keys == nil then
            tensor.fail(('NopeMLA %s: a shared DSA layer needs the selection of the full DSA layer before it'):format(self.name))
        end
        keys = prev_keys
    end
    local o
    o, sv.att = attention.forward_tokens(q:view(B, T, NH, Dn), key, v, nil, self.scaling, {keys = keys})
    local out
    out, sv.o = self.o_proj:forward(o:contiguous():view(N, NH * Dv))
    sv.B, sv.T = B, T
    if b.for_cache then sv.k_lat = k_lat end
    return self.output:forward(out), sv, keys   -- (tensor parallel: the heads' partial sums reduced)
end

function NopeMLA:backward(dout, sv)
    local B, T, NH, Dn, Dv = sv.B, sv.T, self.NH, self.Dn, self.Dv
    local N = B * T
    local dof = self.o_proj:backward(self.output:backward(dout), sv.o)
    local dq, dk, dv = attention.backward_tokens(dof:view(B, T, NH, Dv), sv.att)
    local dkvb = core.empty({B, T, NH, Dn + Dv}, dk:dtype(), dk:device())
    dkvb:narrow(4, 1, Dn):copy_(dk)
    dkvb:narrow(4, Dn + 1, Dv):copy_(dv)
    local dk_lat = self.kv_b_proj:backward(dkvb:view(N, NH * (Dn + Dv)), sv.kvb)
    local dx = self.kv_a_proj:backward(self.kv_a_layernorm:backward(dk_lat, sv.kvn), sv.kva)
    local dq_resid = self.q_b_proj:backward(dq:contiguous():view(N, NH * Dn), sv.qb)
    local dx2 = self.q_a_proj:backward(self.q_a_layernorm:backward(dq_resid, sv.qn), sv.qa)
    return self.input:backward(ops.add_(dx, dx2))
end

return NopeMLA
