-- test_model_config.lua: lunar.model.config: defaults and derived fields for glm_moe_dsa and
-- glm4_moe (glm5-architecture.md sections 1 and 14.1), IndexShare layer types (section 1.3),
-- the HF unit-test config (section 12.1), and one test per invalid config, each checking that
-- the message names the source and the key.
local lunar = require 'lunar'
local config = lunar.model.config
local lio = lunar.io
local T = require('lunar.testing').suite('model.config')

local function eq(a, b, msg)
    if type(a) == 'table' or type(a) == 'number' then return T.equal(a, b, msg) end
    if a ~= b then error(('%s: got %s, expected %s'):format(msg, tostring(a), tostring(b)), 2) end
end

local function copy(t)
    local c = {}
    for k, v in pairs(t) do c[k] = type(v) == 'table' and copy(v) or v end
    return c
end

-- GlmMoeDsaModelTester + CausalLMModelTester values (section 12.1)
local HF_TEST = {
    architectures = {'GlmMoeDsaForCausalLM'}, model_type = 'glm_moe_dsa',
    vocab_size = 99, hidden_size = 32, num_attention_heads = 2, num_key_value_heads = 2, intermediate_size = 37,
    hidden_act = 'gelu', max_position_embeddings = 512, initializer_range = 0.02, pad_token_id = 0,
    bos_token_id = 1, eos_token_id = 2, moe_intermediate_size = 12, num_experts_per_tok = 2,
    n_routed_experts = 8, kv_lora_rank = 32, q_lora_rank = 16, qk_nope_head_dim = 64, qk_rope_head_dim = 64,
    v_head_dim = 128, num_hidden_layers = 2, mlp_layer_types = {'sparse', 'dense'}, head_dim = 16,
}

-- GLM-5.2 as published (sizes of section 1.2)
local GLM52 = {
    architectures = {'GlmMoeDsaForCausalLM'}, model_type = 'glm_moe_dsa', vocab_size = 154880, hidden_size = 6144,
    num_hidden_layers = 78, num_attention_heads = 64, num_key_value_heads = 64, q_lora_rank = 2048,
    kv_lora_rank = 512, qk_nope_head_dim = 192, qk_rope_head_dim = 64, v_head_dim = 256, intermediate_size = 12288,
    moe_intermediate_size = 2048, n_routed_experts = 256, num_experts_per_tok = 8, n_shared_experts = 1,
    n_group = 1, topk_group = 1, routed_scaling_factor = 2.5, norm_topk_prob = true, first_k_dense_replace = 3,
    rms_norm_eps = 1e-5, max_position_embeddings = 1048576,
    rope_parameters = {rope_type = 'default', rope_theta = 8000000}, index_topk = 2048, index_head_dim = 128,
    index_n_heads = 32, index_topk_freq = 4, index_skip_topk_offset = 3, index_topk_pattern = lio.null,
    num_nextn_predict_layers = 1, eos_token_id = {154820, 154827, 154829}, pad_token_id = lio.null,
    quantization_config = {quant_method = 'fp8', fmt = 'e4m3', activation_scheme = 'dynamic', weight_block_size = {128, 128}},
}

-- GLM-4.5-Air (section 14.1)
local AIR = {
    architectures = {'Glm4MoeForCausalLM'}, model_type = 'glm4_moe', vocab_size = 151552, hidden_size = 4096,
    num_hidden_layers = 46, num_attention_heads = 96, num_key_value_heads = 8, head_dim = 128,
    intermediate_size = 10944, moe_intermediate_size = 1408, n_routed_experts = 128, num_experts_per_tok = 8,
    first_k_dense_replace = 1, routed_scaling_factor = 1.0, attention_bias = true, use_qk_norm = false,
    rope_theta = 1000000, partial_rotary_factor = 0.5, max_position_embeddings = 131072,
}

T:test('the HF unit-test config validates, with defaults and derived fields', function()
    local c = config.from_table(copy(HF_TEST), 'hf_test')
    eq(c.architecture, 'GlmMoeDsaForCausalLM', 'architecture')
    eq(c.head_dim, 64, 'head_dim overwritten with qk_rope_head_dim')
    eq(c.qk_head_dim, 128, 'qk_head_dim')
    eq(c.indexer_types, {'full', 'full'}, 'all full by default')
    eq(c.mlp_layer_types, {'sparse', 'dense'}, 'explicit mlp_layer_types kept')
    eq(c.n_shared_experts, 1, 'default n_shared_experts')
    eq(c.routed_scaling_factor, 2.5, 'default routed_scaling_factor')
    eq(c.index_topk, 2048, 'default index_topk')
    eq(c.index_n_heads, 32, 'default index_n_heads')
    eq(c.rms_norm_eps, 1e-5, 'default eps')
    eq(c.rope_parameters.rope_theta, 10000, 'default rope theta')
    eq(c.rope_parameters.rope_type, 'default', 'rope type')
    eq(c.tie_word_embeddings, false, 'tie')
    eq(c.num_nextn_predict_layers, 0, 'no MTP layer by default')
    eq(#c.layer_types, 2, 'layer_types')
    eq(c.raw.head_dim, 16, 'raw input kept')
end)

T:test('GLM-5.2-like: freq 4, offset 3, 78 layers -> 21 full and 57 shared', function()
    local c = config.from_table(copy(GLM52), 'glm-5.2/config.json')
    local full, shared, fulls = 0, 0, {}
    for i, v in ipairs(c.indexer_types) do
        if v == 'full' then full = full + 1; fulls[#fulls + 1] = i - 1 else shared = shared + 1 end
    end
    eq(full, 21, 'full layers')
    eq(shared, 57, 'shared layers')
    local want = {0, 1, 2}
    for l = 6, 74, 4 do want[#want + 1] = l end
    eq(fulls, want, 'full at 0, 1, 2, 6, 10, ..., 74')
    eq(c.mlp_layer_types[3], 'dense', 'layer 2 dense')
    eq(c.mlp_layer_types[4], 'sparse', 'layer 3 sparse')
    eq(c.pad_token_id, nil, 'null pad_token_id becomes nil')
    eq(c.eos_token_id, {154820, 154827, 154829}, 'eos list')
    eq(c.fp8_block, {128, 128}, 'fp8 block size')
    eq(c.rope_parameters.rope_theta, 8000000, 'theta')
    eq(c.num_nextn_predict_layers, 1, 'MTP layers')
    -- the HF test pattern: freq 4, offset 3, 8 layers
    local t = copy(HF_TEST)
    t.num_hidden_layers, t.mlp_layer_types, t.index_topk_freq, t.index_skip_topk_offset = 8, nil, 4, 3
    eq(config.from_table(t).indexer_types, {'full', 'full', 'full', 'shared', 'shared', 'shared', 'full', 'shared'},
        'HF test pattern')
    t.index_topk_pattern = 'FSFS' .. 'SSSS'
    eq(config.from_table(t).indexer_types, {'full', 'shared', 'full', 'shared', 'shared', 'shared', 'shared', 'shared'},
        'pattern string wins over freq')
    t.indexer_types = {'full', 'full', 'full', 'full', 'full', 'full', 'full', 'shared'}
    eq(config.from_table(t).indexer_types[8], 'shared', 'explicit list wins over pattern')
end)

T:test('glm4_moe: defaults, rotary_dim, GQA groups, legacy rope_theta', function()
    local c = config.from_table(copy(AIR), 'air')
    eq(c.model_type, 'glm4_moe', 'model type')
    eq(c.rotary_dim, 64, 'rotary dims')
    eq(c.num_key_value_groups, 12, 'groups')
    eq(c.mlp_layer_types[1], 'dense', 'first dense')
    eq(c.mlp_layer_types[2], 'sparse', 'then sparse')
    eq(#c.mlp_layer_types, 46, 'per layer')
    eq(c.rope_parameters.rope_theta, 1000000, 'rope_theta from the top level')
    eq(c.num_nextn_predict_layers, 1, 'glm4_moe default MTP layers')
    eq(c.n_group, 1, 'default n_group')
    local t = copy(AIR)
    t.first_k_dense_replace = 50   -- more than the layers: all dense, as in transformers
    local all_dense = config.from_table(t).mlp_layer_types
    eq(#all_dense == 46 and all_dense[46] == 'dense', true, 'first_k_dense_replace > layers')
    t = copy(AIR)
    t.architectures = nil
    eq(config.from_table(t).architecture, 'Glm4MoeForCausalLM', 'from model_type alone')
end)

T:test('load(path) and load(dir) read config.json; errors name the file', function()
    local dir = os.tmpname()
    os.remove(dir)
    os.execute("mkdir -p '" .. dir .. "'")
    local t = copy(GLM52)
    lio.write_json(dir .. '/config.json', t)
    local c = config.load(dir)
    eq(c.source, dir .. '/config.json', 'source')
    eq(#c.indexer_types, 78, 'layers')
    eq(config.load(dir .. '/config.json').hidden_size, 6144, 'load(file)')
    t.num_key_value_heads = 8
    lio.write_json(dir .. '/config.json', t)
    T.raises(function() config.load(dir) end, dir .. '/config.json: num_key_value_heads (8) must equal num_attention_heads (64)')
    os.execute("rm -rf '" .. dir .. "'")
end)

-- {description, base, changes, expected message fragment}; every message must also hold the source
local NULL = lio.null
local BAD = {
    {'unknown architecture', HF_TEST, {architectures = {'LlamaForCausalLM'}, model_type = NULL},
        "architectures names the unknown architecture 'LlamaForCausalLM'"},
    {'unknown model_type', HF_TEST, {architectures = NULL, model_type = 'llama'}, "model_type is the unknown model type 'llama'"},
    {'contradictory architecture and model_type', HF_TEST, {model_type = 'glm4_moe'},
        "model_type 'glm4_moe' contradicts architectures 'GlmMoeDsaForCausalLM'"},
    {'no architecture at all', HF_TEST, {architectures = NULL, model_type = NULL}, 'missing required field architectures'},
    {'missing hidden_size', HF_TEST, {hidden_size = NULL}, 'missing required field hidden_size'},
    {'missing num_hidden_layers', AIR, {num_hidden_layers = NULL}, 'missing required field num_hidden_layers'},
    {'wrong type: string size', HF_TEST, {hidden_size = '32'}, 'hidden_size must be a positive integer, got "32"'},
    {'wrong type: fractional size', HF_TEST, {v_head_dim = 12.5}, 'v_head_dim must be a positive integer, got 12.5'},
    {'wrong type: boolean', HF_TEST, {norm_topk_prob = 1}, 'norm_topk_prob must be true or false, got 1'},
    {'wrong type: eps', HF_TEST, {rms_norm_eps = 'tiny'}, 'rms_norm_eps must be a positive number'},
    {'wrong type: eos list', HF_TEST, {eos_token_id = {1, 'x'}}, 'eos_token_id must be a token id or a list'},
    {'unknown activation', HF_TEST, {hidden_act = 'swish2'}, "hidden_act is 'swish2'"},
    {'num_key_value_heads != num_attention_heads', HF_TEST, {num_key_value_heads = 1},
        'num_key_value_heads (1) must equal num_attention_heads (2)'},
    {'q_lora_rank null', HF_TEST, {q_lora_rank = NULL}, 'q_lora_rank is null'},
    {'zero size', HF_TEST, {kv_lora_rank = 0}, 'kv_lora_rank must be a positive integer, got 0'},
    {'negative size', HF_TEST, {intermediate_size = -37}, 'intermediate_size must be a positive integer, got -37'},
    {'negative layer count', HF_TEST, {first_k_dense_replace = -1}, 'first_k_dense_replace must be a non-negative integer'},
    {'odd qk_rope_head_dim', HF_TEST, {qk_rope_head_dim = 63}, 'qk_rope_head_dim (63) must be even'},
    {'index_head_dim <= qk_rope_head_dim', HF_TEST, {index_head_dim = 64}, 'index_head_dim (64) must be larger than qk_rope_head_dim (64)'},
    {'n_routed_experts not divisible by n_group', HF_TEST, {n_group = 3}, 'n_routed_experts (8) is not divisible by n_group (3)'},
    {'fewer than 2 experts per group', HF_TEST, {n_group = 8}, 'n_routed_experts (8) gives 1 expert(s) per group'},
    {'topk_group > n_group', HF_TEST, {topk_group = 2}, 'topk_group (2) is larger than n_group (1)'},
    {'num_experts_per_tok > n_routed_experts', HF_TEST, {num_experts_per_tok = 9},
        'num_experts_per_tok (9) is larger than n_routed_experts (8)'},
    {'num_experts_per_tok > experts in kept groups', HF_TEST, {n_group = 4, topk_group = 1, num_experts_per_tok = 3},
        'num_experts_per_tok (3) is more than the 2 experts'},
    {'indexer_types starts shared', HF_TEST, {indexer_types = {'shared', 'full'}}, "indexer_types must start with 'full'"},
    {'indexer_types wrong length', HF_TEST, {indexer_types = {'full'}}, 'indexer_types has 1 entries but num_hidden_layers is 2'},
    {'indexer_types unknown entry', HF_TEST, {indexer_types = {'full', 'sparse'}}, "indexer_types entry 2 is \"sparse\""},
    {'derived indexer_types start shared', HF_TEST, {index_topk_freq = 2, index_skip_topk_offset = 0},
        "index_topk_freq (derived from index_topk_freq=2, index_skip_topk_offset=0) must start with 'full'"},
    {'index_topk_pattern wrong length', HF_TEST, {index_topk_pattern = 'FSF'}, 'index_topk_pattern has 3 entries'},
    {'index_topk_pattern bad letter', HF_TEST, {index_topk_pattern = 'FX'}, 'index_topk_pattern entry 2 is "X"'},
    {'mlp_layer_types wrong length', HF_TEST, {mlp_layer_types = {'dense'}}, 'mlp_layer_types has 1 entries but num_hidden_layers is 2'},
    {'mlp_layer_types unknown entry', HF_TEST, {mlp_layer_types = {'dense', 'moe'}}, 'mlp_layer_types entry 2 is "moe"'},
    {'glm4_moe odd rotary dims', AIR, {head_dim = 6}, 'partial_rotary_factor (0.5) times head_dim (6) gives 3 rotary dims'},
    {'glm4_moe heads not divisible', AIR, {num_key_value_heads = 7}, 'num_attention_heads (96) is not divisible by num_key_value_heads (7)'},
    {'glm4_moe bad partial_rotary_factor', AIR, {partial_rotary_factor = 1.5}, 'partial_rotary_factor must be a number in (0, 1]'},
    {'bad rope theta', GLM52, {rope_parameters = {rope_type = 'default', rope_theta = -1}}, 'rope_parameters.rope_theta must be a positive number'},
    {'pad_token_id out of range', HF_TEST, {pad_token_id = 99}, 'pad_token_id (99) must be below vocab_size (99)'},
    {'fp8 block size', GLM52, {quantization_config = {quant_method = 'fp8', weight_block_size = {128}}},
        'quantization_config.weight_block_size must be two positive integers'},
}

for _, case in ipairs(BAD) do
    T:test('invalid config: ' .. case[1], function()
        local t = copy(case[2])
        for k, v in pairs(case[3]) do
            if v == NULL and k ~= 'q_lora_rank' and k ~= 'index_topk_pattern' then t[k] = nil else t[k] = v end
        end
        local err = T.raises(function() config.from_table(t, 'cfg/' .. case[1] .. '.json') end, case[4])
        eq(err:find('cfg/' .. case[1] .. '.json: ', 1, true) ~= nil, true, 'names the source: ' .. err)
    end)
end

T:test('not a table', function()
    T.raises(function() config.from_table('x', 'src.json') end, 'src.json: expected a table')
end)

os.exit(T:run())
