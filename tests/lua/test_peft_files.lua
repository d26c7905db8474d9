-- test_peft_files.lua: the adapter files lunar.peft.save writes mean in PEFT what they mean in
-- lunar.
--
--   * Against tests/fixtures/peft/cases.json, which records what an unmodified PEFT (the version
--     it names, on transformers 5.25) built from lunar's adapters (tests/ref/peft_cases.lua and
--     tests/ref/make_peft_fixtures.py): lunar still writes the same adapter_config.json and
--     tensor names; PEFT gave every tensor a LoRA parameter and every LoRA parameter a tensor,
--     except the MTP layer's, which lunar reports; PEFT's LoRA layers (modules, wrapped parameters,
--     ranks, shapes) are exactly the ones lunar's layout implies, and their scaling equals lunar's
--     wherever lunar does not report a gap; and PEFT's logits were within 1e-5 of lunar's.
--   * The zero adapters save adds for the fused experts are skipped by load: a partial choice of
--     experts reloads with the same adapters, tensors and logits.
--   * What PEFT cannot apply is reported in one line and the merged model is written beside the
--     adapters (merged = false: neither).
local lunar = require 'lunar'
local io_ = require 'lunar.io'
local peft = require 'lunar.peft'
local ops = lunar.ops
local T = require('lunar.testing').suite('peft_files')

local here = debug.getinfo(1, 'S').source:match('^@(.*)/[^/]*$') or '.'
local FIX = here .. '/../fixtures/'
local CASES = io_.read_json(FIX .. 'peft/cases.json')

local function tmpdir()
    local d = os.tmpname()
    os.remove(d)
    os.execute(('mkdir -p %q'):format(d))
    return d
end

local function exists(path)
    local f = io.open(path, 'rb')
    if f then f:close() end
    return f ~= nil
end

-- JSON values equal (tables compared key by key); on a difference, the path to it
local function diff(a, b, path)
    if type(a) ~= 'table' or type(b) ~= 'table' then
        if a == b or (type(a) == 'number' and type(b) == 'number' and math.abs(a - b) <= 1e-12 * math.abs(b)) then
            return nil
        end
        return ('%s: %s vs %s'):format(path, tostring(a), tostring(b))
    end
    for k, v in pairs(a) do
        local d = diff(v, b[k], path .. '.' .. tostring(k))
        if d then return d end
    end
    for k, v in pairs(b) do
        if a[k] == nil then return ('%s.%s: missing (fixture has %s)'):format(path, tostring(k), tostring(v)) end
    end
    return nil
end

local function build(case)
    local model = lunar.model.load(FIX .. 'models/' .. case.model)
    local set = peft.apply(model, case.options)
    return model, set
end

local function save(model, o)
    local dir = tmpdir()
    o = o or {}
    o.base_model_name_or_path = o.base_model_name_or_path or 'fixture'
    local _, gaps = peft.save(model, dir, o)
    return dir, gaps
end

local function file_keys(dir)
    local f = io_.safetensors_open(dir .. '/adapter_model.safetensors')
    local keys = f:keys()
    f:close()
    table.sort(keys)
    return keys
end

local EXPERT = '^(model%.layers%.%d+%.mlp%.experts)%.(%d+)%.([%w_]+)$'

-- The LoRA layers PEFT builds for the modules of a file, by lunar's account of PEFT's rules:
-- a Linear per attention (or other) module, a ParamWrapper on the weight of each dense MLP /
-- shared-expert projection, and per MoE layer two ParamWrappers on the fused experts:
-- gate_up_proj (gate and up side by side: rank 2r, alpha 2 alpha) and down_proj, each holding
-- every expert's A and B (r * E rows). Modules of layers transformers does not build (MTP) are
-- returned apart.
local function expected_layers(model, keys, r, alpha, rslora)
    local function scaling(a, rr) return rslora and a / math.sqrt(rr) or a / rr end
    local n_built = model.cfg.num_hidden_layers
    local mods, seen = {}, {}
    for _, k in ipairs(keys) do
        local mod = k:match('^base_model%.model%.(.+)%.lora_[AB]%.weight$')
        if not seen[mod] then seen[mod] = true; mods[#mods + 1] = mod end
    end
    local layers, mtp, moe = {}, {}, {}
    for _, mod in ipairs(mods) do
        local L = tonumber(mod:match('^model%.layers%.(%d+)%.'))
        local W = model.params:get(mod .. '.weight')
        local out_f, in_f = W:size(1), W:size(2)
        local prefix, e, leaf = mod:match(EXPERT)
        if L and L >= n_built then
            mtp[#mtp + 1] = mod
        elseif prefix then
            local g = moe[prefix] or {experts = {}, n = 0}
            moe[prefix] = g
            if not g.experts[e] then g.experts[e] = true; g.n = g.n + 1 end
            if leaf == 'gate_proj' then g.I, g.H = out_f, in_f end
        else
            local leaf_ = mod:match('([^%.]+)$')
            local wrapped = (leaf_ == 'gate_proj' or leaf_ == 'up_proj' or leaf_ == 'down_proj') and mod:find('%.mlp%.')
            layers[#layers + 1] = {module = mod, parameter = wrapped and 'weight' or '-', r = r,
                scaling = scaling(alpha, r), lora_A = {r, in_f}, lora_B = {out_f, r}}
        end
    end
    for prefix, g in pairs(moe) do
        local E = g.n
        layers[#layers + 1] = {module = prefix, parameter = 'gate_up_proj', r = 2 * r, scaling = scaling(2 * alpha, 2 * r),
            lora_A = {2 * r * E, g.H}, lora_B = {2 * g.I, 2 * r * E}}
        layers[#layers + 1] = {module = prefix, parameter = 'down_proj', r = r, scaling = scaling(alpha, r),
            lora_A = {r * E, g.I}, lora_B = {g.H, r * E}}
    end
    table.sort(layers, function(a, b) return a.module .. ' ' .. a.parameter < b.module .. ' ' .. b.parameter end)
    return layers, mtp
end

-- The same for GLM-5.3-Flash's layout (lunar.peft_native), by PEFT's rules on transformers'
-- Glm5Next model: a Linear per module of the file (transformers keeps the forget gate's
-- projections under self_attn.forget_gate), and in every MoE layer one ParamWrapper per fused
-- expert parameter of target_parameters, whether or not lunar adapted an expert there:
-- gate_up_proj at rank 2r with alpha 2 alpha (sqrt(2) alpha under rslora), down_proj at r.
local function expected_native_layers(model, cfg, keys, r, alpha, rslora)
    local function scaling(a, rr) return rslora and a / math.sqrt(rr) or a / rr end
    local layers, seen = {}, {}
    for _, k in ipairs(keys) do
        local mod = k:match('^base_model%.model%.(.+)%.lora_[AB]%.weight$')
        if not mod:find('%.mlp%.experts') and not seen[mod] then
            seen[mod] = true
            local W = model.params:get(mod:gsub('%.forget_gate%.', '.') .. '.weight')
            layers[#layers + 1] = {module = mod, parameter = '-', r = r, scaling = scaling(alpha, r),
                                   lora_A = {r, W:size(2)}, lora_B = {W:size(1), r}}
        end
    end
    local c = model.cfg
    local E, H, Im = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size
    for i, kind in ipairs(c.mlp_layer_types) do
        if kind == 'sparse' then
            local prefix = ('model.language_model.layers.%d.mlp.experts'):format(i - 1)
            for _, p in ipairs(cfg.target_parameters or {}) do
                if p == 'mlp.experts.gate_up_proj' then
                    local a2 = rslora and math.sqrt(2) * alpha or 2 * alpha
                    layers[#layers + 1] = {module = prefix, parameter = 'gate_up_proj', r = 2 * r,
                        scaling = scaling(a2, 2 * r), lora_A = {2 * r * E, H}, lora_B = {2 * Im, 2 * r * E}}
                elseif p == 'mlp.experts.down_proj' then
                    layers[#layers + 1] = {module = prefix, parameter = 'down_proj', r = r, scaling = scaling(alpha, r),
                        lora_A = {r * E, Im}, lora_B = {H, r * E}}
                end
            end
        end
    end
    table.sort(layers, function(a, b) return a.module .. ' ' .. a.parameter < b.module .. ' ' .. b.parameter end)
    return layers, {}
end

local names = {}
for name in pairs(CASES.cases) do names[#names + 1] = name end
table.sort(names)

for _, name in ipairs(names) do
    local fx = CASES.cases[name]
    T:test(('%s (PEFT %s): lunar writes what PEFT was checked with, and PEFT applies it as lunar does'):format(
        name, CASES.peft), function()
        local model, set = build(fx)
        local dir, gaps = save(model, {merged = false})
        local cfg = io_.read_json(dir .. '/adapter_config.json')
        cfg.base_model_name_or_path = nil
        local d = diff(cfg, fx.adapter_config, 'adapter_config.json')
        assert(not d, d and (d .. ' (rerun tests/ref/peft_cases.lua and make_peft_fixtures.py if the change is meant)'))
        local keys = file_keys(dir)
        d = diff(keys, fx.file_keys, 'adapter_model.safetensors')
        assert(not d, d)
        d = diff(gaps, fx.gaps, 'gaps')
        assert(not d, d)
        os.execute(('rm -rf %q'):format(dir))

        -- PEFT: every LoRA parameter got a tensor; the tensors it dropped are the MTP layer's
        local p = fx.peft
        T.equal(#p.missing_keys, 0, 'LoRA parameters without a tensor')
        local ad = set.modules[set.order[1]]
        local want, mtp
        if model.cfg.model_type == 'glm5_next' then
            want, mtp = expected_native_layers(model, fx.adapter_config, keys, ad.r, ad.alpha, ad.rslora)
        else
            want, mtp = expected_layers(model, keys, ad.r, ad.alpha, ad.rslora)
        end
        local n_built = model.cfg.num_hidden_layers
        for _, k in ipairs(p.unexpected_keys) do
            local L = tonumber(k:match('model%.layers%.(%d+)%.'))
            assert(L and L >= n_built, 'PEFT dropped ' .. k .. ', which is not on the MTP layer')
        end
        T.equal(#p.unexpected_keys > 0 and 1 or 0, #mtp > 0 and 1 or 0, 'dropped tensors iff MTP adapters')
        local mtp_gap = false
        for _, g in ipairs(gaps) do if g:find('MTP layer', 1, true) then mtp_gap = true end end
        T.equal(mtp_gap and 1 or 0, #mtp > 0 and 1 or 0, 'the MTP gap is reported iff there are MTP adapters')

        -- PEFT's layers are exactly the ones lunar's layout implies
        local got = {}
        for i, l in ipairs(p.layers) do
            got[i] = {module = l.module, parameter = io_.is_null(l.parameter) and '-' or l.parameter, r = l.r,
                      scaling = l.scaling, lora_A = l.lora_A, lora_B = l.lora_B}
        end
        T.equal(#got, #want, 'LoRA layers')
        d = diff(got, want, 'peft.layers')
        assert(not d, d)

        -- and each scales its adapters as lunar does, unless lunar reports that it does not
        local rs_gap = false
        for _, g in ipairs(gaps) do if g:find('use_rslora', 1, true) then rs_gap = true end end
        local mismatch = 0
        for _, l in ipairs(want) do
            if math.abs(l.scaling - ad.scale) > 1e-12 * ad.scale then mismatch = mismatch + 1 end
        end
        T.equal(mismatch > 0 and 1 or 0, rs_gap and 1 or 0, 'a scaling differs from lunar\'s iff the rslora gap is reported')
        if #gaps == 0 then
            assert(fx.logits_ratio <= 1e-5, ('PEFT logits ratio %g'):format(fx.logits_ratio))
        end
    end)
end

-- every B seeded random (B starts at zero, which would hide a misplaced adapter)
local function random_b(set, seed)
    for _, name in ipairs(set.order) do
        local B = set.params:get(set.modules[name].b_name)
        B:copy_(ops.mul(lunar.randn(B:size(), {rng = lunar.rng(seed)}), 0.2))
    end
end

-- the adapters in dir loaded onto a fresh copy of fx's model: the same modules and tensors as set
local function reload_same(fx, dir, set)
    local model2 = lunar.model.load(FIX .. 'models/' .. fx.model)
    local set2 = peft.load(model2, dir)
    set2:eval()
    local got, want = table.concat(set2.order, ','), table.concat(set.order, ',')
    assert(got == want, 'adapters after reload: ' .. got)
    for pname in set.params:names() do T.equal(set2.params:get(pname), set.params:get(pname), pname) end
    return model2, set2
end

T:test('zero adapters for the fused experts: written for PEFT, skipped by load (same adapters, tensors, logits)', function()
    local fx = CASES.cases.glm5_partial
    local model, set = build(fx)
    random_b(set, 5)
    set:eval()
    local dir = tmpdir()
    local ref = io_.load_checkpoint(FIX .. 'models/' .. fx.model .. '/reference.safetensors')
    local batch = {input_ids = ref.input_ids, position_ids = ref.position_ids}
    local logits = model:forward(batch, {keep = false}).logits
    peft.save(model, dir)
    -- 3 MoE layers x 8 experts x gate/up/down, of which 3 are lunar's
    T.equal(#file_keys(dir), 2 * (#set.order - 3 + 3 * 8 * 3), 'tensors in the file')
    local f = io_.safetensors_open(dir .. '/adapter_model.safetensors')
    T.equal(f:tensor('base_model.model.model.layers.3.mlp.experts.5.up_proj.lora_B.weight'), lunar.zeros(16, 2), 'a pad')
    f:close()
    local model2, set2 = reload_same(fx, dir, set)
    T.equal(model2:forward(batch, {keep = false}).logits, logits, 'logits after reload')
    os.execute(('rm -rf %q'):format(dir))
end)

T:test('GLM-5.3-Flash: the fused experts written as PEFT saves them reload as the same per-expert adapters', function()
    local fx = CASES.cases.flash_partial
    local model, set = build(fx)
    random_b(set, 5)
    set:eval()
    local dir = tmpdir()
    local ref = io_.load_checkpoint(FIX .. 'models/' .. fx.model .. '/reference.safetensors')
    local batch = {input_ids = ref.input_ids, attention_mask = ref.attention_mask}
    local logits = model:forward(batch, {keep = false}).logits
    peft.save(model, dir)
    -- expert 1 of layer 2 has a gate adapter only: its up half of gate_up_proj is zero, its gate
    -- half holds A at rows e 2r .. e 2r + r and B at columns j E + e (PEFT's ParamWrapper)
    local f = io_.safetensors_open(dir .. '/adapter_model.safetensors')
    local A = f:tensor('base_model.model.model.language_model.layers.2.mlp.experts.base_layer.lora_A.weight')
    local B = f:tensor('base_model.model.model.language_model.layers.2.mlp.experts.base_layer.lora_B.weight')
    f:close()
    local ad = set.modules['model.language_model.layers.2.mlp.experts.1.gate_proj']
    local r, E, Im = ad.r, model.cfg.n_routed_experts, model.cfg.moe_intermediate_size
    T.equal(A:narrow(1, 2 * r + 1, r), set.params:get(ad.a_name), 'gate A of expert 1')
    T.equal(A:narrow(1, 3 * r + 1, r), lunar.zeros(r, A:size(2)), 'up A of expert 1')
    local B1 = B:view(2 * Im, 2 * r, E):select(3, 2)
    T.equal(B1:narrow(1, 1, Im):narrow(2, 1, r):contiguous(), set.params:get(ad.b_name), 'gate B of expert 1')
    T.equal(B1:narrow(2, r + 1, r):contiguous(), lunar.zeros(2 * Im, r), 'up B of expert 1')
    local model2, set2 = reload_same(fx, dir, set)
    T.equal(set2.modules[set2.order[1]].scale, set.modules[set.order[1]].scale, 'scale (rslora)')
    T.equal(model2:forward(batch, {keep = false}).logits, logits, 'logits after reload')
    -- a rank pattern lunar did not write is refused, naming it
    local cfg = io_.read_json(dir .. '/adapter_config.json')
    cfg.rank_pattern['.*\\.gate_up_proj'] = 4
    io_.write_json(dir .. '/adapter_config.json', cfg)
    T.raises(function() peft.load(lunar.model.load(FIX .. 'models/' .. fx.model), dir) end,
        'rank_pattern {".*\\\\.gate_up_proj": 4} is not supported')
    os.execute(('rm -rf %q'):format(dir))
end)

T:test('what PEFT cannot apply: one line at save time and the merged model beside the adapters', function()
    local fx = CASES.cases.glm5_mtp
    local model, set = build(fx)
    random_b(set, 6)
    local lines = {}
    local stderr = io.stderr
    io.stderr = {write = function(_, s) lines[#lines + 1] = s end}
    local ok, err = pcall(save, model)
    io.stderr = stderr
    assert(ok, err)
    local dir = err
    T.equal(#lines, 1, 'one line')
    assert(lines[1]:find('PEFT cannot apply 32 adapter(s) on the MTP layer (model.layers.2), which transformers does '
        .. 'not build; the merged model is in ' .. dir .. '/merged\n', 1, true), lines[1])
    local merged = lunar.model.load(dir .. '/merged')
    for _, name in ipairs(set.order) do
        local want = ops.add(model.params:get(name .. '.weight'), require('lunar.nn.lora').delta(set.modules[name]))
        T.close(merged.params:get(name .. '.weight'), want, {rtol = 1e-6, atol = 1e-7, msg = name})
    end
    os.execute(('rm -rf %q'):format(dir))
    -- merged = false (a checkpoint only lunar reads): no line, no merged model
    lines = {}
    io.stderr = {write = function(_, s) lines[#lines + 1] = s end}
    ok, err = pcall(save, model, {merged = false})
    io.stderr = stderr
    assert(ok, err)
    T.equal(#lines, 0, 'no line')
    assert(not exists(err .. '/merged/config.json'), 'no merged model')
    os.execute(('rm -rf %q'):format(err))
end)

os.exit(T:run())
