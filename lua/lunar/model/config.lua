-- lunar.model.config: a validated model config from a Hugging Face config.json.
--
--   local cfg = lunar.model.config.load('GLM-5/config.json')
--   local cfg = lunar.model.config.from_table(t, 'my config')
--
-- Architectures: GlmMoeDsaForCausalLM (model_type glm_moe_dsa: GLM-5, 5.1, 5.2, 5.3),
-- Glm4MoeForCausalLM (glm4_moe: GLM-4.5, 4.6, 4.7) and Glm5NextForConditionalGeneration (glm5_next:
-- GLM-5.3-Flash, validated by lunar.model.glm5_next_config). Fields missing from the file get the
-- defaults of transformers' config classes (docs: glm5-architecture.md sections 1.1 and 14.1),
-- except the four sizes every saved config.json has (vocab_size, hidden_size,
-- num_hidden_layers, num_attention_heads), which are required. The result holds every field
-- of the input (JSON null -> nil) plus:
--   architecture, model_type, rope_parameters {rope_type, rope_theta, ...}, mlp_layer_types
--   ('dense' / 'sparse' per layer), num_nextn_predict_layers, source, raw (the input table);
--   glm_moe_dsa: qk_head_dim = qk_nope_head_dim + qk_rope_head_dim, head_dim := qk_rope_head_dim
--     (transformers overwrites it), indexer_types ('full' / 'shared' per layer, section 1.3),
--     layer_types;
--   glm4_moe: rotary_dim = floor(head_dim * partial_rotary_factor), num_key_value_groups;
--   fp8_block {128, 128} when quantization_config says quant_method 'fp8'.
-- Errors name the source and the key: "config.json: num_key_value_heads (32) must equal ...".
local tensor = require 'lunar.tensor'
local null = require('lunar.core').io.null
local MLP = require 'lunar.nn.mlp'

local fail = tensor.fail

local M = {}

local ARCH_OF_TYPE = {glm_moe_dsa = 'GlmMoeDsaForCausalLM', glm4_moe = 'Glm4MoeForCausalLM'}
local TYPE_OF_ARCH = {GlmMoeDsaForCausalLM = 'glm_moe_dsa', Glm4MoeForCausalLM = 'glm4_moe'}

-- field kinds: posint (> 0), nonneg (>= 0 integer), int, number, posnum (> 0), bool, string
-- {key, kind, default, required=}; default nil = absent unless the file sets it
local COMMON = {
    {'vocab_size', 'posint', nil, true},
    {'hidden_size', 'posint', nil, true},
    {'num_hidden_layers', 'posint', nil, true},
    {'num_attention_heads', 'posint', nil, true},
    {'hidden_act', 'string', 'silu'},
    {'initializer_range', 'posnum', 0.02},
    {'rms_norm_eps', 'posnum', 1e-5},
    {'use_cache', 'bool', true},
    {'tie_word_embeddings', 'bool', false},
    {'attention_bias', 'bool', false},
    {'attention_dropout', 'number', 0.0},
    {'n_shared_experts', 'nonneg', 1},
    {'n_group', 'posint', 1},
    {'topk_group', 'posint', 1},
    {'norm_topk_prob', 'bool', true},
}

local DEFAULTS = {
    glm_moe_dsa = {
        {'intermediate_size', 'posint', 12288},
        {'moe_intermediate_size', 'posint', 2048},
        {'num_key_value_heads', 'posint', 64},
        {'n_routed_experts', 'posint', 256},
        {'routed_scaling_factor', 'posnum', 2.5},
        {'kv_lora_rank', 'posint', 512},
        {'q_lora_rank', 'posint', 2048},
        {'qk_rope_head_dim', 'posint', 64},
        {'qk_nope_head_dim', 'posint', 192},
        {'v_head_dim', 'posint', 256},
        {'num_experts_per_tok', 'posint', 8},
        {'max_position_embeddings', 'posint', 202752},
        {'first_k_dense_replace', 'nonneg', 3},
        {'index_topk', 'posint', 2048},
        {'index_head_dim', 'posint', 128},
        {'index_n_heads', 'posint', 32},
        {'mlp_bias', 'bool', false},
        {'num_nextn_predict_layers', 'nonneg', 0},
        {'bos_token_id', 'token', 0},
        {'eos_token_id', 'tokens', 1},
        {'pad_token_id', 'token', nil},
        {'index_topk_freq', 'int', nil},
        {'index_skip_topk_offset', 'int', nil},
    },
    glm4_moe = {
        {'intermediate_size', 'posint', 10944},
        {'moe_intermediate_size', 'posint', 1408},
        {'num_key_value_heads', 'posint', 8},
        {'head_dim', 'posint', 128},
        {'n_routed_experts', 'posint', 128},
        {'routed_scaling_factor', 'posnum', 1.0},
        {'num_experts_per_tok', 'posint', 8},
        {'max_position_embeddings', 'posint', 131072},
        {'first_k_dense_replace', 'nonneg', 1},
        {'use_qk_norm', 'bool', false},
        {'num_nextn_predict_layers', 'nonneg', 1},
        {'bos_token_id', 'token', nil},
        {'eos_token_id', 'tokens', nil},
        {'pad_token_id', 'token', nil},
    },
}

local function is_int(v) return type(v) == 'number' and v == math.floor(v) and v > -2 ^ 53 and v < 2 ^ 53 end

local function show(v)
    if v == null then return 'null' end
    if type(v) == 'string' then return ('"%s"'):format(v) end
    if type(v) == 'table' then return 'a table' end
    return tostring(v)
end

local function checker(src)
    local function bad(key, msg, ...) fail(('%s: %s ' .. msg):format(src, key, ...)) end
    local function check_kind(key, v, kind)
        local ok, what
        if kind == 'posint' then ok, what = is_int(v) and v > 0, 'a positive integer'
        elseif kind == 'nonneg' then ok, what = is_int(v) and v >= 0, 'a non-negative integer'
        elseif kind == 'int' then ok, what = is_int(v), 'an integer'
        elseif kind == 'number' then ok, what = type(v) == 'number' and v == v, 'a number'
        elseif kind == 'posnum' then ok, what = type(v) == 'number' and v > 0, 'a positive number'
        elseif kind == 'bool' then ok, what = type(v) == 'boolean', 'true or false'
        elseif kind == 'string' then ok, what = type(v) == 'string', 'a string'
        elseif kind == 'token' then ok, what = is_int(v) and v >= 0, 'a token id (non-negative integer) or null'
        elseif kind == 'tokens' then
            what = 'a token id or a list of token ids'
            ok = is_int(v) and v >= 0
            if type(v) == 'table' and #v > 0 then
                ok = true
                for _, x in ipairs(v) do if not (is_int(x) and x >= 0) then ok = false end end
            end
        else error('unknown kind ' .. kind) end
        if not ok then bad(key, 'must be %s, got %s', what, show(v)) end
    end
    return bad, check_kind
end

-- list of strings of length n whose entries are in allowed; key names the field in errors
local function check_list(bad, key, v, n, allowed, from)
    from = from or ''
    if type(v) ~= 'table' then bad(key, '%smust be a list of %d strings, got %s', from, n, show(v)) end
    if #v ~= n then bad(key, '%shas %d entries but num_hidden_layers is %d', from, #v, n) end
    for i = 1, n do
        if not allowed[v[i]] then
            local names = {}
            for k in pairs(allowed) do names[#names + 1] = "'" .. k .. "'" end
            table.sort(names)
            bad(key, '%sentry %d is %s, expected one of %s', from, i, show(v[i]), table.concat(names, ', '))
        end
    end
end

local function architecture(t, src, bad)
    local arch, mtype = t.architectures, t.model_type
    if arch ~= nil and arch ~= null then
        if type(arch) ~= 'table' or type(arch[1]) ~= 'string' then
            bad('architectures', 'must be a list of class names, got %s', show(arch))
        end
        arch = arch[1]
    else
        arch = nil
    end
    if mtype == null then mtype = nil end
    if mtype ~= nil and type(mtype) ~= 'string' then bad('model_type', 'must be a string, got %s', show(mtype)) end
    if arch == nil and mtype == nil then
        fail(('%s: missing required field architectures (or model_type): cannot tell which model this is'):format(src))
    end
    if arch ~= nil and not TYPE_OF_ARCH[arch] then
        bad('architectures', "names the unknown architecture '%s' (lunar knows GlmMoeDsaForCausalLM, "
            .. 'Glm4MoeForCausalLM and Glm5NextForConditionalGeneration)', arch)
    end
    if mtype ~= nil and not ARCH_OF_TYPE[mtype] then
        bad('model_type', "is the unknown model type '%s' (lunar knows glm_moe_dsa, glm4_moe and glm5_next)", mtype)
    end
    if arch and mtype and TYPE_OF_ARCH[arch] ~= mtype then
        bad('model_type', "'%s' contradicts architectures '%s' (model type %s)", mtype, arch, TYPE_OF_ARCH[arch])
    end
    mtype = mtype or TYPE_OF_ARCH[arch]
    return ARCH_OF_TYPE[mtype], mtype
end

local function rope_parameters(t, bad, default_theta)
    local rp = t.rope_parameters
    if rp ~= nil and rp ~= null then
        if type(rp) ~= 'table' then bad('rope_parameters', 'must be an object, got %s', show(rp)) end
        local out = {}
        for k, v in pairs(rp) do out[k] = v end
        out.rope_type = out.rope_type or out.type or 'default'
        out.rope_theta = out.rope_theta or (t.rope_theta ~= null and t.rope_theta) or default_theta
        return out, 'rope_parameters'
    end
    -- transformers 4.x layout: rope_theta and rope_scaling at the top level
    local out = {rope_type = 'default', rope_theta = default_theta}
    if t.rope_theta ~= nil and t.rope_theta ~= null then out.rope_theta = t.rope_theta end
    local rs = t.rope_scaling
    if rs ~= nil and rs ~= null then
        if type(rs) ~= 'table' then bad('rope_scaling', 'must be an object or null, got %s', show(rs)) end
        for k, v in pairs(rs) do out[k] = v end
        out.rope_type = rs.rope_type or rs.type or 'default'
    end
    return out, 'rope_theta'
end

-- indexer_types for glm_moe_dsa (glm5-architecture.md section 1.3)
local function indexer_types(t, L, bad)
    local it = t.indexer_types
    if it ~= nil and it ~= null then
        check_list(bad, 'indexer_types', it, L, {full = true, shared = true})
        local out = {}
        for i = 1, L do out[i] = it[i] end
        return out, 'indexer_types', ''
    end
    local pat = t.index_topk_pattern
    if pat ~= nil and pat ~= null then
        local list = {}
        if type(pat) == 'string' then
            for i = 1, #pat do list[i] = pat:sub(i, i) end
        elseif type(pat) == 'table' then
            for i = 1, #pat do list[i] = pat[i] end
        else
            bad('index_topk_pattern', 'must be a string like "FFFSSS" or a list, got %s', show(pat))
        end
        local map = {F = 'full', S = 'shared', full = 'full', shared = 'shared'}
        if #list ~= L then bad('index_topk_pattern', 'has %d entries but num_hidden_layers is %d', #list, L) end
        local out = {}
        for i = 1, L do
            out[i] = map[list[i]]
            if not out[i] then
                bad('index_topk_pattern', "entry %d is %s, expected 'F' (full) or 'S' (shared)", i, show(list[i]))
            end
        end
        return out, 'index_topk_pattern', ''
    end
    local freq = t.index_topk_freq or 1
    local offset = t.index_skip_topk_offset or 2
    if freq < 1 then freq = 1 end
    local out = {}
    for i = 0, L - 1 do
        out[i + 1] = (math.max(i - offset + 1, 0) % freq == 0) and 'full' or 'shared'
    end
    return out, 'index_topk_freq', ('(derived from index_topk_freq=%d, index_skip_topk_offset=%d) '):format(freq, offset)
end

-- the MoE routing fields of cfg fit together (bad: the checker's error function)
function M.check_routing(cfg, bad)
    local E, G = cfg.n_routed_experts, cfg.n_group
    if E % G ~= 0 then bad('n_routed_experts', '(%d) is not divisible by n_group (%d)', E, G) end
    if E / G < 2 then
        bad('n_routed_experts', '(%d) gives %d expert(s) per group with n_group %d; group scores sum the top 2 experts '
            .. 'of each group, so every group needs at least 2', E, E / G, G)
    end
    if cfg.topk_group > G then bad('topk_group', '(%d) is larger than n_group (%d)', cfg.topk_group, G) end
    if cfg.num_experts_per_tok > E then
        bad('num_experts_per_tok', '(%d) is larger than n_routed_experts (%d)', cfg.num_experts_per_tok, E)
    end
    if cfg.num_experts_per_tok > cfg.topk_group * (E / G) then
        bad('num_experts_per_tok', '(%d) is more than the %d experts in the topk_group (%d) groups kept per token',
            cfg.num_experts_per_tok, cfg.topk_group * (E / G), cfg.topk_group)
    end

end

-- from_table(t, source_name) -> validated config (see the top of this file)
function M.from_table(t, src)
    src = src or 'config'
    if type(t) ~= 'table' then fail(('%s: expected a table (the parsed config.json), got %s'):format(src, type(t))) end
    local bad, check_kind = checker(src)
    local next_cfg = require 'lunar.model.glm5_next_config'
    if next_cfg.is_glm5_next(t) then return next_cfg.from_table(t, src) end
    local arch, mtype = architecture(t, src, bad)
    local cfg = {}
    for k, v in pairs(t) do
        if v ~= null then cfg[k] = v end
    end
    -- aliases transformers accepts for the expert count (num_experts overrides, as in HF)
    if cfg.n_routed_experts == nil and cfg.num_local_experts ~= nil then cfg.n_routed_experts = cfg.num_local_experts end
    if cfg.num_experts ~= nil then cfg.n_routed_experts = cfg.num_experts end
    if mtype == 'glm_moe_dsa' and t.q_lora_rank == null then
        bad('q_lora_rank', 'is null, but GlmMoeDsaForCausalLM always runs q_a_proj (and its indexer needs it): set it')
    end
    local fields = {}
    for _, f in ipairs(COMMON) do fields[#fields + 1] = f end
    for _, f in ipairs(DEFAULTS[mtype]) do fields[#fields + 1] = f end
    for _, f in ipairs(fields) do
        local key, kind, default, required = f[1], f[2], f[3], f[4]
        if cfg[key] == nil then
            if required then fail(('%s: missing required field %s'):format(src, key)) end
            cfg[key] = default
        end
        if cfg[key] ~= nil then check_kind(key, cfg[key], kind) end
    end
    cfg.architecture, cfg.model_type, cfg.source, cfg.raw = arch, mtype, src, t
    local L = cfg.num_hidden_layers

    if not MLP.ACTIVATIONS[cfg.hidden_act] then   -- the MLP and the experts implement the same list
        bad('hidden_act', "is '%s'; lunar implements %s", cfg.hidden_act, table.concat(MLP.ACTIVATION_NAMES, ', '))
    end
    if cfg.pad_token_id and cfg.pad_token_id >= cfg.vocab_size then
        bad('pad_token_id', '(%d) must be below vocab_size (%d)', cfg.pad_token_id, cfg.vocab_size)
    end

    M.check_routing(cfg, bad)

    -- MLP type per layer
    if cfg.mlp_layer_types ~= nil then   -- an explicit list wins over first_k_dense_replace
        check_list(bad, 'mlp_layer_types', cfg.mlp_layer_types, L, {dense = true, sparse = true})
    else   -- as transformers: layer i is dense when i < first_k_dense_replace (all dense if it exceeds L)
        local m = {}
        for i = 1, L do m[i] = i <= cfg.first_k_dense_replace and 'dense' or 'sparse' end
        cfg.mlp_layer_types = m
    end
    if cfg.layer_types ~= nil and (type(cfg.layer_types) ~= 'table' or #cfg.layer_types ~= L) then
        bad('layer_types', 'must list one entry per layer (%d)', L)
    end

    local rp, rope_key = rope_parameters(t, bad, 10000.0)
    if type(rp.rope_theta) ~= 'number' or not (rp.rope_theta > 0) then
        bad(rope_key == 'rope_parameters' and 'rope_parameters.rope_theta' or 'rope_theta', 'must be a positive number, got %s',
            show(rp.rope_theta))
    end
    if type(rp.rope_type) ~= 'string' then bad('rope_parameters.rope_type', 'must be a string, got %s', show(rp.rope_type)) end
    cfg.rope_parameters = rp

    if mtype == 'glm_moe_dsa' then
        if cfg.num_key_value_heads ~= cfg.num_attention_heads then
            bad('num_key_value_heads', '(%d) must equal num_attention_heads (%d) for glm_moe_dsa: kv_b_proj makes one '
                .. 'key/value head per attention head', cfg.num_key_value_heads, cfg.num_attention_heads)
        end
        if cfg.qk_rope_head_dim % 2 ~= 0 then
            bad('qk_rope_head_dim', '(%d) must be even (rotary pairs)', cfg.qk_rope_head_dim)
        end
        if cfg.index_head_dim <= cfg.qk_rope_head_dim then
            bad('index_head_dim', '(%d) must be larger than qk_rope_head_dim (%d): the indexer applies rope to its first '
                .. 'qk_rope_head_dim dims', cfg.index_head_dim, cfg.qk_rope_head_dim)
        end
        cfg.qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        cfg.head_dim = cfg.qk_rope_head_dim   -- transformers overwrites config.head_dim with this
        local it, key, from = indexer_types(t, L, bad)
        if it[1] ~= 'full' then
            bad(key, "%smust start with 'full' (layer 0 has no earlier layer to share top-k indices with)", from)
        end
        cfg.indexer_types = it
        if cfg.layer_types == nil then
            local lt = {}
            for i = 1, L do lt[i] = 'deepseek_sparse_attention' end
            cfg.layer_types = lt
        end
    else
        if cfg.num_attention_heads % cfg.num_key_value_heads ~= 0 then
            bad('num_attention_heads', '(%d) is not divisible by num_key_value_heads (%d)', cfg.num_attention_heads,
                cfg.num_key_value_heads)
        end
        local prf = cfg.partial_rotary_factor
        if prf == nil then prf = rp.partial_rotary_factor end
        if prf == nil then prf = 0.5 end
        if type(prf) ~= 'number' or not (prf > 0 and prf <= 1) then
            bad('partial_rotary_factor', 'must be a number in (0, 1], got %s', show(prf))
        end
        cfg.partial_rotary_factor = prf
        local rot = math.floor(cfg.head_dim * prf)
        if rot % 2 ~= 0 or rot == 0 then
            bad('partial_rotary_factor', '(%g) times head_dim (%d) gives %d rotary dims, which must be even and positive', prf,
                cfg.head_dim, rot)
        end
        cfg.rotary_dim = rot
        cfg.num_key_value_groups = cfg.num_attention_heads / cfg.num_key_value_heads
    end

    -- FP8 checkpoints (formats.md section 5)
    local qc = cfg.quantization_config
    if qc ~= nil then
        if type(qc) ~= 'table' then bad('quantization_config', 'must be an object, got %s', show(qc)) end
        if qc.quant_method == 'fp8' then
            local bs = qc.weight_block_size
            if bs == nil or bs == null then bs = {128, 128} end
            if type(bs) ~= 'table' or #bs ~= 2 or not (is_int(bs[1]) and bs[1] > 0 and is_int(bs[2]) and bs[2] > 0) then
                bad('quantization_config.weight_block_size', 'must be two positive integers, got %s', show(bs))
            end
            cfg.fp8_block = {bs[1], bs[2]}
        end
    end
    return cfg
end

-- the pieces the other config families share (lunar.model.glm5_next_config)
M.checker, M.check_list, M.show, M.indexer_types, M.is_int = checker, check_list, show, indexer_types, is_int

-- load(path) -> validated config of a config.json (or of the config.json in a directory)
function M.load(path)
    local lio = require 'lunar.io'
    local f = io.open(path .. '/config.json', 'r')
    if f then
        f:close()
        path = path .. '/config.json'
    end
    return M.from_table(lio.read_json(path), path)
end

return M
