-- lunar.model.glm5_next_config: a validated GLM-5.3-Flash config (transformers' glm5_next:
-- Glm5NextForConditionalGeneration with its text tower Glm5NextTextConfig), from a config.json
-- nested (text_config, vision_config) or flat (text fields at the top, as text-only checkpoints
-- write it). lunar.model.config.from_table hands such tables here.
--
-- The result holds every text field (JSON null -> nil) with transformers 5.25.0's defaults
-- (docs: ../shared/docs/glm5_3-flash.md section 1), plus:
--   architecture 'Glm5NextForConditionalGeneration', model_type 'glm5_next', source, raw (the
--   input table, written back on export), nested (the file had text_config), vision_config;
--   tie_word_embeddings from the outer config (transformers ignores the text config's);
--   layer_types ('linear_attention' = KDA / 'indexed_attention' = NoPE MLA + k-pool DSA per
--   layer; the legacy names mamba, full_attention, attention and deepseek_sparse_attention map
--   as transformers maps them), mlp_layer_types (default 3 dense layers then sparse;
--   first_k_dense_replace is not read, as in transformers), indexer_types ('full' / 'shared',
--   the rule of GLM-5), linear_* filled from linear_attn_config, linear_lower_bound nil when the
--   file sets it to null (the softplus gate), head_dim = 0 and qk_head_dim = qk_nope_head_dim.
-- Errors name the source and the key, as lunar.model.config's.
local tensor = require 'lunar.tensor'
local null = require('lunar.core').io.null
local base = require 'lunar.model.config'

local fail = tensor.fail

local M = {}

M.ARCHITECTURE, M.MODEL_TYPE = 'Glm5NextForConditionalGeneration', 'glm5_next'

-- does the parsed config.json describe a glm5_next model?
function M.is_glm5_next(t)
    local arch = type(t.architectures) == 'table' and t.architectures[1] or nil
    return arch == M.ARCHITECTURE or t.model_type == 'glm5_next' or t.model_type == 'glm5_next_text'
end

-- {key, kind, default}; defaults are Glm5NextTextConfig's
local FIELDS = {
    {'vocab_size', 'posint', 154880},
    {'hidden_size', 'posint', 4096},
    {'intermediate_size', 'posint', 12288},
    {'moe_intermediate_size', 'posint', 2048},
    {'num_hidden_layers', 'posint', 45},
    {'num_attention_heads', 'posint', 64},
    {'num_key_value_heads', 'posint', nil},
    {'n_shared_experts', 'nonneg', 1},
    {'n_routed_experts', 'posint', 288},
    {'output_router_logits', 'bool', false},
    {'routed_scaling_factor', 'posnum', 2.5},
    {'kv_lora_rank', 'posint', 512},
    {'q_lora_rank', 'posint', 1536},
    {'qk_rope_head_dim', 'nonneg', 0},
    {'v_head_dim', 'posint', 256},
    {'qk_nope_head_dim', 'posint', 256},
    {'n_group', 'posint', 1},
    {'topk_group', 'posint', 1},
    {'num_experts_per_tok', 'posint', 8},
    {'norm_topk_prob', 'bool', true},
    {'hidden_act', 'string', 'silu'},
    {'max_position_embeddings', 'posint', 1048576},
    {'initializer_range', 'posnum', 0.02},
    {'rms_norm_eps', 'posnum', 1e-5},
    {'use_cache', 'bool', true},
    {'pad_token_id', 'token', 154820},
    {'bos_token_id', 'token', nil},
    {'eos_token_id', 'tokens', nil},
    {'attention_bias', 'bool', false},
    {'attention_dropout', 'number', 0.0},
    {'index_topk', 'posint', 2048},
    {'index_head_dim', 'posint', 128},
    {'index_n_heads', 'posint', 32},
    {'index_kpool', 'int', 16},
    {'index_kpool_always_select_tail', 'bool', true},
    {'swiglu_limit', 'posnum', 10.0},
    {'linear_head_dim', 'posint', 128},
    {'linear_num_heads', 'posint', 64},
    {'linear_conv_kernel_dim', 'posint', 4},
    {'linear_lower_bound', 'number', -5.0},
    {'hc_mult', 'int', 4},
    {'hc_eps', 'posnum', 1e-6},
    {'hc_sinkhorn_iters', 'int', 20},
    {'router_aux_loss_coef', 'number', 0.001},
}

-- transformers' names of the two block kinds (configuration_utils' legacy remap and glm5_next's)
-- the fields Glm5NextTextConfig / Glm5NextVisionConfig type as float
local TEXT_FLOATS = {'routed_scaling_factor', 'initializer_range', 'rms_norm_eps', 'attention_dropout', 'swiglu_limit',
                     'linear_lower_bound', 'hc_eps', 'router_aux_loss_coef'}
local VISION_FLOATS = {'attention_dropout', 'rms_norm_eps', 'initializer_range', 'swiglu_limit'}

local function mark_floats(t, keys)
    for _, k in ipairs(keys) do
        if type(t[k]) == 'number' then require('lunar.io').mark_float(t, k) end
    end
end

local LAYER_TYPES = {linear_attention = 'linear_attention', mamba = 'linear_attention',
                     indexed_attention = 'indexed_attention', full_attention = 'indexed_attention',
                     attention = 'indexed_attention', deepseek_sparse_attention = 'indexed_attention'}

local function layer_types(text, L, bad)
    local lt = text.layer_types
    if lt == nil or lt == null then
        local out = {}
        for i = 0, L - 1 do out[i + 1] = (i % 4 ~= 3) and 'linear_attention' or 'indexed_attention' end
        return out
    end
    base.check_list(bad, 'layer_types', lt, L, LAYER_TYPES)
    local out = {}
    for i = 1, L do out[i] = LAYER_TYPES[lt[i]] end
    return out
end

function M.from_table(t, src)
    local bad, check_kind = base.checker(src)
    local show = base.show
    if t.model_type ~= nil and t.model_type ~= null and type(t.model_type) ~= 'string' then
        bad('model_type', 'must be a string, got %s', show(t.model_type))
    end
    local text, nested = t, false
    local tc = t.text_config
    if tc ~= nil and tc ~= null then
        if type(tc) ~= 'table' then bad('text_config', 'must be an object, got %s', show(tc)) end
        text, nested = tc, true
    end
    local tsrc = nested and (src .. ' text_config') or src
    bad, check_kind = base.checker(tsrc)
    local cfg = {}
    for k, v in pairs(text) do if v ~= null then cfg[k] = v end end
    if cfg.n_routed_experts == nil and cfg.num_local_experts ~= nil then cfg.n_routed_experts = cfg.num_local_experts end
    if text.q_lora_rank == null then
        bad('q_lora_rank', 'is null, but the DSA layers of glm5_next always run q_a_proj: set it')
    end
    -- linear_attn_config fills the linear_* fields (transformers' __post_init__)
    local la = text.linear_attn_config
    local lower_null = text.linear_lower_bound == null
    if la ~= nil and la ~= null then
        if type(la) ~= 'table' then bad('linear_attn_config', 'must be an object, got %s', show(la)) end
        if la.head_dim ~= nil then cfg.linear_head_dim = la.head_dim end
        if la.num_heads ~= nil then cfg.linear_num_heads = la.num_heads end
        if la.short_conv_kernel_size ~= nil then cfg.linear_conv_kernel_dim = la.short_conv_kernel_size end
        if la.gate_lower_bound ~= nil then
            lower_null = la.gate_lower_bound == null
            cfg.linear_lower_bound = not lower_null and la.gate_lower_bound or nil
        end
        if la.safe_gate ~= false and lower_null then lower_null, cfg.linear_lower_bound = false, -5.0 end
    end
    for _, f in ipairs(FIELDS) do
        local key, kind, default = f[1], f[2], f[3]
        if cfg[key] == nil and not (key == 'linear_lower_bound' and lower_null) then cfg[key] = default end
        if cfg[key] ~= nil then check_kind(key, cfg[key], kind) end
    end
    if cfg.num_key_value_heads == nil then cfg.num_key_value_heads = cfg.num_attention_heads end
    local L = cfg.num_hidden_layers

    -- transformers' validate_architecture, and what lunar needs on top
    if cfg.num_key_value_heads ~= cfg.num_attention_heads then
        bad('num_key_value_heads', '(%d) must equal num_attention_heads (%d) for glm5_next', cfg.num_key_value_heads,
            cfg.num_attention_heads)
    end
    if cfg.qk_rope_head_dim ~= 0 then
        bad('qk_rope_head_dim', '(%d) must be 0: the DSA layers of glm5_next are NoPE (transformers rejects rope there)',
            cfg.qk_rope_head_dim)
    end
    if cfg.index_kpool < 1 then bad('index_kpool', '(%d) must be at least 1', cfg.index_kpool) end
    if cfg.index_topk % cfg.index_kpool ~= 0 then
        bad('index_topk', '(%d) must be divisible by index_kpool (%d)', cfg.index_topk, cfg.index_kpool)
    end
    if cfg.hc_mult < 1 or cfg.hc_mult > 64 then
        bad('hc_mult', '(%d) must be between 1 and 64: the number of residual streams', cfg.hc_mult)
    end
    if cfg.hc_sinkhorn_iters < 1 then
        bad('hc_sinkhorn_iters', '(%d) must be at least 1', cfg.hc_sinkhorn_iters)
    end
    if cfg.hidden_act ~= 'silu' then
        bad('hidden_act', "is '%s'; glm5_next's KDA short conv and MLPs run silu only in lunar", cfg.hidden_act)
    end
    if cfg.pad_token_id and cfg.pad_token_id >= cfg.vocab_size then
        bad('pad_token_id', '(%d) must be below vocab_size (%d) (glm5_next defaults it to 154820: set it for a '
            .. 'smaller vocabulary)', cfg.pad_token_id, cfg.vocab_size)
    end
    base.check_routing(cfg, bad)

    cfg.layer_types = layer_types(text, L, bad)
    if cfg.mlp_layer_types ~= nil then
        base.check_list(bad, 'mlp_layer_types', cfg.mlp_layer_types, L, {dense = true, sparse = true})
    else
        local m = {}
        for i = 1, L do m[i] = i <= 3 and 'dense' or 'sparse' end
        cfg.mlp_layer_types = m
    end
    local it, key, from = base.indexer_types(text, L, bad)
    cfg.indexer_types = it
    -- a shared DSA layer reuses the top-k of the layer before it, which must be a full DSA layer
    -- (transformers raises at the first forward; "full, KDA, shared" and "full, shared, shared"
    -- both fail there)
    for i = 1, L do
        if cfg.layer_types[i] == 'indexed_attention' and it[i] == 'shared' then
            if i == 1 or cfg.layer_types[i - 1] ~= 'indexed_attention' or it[i - 1] ~= 'full' then
                bad(key, "%smakes DSA layer %d 'shared', but layer %d is not a full DSA layer (a shared layer reuses "
                    .. 'the top-k of the full DSA layer right before it)', from, i - 1, i - 2)
            end
        end
    end
    cfg.head_dim = 0
    cfg.qk_head_dim = cfg.qk_nope_head_dim

    -- the outer config: the tie, the vision tower (carried, never trained)
    local tie = t.tie_word_embeddings
    if not nested then tie = text.tie_word_embeddings end
    if tie == nil or tie == null then tie = false end
    if type(tie) ~= 'boolean' then
        base.checker(src)('tie_word_embeddings', 'must be true or false, got %s', show(tie))
    end
    cfg.tie_word_embeddings = tie
    cfg.vision_config = nested and t.vision_config ~= null and t.vision_config or nil
    cfg.nested = nested
    -- transformers' strict config classes reject 10 where a float is due: the export writes 10.0
    mark_floats(text, TEXT_FLOATS)
    if cfg.vision_config and type(cfg.vision_config) == 'table' then mark_floats(cfg.vision_config, VISION_FLOATS) end
    cfg.architecture, cfg.model_type, cfg.source, cfg.raw = M.ARCHITECTURE, M.MODEL_TYPE, src, t
    cfg.num_nextn_predict_layers = 0   -- transformers drops the MTP layer (layers.<L>.*)
    local qc = t.quantization_config ~= null and t.quantization_config or (nested and text.quantization_config)
    if qc and qc ~= null then
        if type(qc) ~= 'table' then fail(('%s: quantization_config must be an object'):format(src)) end
        if qc.quant_method == 'fp8' then
            local bs = qc.weight_block_size
            if bs == nil or bs == null then bs = {128, 128} end
            if type(bs) ~= 'table' or #bs ~= 2 or not (base.is_int(bs[1]) and bs[1] > 0 and base.is_int(bs[2]) and bs[2] > 0) then
                fail(('%s: quantization_config.weight_block_size must be two positive integers, got %s'):format(src, show(bs)))
            end
            cfg.fp8_block = {bs[1], bs[2]}
        end
    end
    return cfg
end

return M
