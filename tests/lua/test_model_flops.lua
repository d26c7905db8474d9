-- lunar.model.flops against a hand count on tiny configs (docs/training.md, "Model FLOPs"):
-- a GLM-5 config with a dense and an MoE layer, a full and a shared indexer layer, DSA top-k
-- smaller and larger than T, packed documents and MTP; and a Glm4Moe (GQA) config.
local T = require('lunar.testing').suite('model.flops')
local flops = require 'lunar.model.flops'

-- H 8, V 16, 2 layers (dense + MoE), NH 2, Rq 4, Rkv 4, Dn 2, Dr 2 (Dqk 4), Dv 2, indexer Hi 2
-- Di 4 on layer 0 only, index_topk 3, E 4, K 2, Im 3, 1 shared expert, I 5
local TINY = {architectures = {'GlmMoeDsaForCausalLM'}, vocab_size = 16, hidden_size = 8, num_hidden_layers = 2,
    num_attention_heads = 2, num_key_value_heads = 2, q_lora_rank = 4, kv_lora_rank = 4, qk_nope_head_dim = 2,
    qk_rope_head_dim = 2, v_head_dim = 2, index_n_heads = 2, index_head_dim = 4, index_topk = 3,
    n_routed_experts = 4, num_experts_per_tok = 2, moe_intermediate_size = 3, n_shared_experts = 1,
    intermediate_size = 5, mlp_layer_types = {'dense', 'sparse'}, indexer_types = {'full', 'shared'}}

-- Hand count, T = 4 (FLOPs per token, 2 per multiply-add):
--   projections per layer: 2·(q_a 8·4 + q_b 4·2·4 + kv_a 8·(4+2) + kv_b 4·2·(2+2) + o 2·2·8)
--                        = 2·(32 + 32 + 48 + 32 + 32) = 352
--   attended keys per query with top-k 3: (1 + 2 + 3 + 3) / 4 = 9/4
--   attention core per layer: 2·NH·(Dqk + Dv)·9/4 = 2·2·6·9/4 = 54
--   indexer (layer 0): 2·(wq_b 4·2·4 + wk 8·4 + weights_proj 8·2) = 160, plus per causal key
--     (mean (1+2+3+4)/4 = 2.5) 2·Hi·Di + 2·Hi = 20: 160 + 50 = 210
--   dense MLP (layer 0): 2·3·8·5 = 240
--   MoE (layer 1): router 2·8·4 = 64, routed 2·3·8·3·2 = 288, shared 2·3·8·3·1 = 144: 496
--   lm_head: 2·8·16 = 256
--   forward: 2·352 + 2·54 + 210 + 240 + 496 + 256 = 2014; training 3·2014 = 6042
T:test('GLM-5 tiny config, T = 4 > index_topk', function()
    local f = flops.forward_per_token(TINY, 4)
    local p = f.parts
    T.equal({p.attn_proj, p.attn_core, p.indexer, p.dense_mlp}, {704, 108, 210, 240}, 'attention and dense parts')
    T.equal({p.router, p.routed_experts, p.shared_experts, p.lm_head}, {64, 288, 144, 256}, 'MoE and lm_head')
    T.equal(p.mtp == nil and 1 or 0, 1, 'no MTP by default')
    T.equal(f.total, 2014, 'forward')
    T.equal(f.layers, {352 + 54 + 210 + 240, 352 + 54 + 496}, 'per layer')
    T.equal(f.mean_keys, 9 / 4, 'attended keys')
    T.equal(flops.training_per_token(TINY, 4), 6042, 'training')
end)

-- T = 2 <= index_topk: every causal key, (1 + 2)/2 = 1.5: core 2·2·6·1.5 = 36 per layer,
-- indexer 160 + 20·1.5 = 190; forward 704 + 72 + 190 + 240 + 496 + 256 = 1958
T:test('T <= index_topk: plain causal attention', function()
    T.equal(flops.forward_per_token(TINY, 2).total, 1958, 'forward')
end)

-- packed documents {4, 2}: token-weighted keys (4·9/4 + 2·1.5)/6 = 2 -> core 2·24 = 48 per layer;
-- indexer keys (4·2.5 + 2·1.5)/6 = 13/6 -> 160 + 20·13/6; forward 704 + 96 + 160 + 130/3 + 240 +
-- 496 + 256
T:test('packed documents: attention does not cross documents', function()
    local f = flops.forward_per_token(TINY, {4, 2})
    T.close(f.total, 704 + 96 + 160 + 130 / 3 + 240 + 496 + 256, {rtol = 1e-15, atol = 0})
    T.equal(f.parts.attn_core, 96, 'core')
end)

-- MTP depth 1, T = 4: eh_proj 2·16·8 = 256, an MoE layer with its own indexer 352 + 54 + 210 +
-- 496 = 1112, lm_head 256: 1624; forward 2014 + 1624 = 3638
T:test('MTP adds eh_proj, one MoE layer with an indexer, and lm_head', function()
    local f = flops.forward_per_token(TINY, 4, {mtp = 1})
    T.equal({f.parts.mtp, f.total}, {1624, 3638}, 'mtp')
    T.equal(flops.training_per_token(TINY, 4, {mtp = 1}), 3 * 3638, 'training')
end)

-- Glm4Moe: H 8, NH 2, nkv 1, head_dim 4, V 16, 1 MoE layer (E 4, K 2, Im 3, shared 1), T 3:
--   projections 2·(q 8·2·4 + k,v 2·8·1·4 + o 2·4·8) = 2·(64 + 64 + 64) = 384
--   core 2·NH·2·hd·(1+2+3)/3 = 2·2·8·2 = 64; MoE 496; lm_head 256: 1200
T:test('Glm4Moe (GQA) tiny config', function()
    local cfg = {architectures = {'Glm4MoeForCausalLM'}, vocab_size = 16, hidden_size = 8, num_hidden_layers = 1,
        num_attention_heads = 2, num_key_value_heads = 1, head_dim = 4, n_routed_experts = 4, num_experts_per_tok = 2,
        moe_intermediate_size = 3, n_shared_experts = 1, intermediate_size = 5, first_k_dense_replace = 0}
    local f = flops.forward_per_token(cfg, 3)
    T.equal({f.parts.attn_proj, f.parts.attn_core, f.parts.indexer == nil and 0 or 1, f.total}, {384, 64, 0, 1200}, 'glm4_moe')
end)

-- The real GLM-5.2 sizes: Megatron-Bridge's verification card implies 2.86e11 (2048) and 3.39e11
-- (200K) FLOP/token (performance.md 2.4) with MTP1; lunar's count is within 10 % of both.
T:test('GLM-5.2 sizes against the FLOP/token Megatron implies', function()
    local cfg = {architectures = {'GlmMoeDsaForCausalLM'}, vocab_size = 154880, hidden_size = 6144,
        num_hidden_layers = 78, num_attention_heads = 64, num_key_value_heads = 64, q_lora_rank = 2048,
        kv_lora_rank = 512, qk_nope_head_dim = 192, qk_rope_head_dim = 64, v_head_dim = 256, intermediate_size = 12288,
        moe_intermediate_size = 2048, n_routed_experts = 256, num_experts_per_tok = 8, n_shared_experts = 1,
        first_k_dense_replace = 3, index_topk = 2048, index_head_dim = 128, index_n_heads = 32, index_topk_freq = 4,
        index_skip_topk_offset = 3}
    for _, c in ipairs({{2048, 2.86e11}, {200000, 3.39e11}}) do
        local got = flops.training_per_token(cfg, c[1], {mtp = 1})
        if math.abs(got / c[2] - 1) > 0.1 then error(('T %d: %.3e vs %.3e'):format(c[1], got, c[2])) end
    end
end)

-- GLM-5.3-Flash: H 8, V 16, layer 0 KDA (Hk 2, Dk 2, Q 4, conv 3) with a dense MLP (I 5), layer 1
-- NoPE MLA (NH 2, Rq 4, Rkv 4, Dn 2, Dv 2) with a full k-pool indexer (Hi 2, Di 4, kp 2,
-- index_topk 4, the tail) and MoE (E 4, K 2, Im 3, 1 shared); mHC over 2 streams
local FLASH = {model_type = 'glm5_next', vocab_size = 16, hidden_size = 8, num_hidden_layers = 2,
    layer_types = {'linear_attention', 'indexed_attention'}, mlp_layer_types = {'dense', 'sparse'},
    num_attention_heads = 2, num_key_value_heads = 2, q_lora_rank = 4, kv_lora_rank = 4, qk_nope_head_dim = 2,
    qk_rope_head_dim = 0, v_head_dim = 2, index_n_heads = 2, index_head_dim = 4, index_topk = 4, index_kpool = 2,
    linear_num_heads = 2, linear_head_dim = 2, linear_conv_kernel_dim = 3, hc_mult = 2, n_routed_experts = 4,
    num_experts_per_tok = 2, moe_intermediate_size = 3, n_shared_experts = 1, intermediate_size = 5, n_group = 1,
    topk_group = 1, pad_token_id = 0, bos_token_id = 1, eos_token_id = 0}

-- Hand count, T = 6 (FLOPs per token):
--   KDA projections 2·(q,k,v 3·8·4 + f_a 8·2 + f_b 2·4 + b 8·2 + g_a 8·2 + g_b 2·4 + o 4·8) = 384,
--   short convs 3·2·4·3 = 72, the delta rule 3·2·Hk·Dk·Dv = 48
--   mHC per layer 2·(fn 2·16·8 + read 2·16 + write 2·2·2·8 + 2·16) = 768; dense MLP 2·3·8·5 = 240
--   NoPE MLA projections 2·(q_a 8·4 + q_b 4·2·2 + kv_a 8·4 + kv_b 4·2·4 + o 2·2·8) = 288
--   keys per query, n = 1..6 visible: 2·min(2, floor(n/2)) + n mod 2 = 1, 2, 3, 4, 5, 4: 19/6;
--   complete pools 0, 1, 1, 2, 2, 3: 9/6; attention core 2·2·(2 + 2)·19/6
--   indexer 2·(wq_b 4·2·4 + wk 8·4 + weights_proj 8·2 + gate 8·4) + pooling 2·4 + (2·2·4 + 2·2)·9/6 = 262
--   MoE: router 64 + routed 2·3·8·3·2 = 288 + shared 144; lm_head 2·8·16 = 256
T:test('GLM-5.3-Flash tiny config: KDA, NoPE MLA over k-pool DSA, mHC', function()
    local f = flops.forward_per_token(FLASH, 6)
    local core = 2 * 2 * 4 * 19 / 6
    T.close(f.layers[1], 384 + 72 + 48 + 768 + 240, {atol = 1e-9, msg = 'KDA layer'})
    T.close(f.layers[2], 288 + core + 262 + 768 + 64 + 288 + 144, {atol = 1e-9, msg = 'DSA layer'})
    T.close(f.total, f.layers[1] + f.layers[2] + 256, {atol = 1e-9, msg = 'total'})
    T.close(f.mean_keys, 19 / 6, {atol = 1e-12})
    T.close(f.parts.mhc, 2 * 768, {atol = 1e-9})
    -- packed: documents of 2 and 4 tokens attend within themselves
    local g = flops.forward_per_token(FLASH, {2, 4})
    T.close(g.mean_keys, (1 + 2 + 1 + 2 + 3 + 4) / 6, {atol = 1e-12})
    T.close(flops.training_per_token(FLASH, 6), 3 * f.total, {atol = 1e-6})
end)

T:test('errors', function()
    T.raises(function() flops.forward_per_token(TINY, 0) end, 'sequence length must be a positive integer')
    T.raises(function() flops.forward_per_token(TINY, {4, 1.5}) end, 'document length 2 is 1.5')
    T.raises(function() flops.forward_per_token(TINY, 4, {mtp = -1}) end, 'opts.mtp must be a non-negative integer')
    T.raises(function() flops.forward_per_token({hidden_size = 8}, 4) end, 'flops config: missing required field architectures')
end)

os.exit(T:run())
