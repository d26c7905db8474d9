-- lunar.model.glm5_next_params: the checkpoint tensors of a GLM-5.3-Flash text tower (glm5_next),
-- by name, with shapes, initialisation and trainability, from a validated config
-- (lunar.model.glm5_next_config). Names are transformers' checkpoint names, as save_pretrained
-- writes them (model.language_model.*, lm_head.weight; per-expert experts; KDA's q/k/v conv
-- weights apart; the forget gate's tensors and the mHC weights without a module level).
--
-- spec(cfg[, {experts = {first=, count=}, tp = {rank=, size=}, etp = {rank=, size=}}]) -> list of
-- {name=, shape=, init=, trainable=, dtype=} (lunar.parallel.context:spec_opts gives the options:
-- this rank's routed experts, and its blocks of the tensors split over tp and etp, cut by
-- lunar.model.params.cut: KDA and MLA by heads, the MLPs by their intermediate rows, the routed
-- experts over etp, the embedding and LM head by vocabulary rows when tp divides it)
--   init: 'normal' (initializer_range), 'ones', 'zeros', 'a_log' (0 with the lower-bound gate,
--   else log U(1, 16)), 'dt_bias' (inverse softplus of e^U(ln 1e-3, ln 1e-1)), 'hc_fn' (N(0, 0.02)).
--   The indexer's tensors and e_score_correction_bias are not trainable (transformers computes
--   the indexer under no_grad).
local M = {}

M.PREFIX = 'model.language_model.'

-- split: the dim tensor parallel cuts (KDA's and MLA's heads, the MLPs' rows or columns),
-- esplit: the dim expert tensor parallel cuts (a routed expert's matrices)
local function add(list, name, shape, init, trainable, dtype, split, esplit)
    list[#list + 1] = {name = name, shape = shape, init = init, trainable = trainable ~= false, dtype = dtype,
                       split = split, esplit = esplit}
end

-- is decoder layer i (0-based) a KDA layer?
function M.is_kda(cfg, i) return cfg.layer_types[i + 1] == 'linear_attention' end

-- does DSA layer i run its own indexer?
function M.has_indexer(cfg, i) return not M.is_kda(cfg, i) and cfg.indexer_types[i + 1] == 'full' end

function M.mlp_type(cfg, i) return cfg.mlp_layer_types[i + 1] end

local function hc_specs(list, cfg, p, site)
    local n, H = cfg.hc_mult, cfg.hidden_size
    add(list, p .. 'hc_' .. site .. '_fn', {(2 + n) * n, n * H}, 'hc_fn')
    add(list, p .. 'hc_' .. site .. '_base', {(2 + n) * n}, 'zeros', true, 'f32')
    add(list, p .. 'hc_' .. site .. '_scale', {3}, 'ones', true, 'f32')
end

local function kda_specs(list, cfg, a)
    local H, Hk, Dk, Kc = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim
    local Q = Hk * Dk
    -- (tensor parallel: each rank its heads' channels; f_a, g_a and o_norm whole)
    for _, w in ipairs({'q', 'k', 'v'}) do add(list, a .. w .. '_proj.weight', {Q, H}, 'normal', nil, nil, 1) end
    for _, w in ipairs({'q', 'k', 'v'}) do add(list, a .. w .. '_conv1d.weight', {Q, 1, Kc}, 'normal', true, 'f32', 1) end
    add(list, a .. 'f_a_proj.weight', {Dk, H}, 'normal')
    add(list, a .. 'f_b_proj.weight', {Q, Dk}, 'normal', nil, nil, 1)
    add(list, a .. 'dt_bias', {Q}, 'dt_bias', true, 'f32', 1)
    add(list, a .. 'A_log', {Hk}, 'a_log', true, 'f32', 1)
    add(list, a .. 'b_proj.weight', {Hk, H}, 'normal', nil, nil, 1)
    add(list, a .. 'g_a_proj.weight', {Dk, H}, 'normal')
    add(list, a .. 'g_b_proj.weight', {Q, Dk}, 'normal', nil, nil, 1)
    add(list, a .. 'o_norm.weight', {Dk}, 'ones')
    add(list, a .. 'o_proj.weight', {H, Q}, 'normal', nil, nil, 2)
end

local function dsa_specs(list, cfg, a, indexer)
    local H, NH, Dn, Dv = cfg.hidden_size, cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    local Rq, Rkv = cfg.q_lora_rank, cfg.kv_lora_rank
    local bias = cfg.attention_bias
    add(list, a .. 'q_a_proj.weight', {Rq, H}, 'normal')
    if bias then add(list, a .. 'q_a_proj.bias', {Rq}, 'zeros') end
    add(list, a .. 'q_a_layernorm.weight', {Rq}, 'ones')
    add(list, a .. 'q_b_proj.weight', {NH * Dn, Rq}, 'normal', nil, nil, 1)
    add(list, a .. 'kv_a_proj_with_mqa.weight', {Rkv, H}, 'normal')
    if bias then add(list, a .. 'kv_a_proj_with_mqa.bias', {Rkv}, 'zeros') end
    add(list, a .. 'kv_a_layernorm.weight', {Rkv}, 'ones')
    add(list, a .. 'kv_b_proj.weight', {NH * (Dn + Dv), Rkv}, 'normal', nil, nil, 1)
    add(list, a .. 'o_proj.weight', {H, NH * Dv}, 'normal', nil, nil, 2)
    if bias then add(list, a .. 'o_proj.bias', {H}, 'zeros') end
    if indexer then
        local Hi, Di, kp = cfg.index_n_heads, cfg.index_head_dim, cfg.index_kpool
        local x = a .. 'indexer.'
        add(list, x .. 'wq_b.weight', {Hi * Di, Rq}, 'normal', false)
        add(list, x .. 'wk.weight', {Di, H}, 'normal', false)
        add(list, x .. 'k_norm.weight', {Di}, 'ones', false)
        add(list, x .. 'k_norm.bias', {Di}, 'zeros', false)
        add(list, x .. 'weights_proj.weight', {Hi, H}, 'normal', false)
        add(list, x .. 'index_kpool_compress_ape', {kp, Di}, 'zeros', false)
        add(list, x .. 'index_kpool_compress_gate', {Di, H}, 'ones', false)
    end
end

local function mlp_specs(list, cfg, m, kind, experts)
    local H = cfg.hidden_size
    if kind == 'dense' then
        local I = cfg.intermediate_size
        add(list, m .. 'gate_proj.weight', {I, H}, 'normal', nil, nil, 1)
        add(list, m .. 'up_proj.weight', {I, H}, 'normal', nil, nil, 1)
        add(list, m .. 'down_proj.weight', {H, I}, 'normal', nil, nil, 2)
        return
    end
    local E, Im = cfg.n_routed_experts, cfg.moe_intermediate_size
    add(list, m .. 'gate.weight', {E, H}, 'normal', true, 'f32')
    add(list, m .. 'gate.e_score_correction_bias', {E}, 'zeros', false, 'f32')
    local first, count = 0, E
    if experts then first, count = experts.first, experts.count end
    for e = first, first + count - 1 do
        local x = ('%sexperts.%d.'):format(m, e)
        add(list, x .. 'gate_proj.weight', {Im, H}, 'normal', nil, nil, nil, 1)
        add(list, x .. 'up_proj.weight', {Im, H}, 'normal', nil, nil, nil, 1)
        add(list, x .. 'down_proj.weight', {H, Im}, 'normal', nil, nil, nil, 2)
    end
    local Is = Im * cfg.n_shared_experts
    if Is > 0 then
        add(list, m .. 'shared_experts.gate_proj.weight', {Is, H}, 'normal', nil, nil, 1)
        add(list, m .. 'shared_experts.up_proj.weight', {Is, H}, 'normal', nil, nil, 1)
        add(list, m .. 'shared_experts.down_proj.weight', {H, Is}, 'normal', nil, nil, 2)
    end
end

-- Where transformers' model object keeps a module that the checkpoint names otherwise (its
-- conversion mapping renames these on load; PEFT's adapters use the object's names):
-- {the checkpoint's name ends, the object's ends} (plain strings)
M.MODULE_RENAMES = {
    {'.self_attn.f_a_proj', '.self_attn.forget_gate.f_a_proj'},
    {'.self_attn.f_b_proj', '.self_attn.forget_gate.f_b_proj'},
}

function M.layer_prefix(i) return ('%slayers.%d.'):format(M.PREFIX, i) end

function M.spec(cfg, opts)
    opts = opts or {}
    local list = {}
    local H, V = cfg.hidden_size, cfg.vocab_size
    local params = require 'lunar.model.params'
    local vsplit = opts.tp and params.vocab_split(cfg, opts.tp.size) and 1 or nil
    add(list, M.PREFIX .. 'embed_tokens.weight', {V, H}, 'normal', nil, nil, vsplit)
    for i = 0, cfg.num_hidden_layers - 1 do
        local p = M.layer_prefix(i)
        hc_specs(list, cfg, p, 'attn')
        hc_specs(list, cfg, p, 'ffn')
        add(list, p .. 'input_layernorm.weight', {H}, 'ones')
        add(list, p .. 'post_attention_layernorm.weight', {H}, 'ones')
        if M.is_kda(cfg, i) then kda_specs(list, cfg, p .. 'self_attn.')
        else dsa_specs(list, cfg, p .. 'self_attn.', M.has_indexer(cfg, i)) end
        mlp_specs(list, cfg, p .. 'mlp.', M.mlp_type(cfg, i), opts.experts)
    end
    add(list, M.PREFIX .. 'norm.weight', {H}, 'ones')
    if not cfg.tie_word_embeddings then add(list, 'lm_head.weight', {V, H}, 'normal', nil, nil, vsplit) end
    return params.cut(list, opts)
end

-- vision_spec(vision_config, src) -> the vision tower's tensors (model.visual.*) as transformers'
-- Glm5NextVisionModel holds them, with Glm5NextVisionConfig's defaults: what a fresh model (no
-- checkpoint to carry them from) writes so that transformers loads its export strictly. lunar
-- never computes or trains them. init: 'normal' (the vision initializer_range), 'ones', 'zeros'.
local VISION_DEFAULTS = {depth = 24, hidden_size = 1024, num_heads = 16, in_channels = 3, patch_size = 14,
                         temporal_patch_size = 2, spatial_merge_size = 2, out_hidden_size = 1536,
                         intermediate_size = 4096, projection_intermediate_size = 10240, attention_bias = true}

function M.vision_spec(v, src)
    local c = {}
    for k, d in pairs(VISION_DEFAULTS) do
        local x = v[k]
        if x == nil or x == require('lunar.core').io.null then x = d end
        if k ~= 'attention_bias' and (type(x) ~= 'number' or x ~= math.floor(x) or x < 1) then
            error(('%s: vision_config.%s must be a positive integer to build the vision tower of a fresh model, got %s')
                :format(src or 'config', k, tostring(x)), 0)
        end
        c[k] = x
    end
    if c.hidden_size % c.num_heads ~= 0 then
        error(('%s: vision_config.hidden_size %d is not a multiple of num_heads %d'):format(src or 'config',
            c.hidden_size, c.num_heads), 0)
    end
    local list = {}
    local Hv, Ov, Iv, Pv, hd = c.hidden_size, c.out_hidden_size, c.intermediate_size, c.projection_intermediate_size,
        math.floor(c.hidden_size / c.num_heads)
    local bias = c.attention_bias
    local function linear(name, out_f, in_f, with_bias)
        add(list, name .. '.weight', {out_f, in_f}, 'normal', false)
        if with_bias then add(list, name .. '.bias', {out_f}, 'zeros', false) end
    end
    local P = 'model.visual.'
    add(list, P .. 'patch_embed.proj.weight', {Hv, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size},
        'normal', false)
    add(list, P .. 'patch_embed.proj.bias', {Hv}, 'zeros', false)
    for i = 0, c.depth - 1 do
        local b = ('%sblocks.%d.'):format(P, i)
        add(list, b .. 'norm1.weight', {Hv}, 'ones', false)
        add(list, b .. 'norm2.weight', {Hv}, 'ones', false)
        linear(b .. 'attn.qkv', 3 * Hv, Hv, bias)
        linear(b .. 'attn.proj', Hv, Hv, bias)
        add(list, b .. 'attn.q_norm.weight', {hd}, 'ones', false)
        add(list, b .. 'attn.k_norm.weight', {hd}, 'ones', false)
        linear(b .. 'mlp.gate_proj', Iv, Hv, bias)
        linear(b .. 'mlp.up_proj', Iv, Hv, bias)
        linear(b .. 'mlp.down_proj', Hv, Iv, bias)
    end
    add(list, P .. 'post_layernorm.weight', {Hv}, 'ones', false)
    add(list, P .. 'downsample.weight', {Ov, Hv, c.spatial_merge_size, c.spatial_merge_size}, 'normal', false)
    add(list, P .. 'downsample.bias', {Ov}, 'zeros', false)
    linear(P .. 'merger.proj', Ov, Ov, false)
    add(list, P .. 'merger.post_projection_norm.weight', {Ov}, 'ones', false)
    add(list, P .. 'merger.post_projection_norm.bias', {Ov}, 'zeros', false)
    linear(P .. 'merger.gate_proj', Pv, Ov, false)
    linear(P .. 'merger.up_proj', Pv, Ov, false)
    linear(P .. 'merger.down_proj', Ov, Pv, false)
    return list
end

return M
