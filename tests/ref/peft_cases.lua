-- peft_cases.lua: adapters for tests/ref/make_peft_fixtures.py, which records what PEFT builds
-- from each of them (tests/fixtures/peft/cases.json, checked without Python by
-- tests/lua/test_peft_files.lua).
--
--   ./build/lunar tests/ref/peft_cases.lua OUT
--   python3 tests/ref/make_peft_fixtures.py OUT
--
-- Each case puts adapters on a fixture model (tests/fixtures/models/<model>), gives every B
-- seeded random values (B starts at zero, which would hide a misplaced adapter) and writes
--   OUT/<case>/case.json                     the case: model and peft.apply options
--   OUT/<case>/adapter/                      peft.save (no merged model)
--   OUT/<case>/lunar_reference.safetensors   the fixture's inputs and lunar's logits (eval mode)
local lunar = require 'lunar'
local io_ = require 'lunar.io'
local peft = require 'lunar.peft'
local ops = lunar.ops

local PRESET = {'q_a_proj', 'q_b_proj', 'kv_a_proj_with_mqa', 'kv_b_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj'}

-- name -> {model =, options = peft.apply options}; options hold only JSON values
local CASES = {
    -- the lora recipe's tiny preset targets: attention, dense MLP, shared and routed experts
    glm5_preset = {model = 'glm5_dsa', options = {targets = PRESET, r = 4, alpha = 8, dropout = 0.05, seed = 1}},
    -- every linear map of a GLM-4.5 model (GQA attention with biases)
    glm4moe_all = {model = 'glm4moe', options = {targets = {'all-linear'}, r = 2, alpha = 4, seed = 2}},
    -- a few modules: some experts' gate_proj of one layer, one expert's down_proj of another, a
    -- dense up_proj, one layer's shared experts, two layers' o_proj
    glm5_partial = {model = 'glm5_dsa', options = {targets = {
        '^model%.layers%.1%.mlp%.experts%.[01]%.gate_proj$', '^model%.layers%.2%.mlp%.experts%.3%.down_proj$',
        '^model%.layers%.0%.mlp%.up_proj$', '^model%.layers%.2%.mlp%.shared_experts%.',
        '^model%.layers%.[01]%.self_attn%.o_proj$'}, r = 2, alpha = 3, seed = 3}},
    -- attention only, with dropout: no fused experts or target_parameters, so lora_dropout stays
    glm5_attention = {model = 'glm5_dsa', options = {targets = {'q_b_proj', 'o_proj'}, r = 3, alpha = 6, dropout = 0.1,
        seed = 4}},
    -- what PEFT cannot apply: the MTP layer ...
    glm5_mtp = {model = 'glm5_mtp', options = {targets = PRESET, include_mtp = true, r = 2, alpha = 4, seed = 5}},
    -- ... and rslora on routed experts' gate_proj/up_proj
    glm5_rslora = {model = 'glm5_dsa', options = {targets = {'gate_proj', 'up_proj', 'down_proj'}, r = 4, alpha = 8,
        rslora = true, seed = 6}},
    -- GLM-5.3-Flash (lunar.peft_native): every linear map of KDA, NoPE MLA, the MLPs and the experts
    flash_all = {model = 'flash_a', options = {targets = {'all-linear'}, r = 4, alpha = 8, dropout = 0.05, seed = 8}},
    -- some experts' gate, one's up and another's down, the forget gate's second projection, a
    -- dense MLP of one layer only, under rslora (PEFT fuses gate and up at rank 2r)
    flash_partial = {model = 'flash_b', options = {targets = {
        '^model%.language_model%.layers%.[12]%.mlp%.experts%.[01]%.gate_proj$', 'q_proj', 'f_b_proj', 'kv_b_proj',
        '^model%.language_model%.layers%.2%.mlp%.experts%.3%.down_proj$',
        '^model%.language_model%.layers%.1%.mlp%.experts%.5%.up_proj$', '^model%.language_model%.layers%.0%.mlp%.up_proj$'},
        r = 3, alpha = 5, rslora = true, seed = 9}},
}

local out = arg[1]
if not out then error('usage: lunar tests/ref/peft_cases.lua OUT', 0) end
local fixtures = (arg[0]:match('^(.*)/[^/]*$') or '.') .. '/../fixtures'
local names = {}
for name in pairs(CASES) do names[#names + 1] = name end
table.sort(names)
for _, name in ipairs(names) do
    local case = CASES[name]
    local dir = fixtures .. '/models/' .. case.model
    local model = lunar.model.load(dir)
    local set = peft.apply(model, case.options)
    local rng = lunar.rng(case.options.seed)
    for _, mod in ipairs(set.order) do
        local B = set.params:get(set.modules[mod].b_name)
        B:copy_(ops.mul(lunar.randn(B:size(), {rng = rng}), 0.2))
    end
    set:eval()
    local ref = io_.load_checkpoint(dir .. '/reference.safetensors')
    local batch = {input_ids = ref.input_ids, position_ids = ref.position_ids, attention_mask = ref.attention_mask}
    local logits = model:forward(batch, {keep = false}).logits
    local cdir = out .. '/' .. name
    os.execute(('rm -rf %q; mkdir -p %q'):format(cdir, cdir))
    local _, gaps = peft.save(model, cdir .. '/adapter', {base_model_name_or_path = dir, merged = false})
    io_.write_json(cdir .. '/case.json', {name = name, model = case.model, options = case.options, gaps = io_.array(gaps)})
    local saved = {input_ids = ref.input_ids, position_ids = ref.position_ids, logits = logits}
    if ref.attention_mask then saved.attention_mask = ref.attention_mask end
    io_.save_safetensors(cdir .. '/lunar_reference.safetensors', saved)
    print(('%s: %d adapters on %s, %d gap(s)'):format(name, #set.order, case.model, #gaps))
end
