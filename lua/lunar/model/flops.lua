-- lunar.model.flops: model FLOPs per token of GLM-5 (glm_moe_dsa), GLM-4.5/4.6/4.7 (glm4_moe) and
-- GLM-5.3-Flash (glm5_next: KDA, NoPE MLA over k-pool DSA, mHC), for tokens/s -> TFLOP/s and MFU
-- (docs/training.md writes the formula down; docs/flash.md Flash's).
--
--   local flops = require 'lunar.model.flops'
--   local f = flops.forward_per_token(cfg, 4096)          -- cfg: lunar.model.config (or a raw table)
--   f.total, f.parts.attn_proj, f.parts.attn_core, ...    -- FLOPs of one token's forward
--   flops.training_per_token(cfg, 4096, {mtp = 1})        -- 3 x forward: forward + backward
--
-- seq: the sequence length T, or a list of document lengths packed into one row (attention
-- does not cross documents; the result is the mean over all tokens). opts.mtp: the number of
-- MTP depths that run (default 0: HF's forward has none; GLM-5 trains with 1).
--
-- Counted: every matrix product, 2 FLOPs per multiply-add (y = x W^T with W (out, in) is
-- 2·in·out per token), attention over the keys each query actually attends (causal, and with
-- DSA at most index_topk of them), the DSA indexer's projections and its scores over all causal
-- keys, the router, the K routed and the shared experts, dense MLPs and lm_head. Not counted:
-- norms, RoPE, softmax, activations, top-k, the embedding lookup (O(H) per token each).
local M = {}

-- mean over the T queries of one causal document of min(s, k), s = 1..T visible keys
local function mean_keys(T, k)
    if not k or T <= k then return (T + 1) / 2 end
    return (k * (k + 1) / 2 + (T - k) * k) / T
end
M.mean_keys = mean_keys

-- the token-weighted mean of mean_keys over the documents of seq
local function mean_keys_seq(seq, k)
    if type(seq) == 'number' then return mean_keys(seq, k) end
    local keys, tokens = 0, 0
    for _, T in ipairs(seq) do
        keys = keys + T * mean_keys(T, k)
        tokens = tokens + T
    end
    return keys / tokens
end

local function check_seq(seq)
    local function ok(T) return type(T) == 'number' and T >= 1 and T == math.floor(T) end
    if type(seq) == 'table' then
        if #seq == 0 then error('flops: the list of document lengths is empty', 3) end
        for i, T in ipairs(seq) do
            if not ok(T) then error(('flops: document length %d is %s, not a positive integer'):format(i, tostring(T)), 3) end
        end
    elseif not ok(seq) then
        error(('flops: the sequence length must be a positive integer or a list of them, got %s'):format(tostring(seq)), 3)
    end
end

local function validated(cfg)
    if type(cfg) ~= 'table' then error('flops: expected a model config table', 3) end
    if cfg.raw and cfg.model_type and cfg.mlp_layer_types then return cfg end   -- already lunar.model.config's
    return require('lunar.model.config').from_table(cfg, 'flops config')
end

-- attention of one layer: projections (per token) and the core (per attended key)
local function attention(cfg, keys, idx_keys, has_indexer)
    local H, NH = cfg.hidden_size, cfg.num_attention_heads
    local p = {}
    if cfg.model_type == 'glm_moe_dsa' then
        local Rq, Rkv = cfg.q_lora_rank, cfg.kv_lora_rank
        local Dn, Dr, Dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        local Dqk = Dn + Dr
        p.attn_proj = 2 * (H * Rq + Rq * NH * Dqk + H * (Rkv + Dr) + Rkv * NH * (Dn + Dv) + NH * Dv * H)
        p.attn_core = 2 * NH * (Dqk + Dv) * keys          -- q·k over Dqk, p·v over Dv
        if has_indexer then
            local Hi, Di = cfg.index_n_heads, cfg.index_head_dim
            -- wq_b (from q_resid), wk, weights_proj; then per causal key Hi dot products of Di
            -- and the weighted sum over the Hi heads
            p.indexer = 2 * (Rq * Hi * Di + H * Di + H * Hi) + (2 * Hi * Di + 2 * Hi) * idx_keys
        end
    else
        local hd, nkv = cfg.head_dim, cfg.num_key_value_heads
        p.attn_proj = 2 * (H * NH * hd + 2 * H * nkv * hd + NH * hd * H)
        p.attn_core = 2 * NH * 2 * hd * keys
    end
    return p
end

local function add(into, p, scale)
    for k, v in pairs(p) do into[k] = (into[k] or 0) + v * (scale or 1) end
end

-- GLM-5.3-Flash (glm5_next) ------------------------------------------------------------------

-- per query of one causal document of T tokens, the mean of (the keys a k-pool DSA query attends,
-- the complete pools it scores): with n visible tokens, c = floor(n / kp) complete pools and
-- r = n mod kp, it attends kp min(floor(topk / kp), c) pool tokens plus the r newest (the tail)
local function kpool_means(seq, kp, topk, tail)
    local docs = type(seq) == 'number' and {seq} or seq
    local keys, pools, tokens = 0, 0, 0
    local P = math.floor(topk / kp)
    for _, T in ipairs(docs) do
        for n = 1, T do
            local c, r = math.floor(n / kp), n % kp
            keys = keys + kp * math.min(P, c) + (tail and r or 0)
            pools = pools + c
        end
        tokens = tokens + T
    end
    return keys / tokens, pools / tokens
end
M.kpool_means = kpool_means

-- one KDA layer: the projections, the three depthwise short convs, and the gated delta rule as
-- its token form counts it per head (q S, S^T k and the rank-one update k u^T: 3 products of
-- Dk x Dv)
local function kda(cfg)
    local H, Hk, Dk, Kc = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim
    local Q = Hk * Dk
    return {attn_proj = 2 * (3 * H * Q + H * Dk + Dk * Q + H * Hk + H * Dk + Dk * Q + Q * H),
            short_conv = 3 * 2 * Q * Kc,
            attn_core = 3 * 2 * Hk * Dk * Dk}
end

-- one NoPE MLA layer over k-pool DSA selections (keys: attended keys per query), its own
-- indexer on full layers (pools: complete pools per query, each scored by every index head)
local function nope_mla(cfg, keys, pools, has_indexer)
    local H, NH = cfg.hidden_size, cfg.num_attention_heads
    local Rq, Rkv, Dn, Dv = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
    local q = Rq and (H * Rq + Rq * NH * Dn) or H * NH * Dn
    local p = {attn_proj = 2 * (q + H * Rkv + Rkv * NH * (Dn + Dv) + NH * Dv * H),
               attn_core = 2 * NH * (Dn + Dv) * keys}
    if has_indexer then
        local Hi, Di = cfg.index_n_heads, cfg.index_head_dim
        -- wq_b (from q_resid), wk, weights_proj, the pool gate; each token's share of its pool's
        -- gated sum; per complete visible pool Hi dot products of Di and the weighted sum
        p.indexer = 2 * ((Rq or H) * Hi * Di + H * Di + H * Hi + H * Di) + 2 * Di + (2 * Hi * Di + 2 * Hi) * pools
    end
    return p
end

-- the two mHC sites of a layer: each projects the n streams (n H) to (2 + n) n weights, reads
-- the block's input (n H) and writes its output back (comb^T X: n n H, post a: n H)
local function mhc(cfg)
    local n, H = cfg.hc_mult, cfg.hidden_size
    return {mhc = 2 * (2 * n * H * (2 + n) * n + 2 * n * H + 2 * n * n * H + 2 * n * H)}
end

local function flash_forward(cfg, seq)
    local kp = cfg.index_kpool
    local keys, pools = kpool_means(seq, kp, cfg.index_topk, cfg.index_kpool_always_select_tail ~= false and kp > 1)
    local parts, layers = {}, {}
    for i = 0, cfg.num_hidden_layers - 1 do
        local p
        if cfg.layer_types[i + 1] == 'linear_attention' then p = kda(cfg)
        else p = nope_mla(cfg, keys, pools, cfg.indexer_types[i + 1] == 'full') end
        add(p, mhc(cfg))
        add(p, M.mlp(cfg, cfg.mlp_layer_types[i + 1]))
        local sum = 0
        for _, v in pairs(p) do sum = sum + v end
        layers[i + 1] = sum
        add(parts, p)
    end
    parts.lm_head = 2 * cfg.hidden_size * cfg.vocab_size
    local total = 0
    for _, v in pairs(parts) do total = total + v end
    return {total = total, parts = parts, layers = layers, mean_keys = keys, mean_pools = pools}
end

local function mlp(cfg, kind)
    local H = cfg.hidden_size
    if kind == 'dense' then return {dense_mlp = 2 * 3 * H * cfg.intermediate_size} end
    local Im, E, K = cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    return {router = 2 * H * E, routed_experts = 2 * 3 * H * Im * K,
            shared_experts = 2 * 3 * H * Im * (cfg.n_shared_experts or 0)}
end
M.mlp = mlp


-- forward_per_token(cfg, seq, {mtp = 0}) -> {total = FLOPs, parts = {attn_proj, attn_core,
-- indexer, dense_mlp, router, routed_experts, shared_experts, lm_head, mtp}, layers = {per layer
-- totals}, mean_keys = attended keys per query, mean_indexer_keys}
function M.forward_per_token(cfg, seq, opts)
    opts = opts or {}
    cfg = validated(cfg)
    check_seq(seq)
    if cfg.model_type == 'glm5_next' then return flash_forward(cfg, seq) end
    local dsa = cfg.model_type == 'glm_moe_dsa'
    local topk = dsa and cfg.index_topk or nil
    local keys = mean_keys_seq(seq, topk)
    local idx_keys = mean_keys_seq(seq, nil)
    local parts, layers = {}, {}
    local L = cfg.num_hidden_layers
    for i = 0, L - 1 do
        local p = attention(cfg, keys, idx_keys, dsa and cfg.indexer_types[i + 1] == 'full')
        add(p, mlp(cfg, cfg.mlp_layer_types[i + 1]))
        local sum = 0
        for _, v in pairs(p) do sum = sum + v end
        layers[i + 1] = sum
        add(parts, p)
    end
    local H, V = cfg.hidden_size, cfg.vocab_size
    parts.lm_head = 2 * H * V
    local mtp = opts.mtp or 0
    if type(mtp) ~= 'number' or mtp < 0 or mtp ~= math.floor(mtp) then error('flops: opts.mtp must be a non-negative integer', 2) end
    if mtp > 0 then
        -- per depth: eh_proj (2H -> H), one decoder layer (MoE; GLM-5's runs its own indexer) and
        -- the shared lm_head
        local p = attention(cfg, keys, idx_keys, dsa)
        add(p, mlp(cfg, 'sparse'))
        local one = 2 * 2 * H * H + 2 * H * V
        for _, v in pairs(p) do one = one + v end
        parts.mtp = mtp * one
    end
    local total = 0
    for _, v in pairs(parts) do total = total + v end
    return {total = total, parts = parts, layers = layers, mean_keys = keys, mean_indexer_keys = idx_keys}
end

-- training_per_token(cfg, seq, opts) -> FLOPs per token of forward + backward (3 x forward: the
-- backward of every product computes two products of the same size, for the input and the weight)
function M.training_per_token(cfg, seq, opts)
    return 3 * M.forward_per_token(cfg, seq, opts).total
end

return M
