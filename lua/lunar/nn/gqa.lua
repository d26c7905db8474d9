-- lunar.nn.GQA: Glm4Moe attention (GLM-4.5 / 4.6 / 4.7; glm5-architecture.md section 14.2).
--
-- Weights under `name` (".../self_attn"): q_proj (NH*hd, H), k_proj (nkv*hd, H), v_proj
-- (nkv*hd, H), each with a bias when cfg.attention_bias; o_proj (H, NH*hd) never has one;
-- q_norm, k_norm (hd) when cfg.use_qk_norm (RMSNorm with rms_norm_eps, per head, before RoPE).
--
--   attn = GQA.new(store, name, cfg[, {par = ctx}])   -- ctx (lunar.parallel.context): under tensor
--       parallel this rank's heads (q/k/v column parallel, o_proj row parallel) and the mappings
--       that reduce its partial sums
--       cfg: HF fields hidden_size, num_attention_heads, num_key_value_heads, head_dim (default
--       hidden_size / num_attention_heads), partial_rotary_factor (or rope_parameters.
--       partial_rotary_factor; default 0.5), attention_bias, use_qk_norm, rms_norm_eps (1e-5).
--       attn.rot_dim = floor(head_dim * partial_rotary_factor); attn.scaling = head_dim^-0.5.
--   out, saved = attn:forward(x, batch)
--       x (N, H), N = B*T; batch = {B =, T =, positions = (B, T), mask = (B, T, T) additive,
--       inv_freq = (rot_dim/2)[, rope_scale = 1]}. Half-split RoPE ('half') on the first rot_dim
--       dims of every q and k head, the rest passes through. Each KV head serves NH/nkv
--       consecutive query heads (repeat_kv), done by grouped batched products without copies.
--   dx = attn:backward(dout, saved, need_dx)
--       parameter gradients accumulate (+=); dk, dv are summed over each KV head's query group.
local lunar_core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local ops = require 'lunar.ops'
local context = require 'lunar.parallel.context'
local Linear = require 'lunar.nn.linear'
local RMSNorm = require 'lunar.nn.rmsnorm'
local attention = require 'lunar.nn.attention'

local GQA = {}
GQA.__index = GQA

local function need(cfg, key, who)
    local v = cfg[key]
    if type(v) ~= 'number' then tensor.fail(('%s: config field %s must be a number, got %s'):format(who, key, tostring(v))) end
    return v
end

function GQA.new(store, name, cfg, opts)
    local who = 'GQA ' .. name
    local par = opts and opts.par or context.NONE
    local H, NH = need(cfg, 'hidden_size', who), need(cfg, 'num_attention_heads', who)
    local nkv = cfg.num_key_value_heads or NH
    local hd = cfg.head_dim or H / NH
    -- tensor parallel: this rank's heads (q/k/v column parallel, o_proj row parallel)
    NH = par:heads(cfg, 'num_attention_heads', who)
    nkv = par:heads({num_key_value_heads = nkv}, 'num_key_value_heads', who)
    local prf = cfg.partial_rotary_factor
    if prf == nil and type(cfg.rope_parameters) == 'table' then prf = cfg.rope_parameters.partial_rotary_factor end
    prf = prf or 0.5
    if NH % nkv ~= 0 then tensor.fail(('%s: num_key_value_heads %d does not divide num_attention_heads %d'):format(who, nkv, NH)) end
    if hd ~= math.floor(hd) then tensor.fail(('%s: head_dim %s is not an integer'):format(who, tostring(hd))) end
    local rot = math.floor(hd * prf)
    if rot % 2 ~= 0 or rot < 2 or rot > hd then
        tensor.fail(('%s: rotary dim %d (head_dim %d * partial_rotary_factor %g) must be even and in [2, head_dim]'):format(who, rot, hd, prf))
    end
    local bias = cfg.attention_bias and true or false
    local eps = cfg.rms_norm_eps or 1e-5
    local self = setmetatable({
        store = store, name = name, H = H, NH = NH, nkv = nkv, hd = hd, rot_dim = rot, scaling = hd ^ -0.5, par = par,
        -- the heads' partial sums all-reduced here (or by the decoder layer, sequence parallel)
        input = par:block('attention').input, output = par:block('attention').output,
        q_proj = Linear.new(store, name .. '.q_proj', {bias = bias}),
        k_proj = Linear.new(store, name .. '.k_proj', {bias = bias}),
        v_proj = Linear.new(store, name .. '.v_proj', {bias = bias}),
        o_proj = Linear.new(store, name .. '.o_proj'),
    }, GQA)
    if cfg.use_qk_norm then
        self.q_norm = RMSNorm.new(store, name .. '.q_norm', eps)
        self.k_norm = RMSNorm.new(store, name .. '.k_norm', eps)
    end
    return self
end

-- tensor parallel: the whole parameters whose gradients cover this rank's heads only
function GQA:tp_partial()
    local out = {}
    if self.q_norm then out[#out + 1] = self.name .. '.q_norm.weight' end
    if self.k_norm then out[#out + 1] = self.name .. '.k_norm.weight' end
    return self.par:partial(out)
end

local function rope_opts(batch) return {layout = 'half', scale = batch.rope_scale or 1} end

-- (N, heads*hd) projection -> optional per-head RMSNorm -> RoPE -> (B, T, heads, hd) contiguous
function GQA:qk_forward(y, heads, norm, batch)
    local B, T, hd = batch.B, batch.T, self.hd
    local ns
    if norm then y, ns = norm:forward(y:view({B * T * heads, hd})) end
    local r = ops.rope(y:view({B, T, heads, hd}), batch.positions, batch.inv_freq, rope_opts(batch))
    return r, ns
end

function GQA:qk_backward(dh, norm, ns, batch)
    local B, T, hd = batch.B, batch.T, self.hd
    local heads = dh:size(3)
    local d = ops.rope_backward(dh, batch.positions, batch.inv_freq, rope_opts(batch))
    d = d:view({B * T * heads, hd})
    if norm then d = norm:backward(d, ns) end
    return d:view({B * T, heads * hd})
end

function GQA:forward(x, batch)
    local B, T, NH, nkv, hd = batch.B, batch.T, self.NH, self.nkv, self.hd
    local N = B * T
    if x:dim() ~= 2 or x:size(1) ~= N or x:size(2) ~= self.H then
        tensor.fail(('GQA %s: x must be (B*T, H) = (%d, %d), got (%s)'):format(self.name, N, self.H, table.concat(x:size(), ', ')))
    end
    if batch.inv_freq:numel() * 2 ~= self.rot_dim then
        tensor.fail(('GQA %s: inv_freq has %d entries, expected rot_dim/2 = %d'):format(
            self.name, batch.inv_freq:numel(), self.rot_dim / 2))
    end
    x = self.input:forward(x)
    local saved = {batch = batch}
    local q, k, v
    q, saved.q = self.q_proj:forward(x)
    k, saved.k = self.k_proj:forward(x)
    v, saved.v = self.v_proj:forward(x)
    local qh, kh
    qh, saved.qn = self:qk_forward(q, NH, self.q_norm, batch)
    kh, saved.kn = self:qk_forward(k, nkv, self.k_norm, batch)
    local o
    -- exact key lists make the mask redundant (its visible entries add 0): the attention skips it
    o, saved.att = attention.forward_tokens(qh, kh, v:view({B, T, nkv, hd}),
        not batch.key_lists_exact and batch.mask or nil, self.scaling, {keys = batch.key_lists})
    local out
    out, saved.o = self.o_proj:forward(o:view({N, NH * hd}))
    return self.output:forward(out), saved   -- the heads' partial sums
end

function GQA:backward(dout, saved, need_dx)
    local batch = saved.batch
    local B, T, NH, nkv, hd = batch.B, batch.T, self.NH, self.nkv, self.hd
    local N = B * T
    local dof = self.o_proj:backward(self.output:backward(dout), saved.o)
    local dqh, dkh, dv = attention.backward_tokens(dof:view({B, T, NH, hd}), saved.att)
    local dq = self:qk_backward(dqh, self.q_norm, saved.qn, batch)
    local dk = self:qk_backward(dkh, self.k_norm, saved.kn, batch)
    local dx = self.q_proj:backward(dq, saved.q, need_dx)
    local dx2 = self.k_proj:backward(dk, saved.k, need_dx)
    local dx3 = self.v_proj:backward(dv:view({N, nkv * hd}), saved.v, need_dx)
    if need_dx == false then return nil end
    return self.input:backward(ops.add_(ops.add_(dx, dx2), dx3))
end

return GQA
