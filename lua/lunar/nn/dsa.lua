-- lunar.nn.DSA: the DeepSeek-sparse-attention lightning indexer of one "full" GLM-5 layer
-- (glm5-architecture.md section 6, V-latest = state E of section 11).
--
-- Weights under `name` (".../self_attn.indexer"): wq_b (Hi*Di, Rq), wk (Di, H), k_norm.weight and
-- k_norm.bias (Di; LayerNorm eps 1e-6), weights_proj (Hi, H). No biases on the linears.
--
--   idx = DSA.new(store, name, cfg)        cfg: HF config fields hidden_size, q_lora_rank,
--                                           index_n_heads, index_head_dim, qk_rope_head_dim, index_topk
--   topk, saved = idx:forward(x, q_resid, batch, {keep = false})
--       x (N, H) the layer's normed input, q_resid (N, Rq) = q_a_layernorm(q_a_proj(x)),
--       N = B*T tokens; batch = {B, T, positions (B, T), mask (B, T, T), inv_freq (Dr/2)[, rope_scale]}.
--       qi = RoPE_b(wq_b(q_resid)) per head, ki = RoPE_b(LN(wk(x))), RoPE on the FIRST Dr dims
--       (layout [rope | pass], 'interleaved_to_half'); A[b,s,h,t] = ReLU(qi.ki * Di^-0.5);
--       w = weights_proj(x) * Hi^-0.5 (f32, may be negative); I[b,s,t] = sum_h w*A, then
--       I + mask; topk over keys with k = min(index_topk, T) -> (B, T, k) i64 0-based.
--       saved.scores is I + mask (B, T, T) f32. keep = true keeps what the KL loss needs (and
--       computes I with gemms); otherwise the fused lunar.ops.index_scores computes the scores
--       and the top-k without the masked keys' products (scores = false: the top-k only).
--   The indexer never gets a gradient from the LM loss (HF runs it under no_grad), and nothing
--   flows from it into x or q_resid.
--   Tensor parallel with split_indexer (DSA.new's opts.par, a lunar.parallel.context): this
--   rank's Hi / tp heads (wq_b and weights_proj by rows; the head weights keep the whole
--   Hi^-0.5); each rank's scores are its heads' part of I, all-reduced over tp before the top-k,
--   so every rank selects the same keys (the context's indexer selection). Not with the KL loss.
--
--   Optional indexer KL loss (Megatron-LM's DSA indexer loss, off unless the model passes a
--   coefficient > 0; docs/model.md):
--   loss = idx:kl_loss(saved, p, student_mask, valid, coeff)
--       p (B, T, T) the detached target distribution over keys per query, student_mask (B, T, T)
--       additive, valid (B, T) 1/0. q_hat = softmax(I + student_mask) in f32,
--         loss = coeff * sum_{b,s} valid[b,s] / n_valid * sum_t p (log(p + 1e-10) - log(q_hat + 1e-10))
--       (n_valid = number of valid queries). Returns the loss as a number and keeps dL/dI in
--       saved (the gradient of log(q_hat + 1e-10) exactly, as autograd gives it).
--   idx:backward(saved)
--       accumulates (+=) the KL-loss gradient into wq_b, wk, k_norm and weights_proj only
--       (inputs are detached). No-op when kl_loss was not called.
--   DSA.target(P) -> p: the head-summed, L1-normalised target from per-head probabilities
--       P (B, NH, T, T).
local lunar_core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local ops = require 'lunar.ops'
local Linear = require 'lunar.nn.linear'
local context = require 'lunar.parallel.context'

local DSA = {}
DSA.__index = DSA

local function need(cfg, key, who)
    local v = cfg[key]
    if type(v) ~= 'number' then tensor.fail(('%s: config field %s must be a number, got %s'):format(who, key, tostring(v))) end
    return v
end

function DSA.new(store, name, cfg, opts)
    local who = 'DSA ' .. name
    local Hi = need(cfg, 'index_n_heads', who)
    -- how the top-k is taken: over this rank's heads' scores summed over tp, or all heads here
    local select = (opts and opts.par or context.NONE):indexer(cfg, who)
    local self = setmetatable({
        store = store, name = name, select = select,
        head_scale = Hi ^ -0.5,   -- the whole indexer's, on every rank's heads
        H = need(cfg, 'hidden_size', who), Rq = need(cfg, 'q_lora_rank', who),
        Hi = select.heads, Di = need(cfg, 'index_head_dim', who),
        Dr = need(cfg, 'qk_rope_head_dim', who), topk = need(cfg, 'index_topk', who),
        wq_b = Linear.new(store, name .. '.wq_b'),
        wk = Linear.new(store, name .. '.wk'),
        weights_proj = Linear.new(store, name .. '.weights_proj'),
        knw = name .. '.k_norm.weight', knb = name .. '.k_norm.bias',
        eps = 1e-6,
    }, DSA)
    if self.Dr > self.Di then tensor.fail(('%s: qk_rope_head_dim %d exceeds index_head_dim %d'):format(who, self.Dr, self.Di)) end
    return self
end

local function rope_opts(batch) return {layout = 'interleaved_to_half', scale = batch.rope_scale or 1} end

function DSA:forward(x, q_resid, batch, opts)
    opts = opts or {}
    local B, T = batch.B, batch.T
    local Hi, Di = self.Hi, self.Di
    if batch.inv_freq:numel() * 2 ~= self.Dr then
        tensor.fail(('DSA %s: inv_freq has %d entries, expected qk_rope_head_dim/2 = %d'):format(
            self.name, batch.inv_freq:numel(), self.Dr / 2))
    end
    -- queries (B, T, Hi, Di) and keys (B, T, 1, Di), rope on the first Dr dims
    local qi, sq = self.wq_b:forward(q_resid)
    local qr = ops.rope(qi:view({B, T, Hi, Di}), batch.positions, batch.inv_freq, rope_opts(batch))
    local kpre, sk = self.wk:forward(x)
    local kn, mean, rstd = ops.layernorm(kpre, self.store:get(self.knw), self.store:get(self.knb), self.eps)
    local kr = ops.rope(kn:view({B, T, 1, Di}), batch.positions, batch.inv_freq, rope_opts(batch))
    -- head weights in f32 (HF keeps weights_proj in f32)
    local wts, sw = self.weights_proj:forward(x)
    if wts:dtype() ~= 'f32' then wts = wts:to('f32') end
    ops.mul_(wts, self.head_scale)
    local k = math.min(self.topk, T)
    -- (whole heads: I + mask and its top-k in one fused op, masked keys never computed; nothing
    -- under the KL loss, which needs the per-head scores below)
    local scores, topk = self.select:select(qr, kr:view({B, T, Di}), wts:view({B, T, Hi}), batch.mask, Di ^ -0.5, k,
        {keep = opts.keep, scores = opts.scores, name = self.name})
    if topk then return topk, {scores = scores, k = k} end
    -- per-head scores A = ReLU(qi . ki * Di^-0.5): (B, T*Hi, Di) x (B, T, Di)^T -> (B*T, Hi, T)
    local A = lunar_core.empty({B * T, Hi, T}, 'f32', x:device())
    ops.gemm(qr:view({B, T * Hi, Di}), kr:view({B, T, Di}),
        {trans_b = true, alpha = Di ^ -0.5, out = A:view({B, T * Hi, T})})
    ops.relu(A, {out = A})
    -- I[b, s, t] = sum_h w[b, s, h] A[b, s, h, t]: (B*T, 1, Hi) x (B*T, Hi, T)
    local I = lunar_core.empty({B, T, T}, 'f32', x:device())
    ops.gemm(wts:view({B * T, 1, Hi}), A, {out = I:view({B * T, 1, T})})
    local scores = batch.mask and ops.add(I, batch.mask) or I
    local _, topk = ops.topk(scores, k)
    local saved = {scores = scores, k = k}
    saved.I, saved.A, saved.qr, saved.kr, saved.wts = I, A, qr, kr, wts
    saved.sq, saved.sk, saved.sw = sq, sk, sw
    saved.kpre, saved.mean, saved.rstd = kpre, mean, rstd
    saved.batch = batch
    return topk, saved
end

function DSA.target(P)
    local p = ops.sum(P, 2)
    return ops.div_(p, ops.sum(p, 3, {keepdim = true}))
end

local EPS = 1e-10

function DSA:kl_loss(saved, p, student_mask, valid, coeff)
    if not saved.I then tensor.fail(('DSA %s: kl_loss needs forward(..., {keep = true})'):format(self.name)) end
    local logits = student_mask and ops.add(saved.I, student_mask) or saved.I
    local qh = ops.softmax(logits)
    -- two scalars read back per layer (the valid-row count and the loss value): only when the
    -- indexer loss is on
    local nvalid = ops.sum(valid):item()
    local wrow = ops.div(valid, math.max(nvalid, 1)):unsqueeze(3)        -- (B, T, 1)
    local qe = ops.add(qh, EPS)
    local kl = ops.mul(p, ops.sub(ops.log(ops.add(p, EPS)), ops.log(qe)))
    local loss = coeff * ops.sum(ops.mul(kl, wrow)):item()
    -- d loss / d q_hat = -coeff * wrow * p / (q_hat + 1e-10), then through the softmax
    local g = ops.mul(ops.div(p, qe), ops.mul(wrow, -coeff))
    saved.dI = ops.softmax_backward(g, qh)
    return loss
end

function DSA:backward(saved)
    local dI = saved.dI
    if not dI then return end
    local batch = saved.batch
    local B, T, Hi, Di = batch.B, batch.T, self.Hi, self.Di
    -- head weights: dw[b, s, h] = sum_t dI[b, s, t] A[b, s, h, t]; w = weights_proj(x) * Hi^-0.5
    local dw = ops.gemm(dI:view({B * T, 1, T}), saved.A, {trans_b = true, alpha = self.head_scale})
    self.weights_proj:backward(dw:view({B * T, Hi}), saved.sw, false)
    -- dA = w dI, through the ReLU (relu'(0) = 0: A = 0 exactly where the score was <= 0)
    local dA = ops.mul(saved.wts:view({B * T, Hi, 1}), dI:view({B * T, 1, T}))
    local dZ = ops.relu_backward(dA, saved.A)
    dA:free()
    local dqr = ops.gemm(dZ:view({B, T * Hi, T}), saved.kr:view({B, T, Di}), {alpha = Di ^ -0.5})
    local dkr = ops.gemm(dZ:view({B, T * Hi, T}), saved.qr:view({B, T * Hi, Di}), {trans_a = true, alpha = Di ^ -0.5})
    dZ:free()
    local dqi = ops.rope_backward(dqr:view({B, T, Hi, Di}), batch.positions, batch.inv_freq, rope_opts(batch))
    self.wq_b:backward(dqi:view({B * T, Hi * Di}), saved.sq, false)
    local dkn = ops.rope_backward(dkr:view({B, T, 1, Di}), batch.positions, batch.inv_freq, rope_opts(batch))
    dkn = dkn:view({B * T, Di})
    local gw, gb = self.store:grad(self.knw), self.store:grad(self.knb)
    if gw or gb then ops.layernorm_backward_params(gw, gb, dkn, saved.kpre, saved.mean, saved.rstd) end
    if self.store:grad(self.wk.wname) then
        local dkpre = ops.layernorm_backward(dkn, saved.kpre, self.store:get(self.knw), saved.mean, saved.rstd)
        self.wk:backward(dkpre, saved.sk, false)
    end
    saved.dI = nil
end

return DSA
