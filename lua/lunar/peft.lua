-- lunar.peft: LoRA fine-tuning of a lunar model, with Hugging Face PEFT's adapter files.
--
--   local peft = require 'lunar.peft'
--   local set = peft.apply(model, {r = 8, alpha = 16, dropout = 0.05, seed = 1,
--                                  targets = {'q_a_proj', 'kv_b_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj'}})
--   local opt = lunar.optim.AdamW.new(set.params, {lr = 1e-4})    -- adapters only
--   ... model:forward / model:backward / opt:step ...
--   peft.save(model, 'out/adapter')              -- adapter_config.json + adapter_model.safetensors
--   peft.load(model, 'out/adapter')              -- onto a model without adapters
--   peft.save_merged(model, 'out/merged')        -- HF checkpoint with W + s B A; the model unchanged
--   peft.merge(model)                            -- fold into the weights in place, drop the adapters
--
-- `model` is a lunar.model (or a bare parameter store, lunar.nn.params, for save/load/merge).
--
-- Targets (opts.targets, a list): a plain string t matches the modules named t or ending in
-- '.' .. t, as PEFT's target_modules list does ('q_a_proj', 'mlp.experts.3.down_proj'); a string
-- starting with '^' is a Lua pattern matched against the full module name
-- ('^model%.layers%.[0-3]%.self_attn%.'); 'all-linear' is every linear map except lm_head.
-- opts.exclude takes the same forms. The candidates are the model's linear maps: MLA / GQA
-- projections, dense MLPs, shared experts, every routed expert's gate/up/down_proj, lm_head and
-- the MTP layer's (only with opts.include_mtp: HF has no MTP layer, so PEFT cannot load them).
-- Not adaptable (an error when a target names them): embeddings, the MoE router (mlp.gate) and
-- the DSA indexer (it gets no gradient from the LM loss).
--
-- apply() freezes every base parameter (their trainable flags come back on merge/detach), builds
-- a lunar.nn.lora set with A kaiming-uniform (seeded by opts.seed and the module name) and B
-- zero, and attaches it to the model's store: the forward and backward of the model then include
-- the adapters (lunar.nn.Linear and lunar.nn.MoE run them), and gradients go only to set.params.
--
-- File format (PEFT's): adapter_model.safetensors holds base_model.model.<module>.lora_A.weight
-- (r, in) and .lora_B.weight (out, r); adapter_config.json has peft_type LORA, r, lora_alpha,
-- lora_dropout, target_modules, use_rslora, ... Routed experts are written per expert
-- (mlp.experts.<e>.gate_proj), the layout PEFT converts onto transformers 5's fused experts;
-- PEFT can load them only for every expert of a layer, gate_proj together with up_proj, and with
-- lora_dropout 0 (which save writes when experts are adapted). PEFT 0.21.2 also drops adapters on
-- dense MLPs and shared experts in that conversion (huggingface/peft#3711); lunar writes those
-- by full module name, the form the proposed fix keeps.
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local io = require 'lunar.io'
local lora = require 'lunar.nn.lora'

local fail = tensor.fail

local M = {}

local PREFIX = 'base_model.model.'

local function store_of(m)
    if type(m) == 'table' and m.params and type(m.params.names) == 'function' then return m.params, m end
    if type(m) == 'table' and type(m.names) == 'function' and m.tensors then return m, nil end
    fail('peft: expected a lunar model or a parameter store, got a ' .. type(m))
end

-- why a module with a 2-D weight cannot carry an adapter, or nil
local function not_adaptable(name)
    if name:find('embed_tokens$') then return 'an embedding' end
    if name:find('%.mlp%.gate$') then return 'the MoE router' end
    if name:find('%.indexer%.') then return 'part of the DSA indexer (no gradient from the LM loss)' end
    return nil
end

local function layer_of(name)
    local i = name:match('^model%.layers%.(%d+)%.')
    return i and tonumber(i) or nil
end

-- candidate modules: name -> {out =, ['in'] =, why = reason it cannot be adapted or nil}
local function candidates(store, cfg, include_mtp)
    local list, info = {}, {}
    for pname in store:names() do
        local mod = pname:match('^(.*)%.weight$')
        local t = store:get(pname)
        if mod and t:dim() == 2 then
            local L = layer_of(mod)
            local mtp = cfg and L and L >= cfg.num_hidden_layers
            if not mtp or include_mtp then
                list[#list + 1] = mod
                info[mod] = {out = t:size(1), ['in'] = t:size(2), why = not_adaptable(mod)}
            end
        end
    end
    return list, info
end

local function matcher(t)
    if type(t) ~= 'string' or t == '' then fail('peft: a target must be a non-empty string, got ' .. tostring(t)) end
    if t:sub(1, 1) == '^' then return function(name) return name:find(t) ~= nil end end
    local suffix = '.' .. t
    return function(name) return name == t or name:sub(-#suffix) == suffix end
end

-- peft.targets(model, targets[, {exclude =, include_mtp =}]) -> sorted module names
function M.targets(model, targets, o)
    o = o or {}
    local store, m = store_of(model)
    if type(targets) == 'string' then targets = {targets} end
    if type(targets) ~= 'table' or #targets == 0 then fail('peft: targets must be a non-empty list of module names or patterns') end
    local list, info = candidates(store, m and m.cfg, o.include_mtp)
    local excl = {}
    for _, e in ipairs(o.exclude or {}) do excl[#excl + 1] = matcher(e) end
    local chosen, seen = {}, {}
    for _, t in ipairs(targets) do
        local hit = 0
        local f = t == 'all-linear' and function(name) return name ~= 'lm_head' and not info[name].why end or matcher(t)
        for _, name in ipairs(list) do
            if f(name) then
                local skip = false
                for _, x in ipairs(excl) do if x(name) then skip = true break end end
                if not skip then
                    if info[name].why then
                        fail(('peft: target %q matches %s, which is %s and cannot have a LoRA adapter'):format(t, name, info[name].why))
                    end
                    hit = hit + 1
                    if not seen[name] then seen[name] = true; chosen[#chosen + 1] = name end
                end
            end
        end
        if hit == 0 then fail(('peft: target %q matches no linear module of the model'):format(t)) end
    end
    table.sort(chosen)
    return chosen, info
end

local function freeze(store, set)
    set.base_trainable = set.base_trainable or {}
    for name in store:names() do
        if set.base_trainable[name] == nil then set.base_trainable[name] = store:is_trainable(name) end
        store:set_trainable(name, false)
    end
end

local function unfreeze(store, set)
    for name, on in pairs(set.base_trainable or {}) do
        if store:has(name) then store:set_trainable(name, on) end
    end
end

-- peft.apply(model, {targets =, r = 8, alpha = 8, dropout = 0, rslora = false, seed = 0,
-- exclude =, include_mtp = false, dtype = 'f32'}) -> the attached adapter set
function M.apply(model, o)
    o = o or {}
    local store = store_of(model)
    if store.lora then fail('peft.apply: the model already has adapters (peft.detach or peft.merge first)') end
    local r = o.r or 8
    local names, info = M.targets(model, o.targets, o)
    local set = lora.new_set{seed = o.seed or 0, dtype = o.dtype or 'f32'}
    set.config = {r = r, alpha = o.alpha or r, dropout = o.dropout or 0, rslora = o.rslora or false,
                  targets = o.targets, base_model_name_or_path = o.base_model_name_or_path}
    local init_rng = core.rng_new(set.seed):split('lora_init')
    for _, name in ipairs(names) do
        local w = store:get(name .. '.weight')
        set:add(name, info[name].out, info[name]['in'], {r = r, alpha = set.config.alpha, dropout = set.config.dropout,
            rslora = set.config.rslora, init_rng = init_rng, device = w:device()})
    end
    freeze(store, set)
    lora.attach(store, set)
    return set
end

-- The adapter set of a model (nil when none)
function M.adapters(model) return (store_of(model)).lora end

-- peft.detach(model): remove the adapters without merging; base parameters trainable again
function M.detach(model)
    local store = store_of(model)
    local set = store.lora
    if not set then return nil end
    lora.detach(store)
    unfreeze(store, set)
    return set
end

-- ---- files --------------------------------------------------------------------------------------

-- target_modules for adapter_config.json, written so that PEFT on transformers 5 targets what
-- lunar adapted: routed experts as the bare leaf (gate_proj, up_proj, down_proj: PEFT maps bare
-- names onto the fused expert parameters); dense MLP and shared-expert projections always by
-- full module name (a bare gate_proj would be taken for the experts); any other module by its
-- leaf when every candidate with that leaf is adapted, else by full name.
local MLP_LEAF = {gate_proj = true, up_proj = true, down_proj = true}

local function target_modules(store, set, cfg)
    local adapted, out, seen = {}, {}, {}
    local function put(v) if not seen[v] then seen[v] = true; out[#out + 1] = v end end
    for _, name in ipairs(set.order) do adapted[name] = true end
    local incomplete = {}
    for _, name in ipairs((candidates(store, cfg, true))) do
        if not adapted[name] then incomplete[name:match('([^%.]+)$')] = true end
    end
    for _, name in ipairs(set.order) do
        local leaf = name:match('([^%.]+)$')
        if name:find('%.experts%.%d+%.') then put(leaf)
        elseif MLP_LEAF[leaf] or incomplete[leaf] then put(name)
        else put(leaf) end
    end
    table.sort(out)
    return out
end

-- peft.save(model, dir[, {base_model_name_or_path =, dtype =, lora_dropout =}])
function M.save(model, dir, o)
    o = o or {}
    local store, m = store_of(model)
    local set = store.lora
    if not set then fail('peft.save: the model has no adapters') end
    if #set.order == 0 then fail('peft.save: the adapter set is empty') end
    local r, alpha, p, rs
    local tensors = {}
    for _, name in ipairs(set.order) do
        local ad = set.modules[name]
        if r and (ad.r ~= r or ad.alpha ~= alpha or ad.dropout ~= p or ad.rslora ~= rs) then
            fail(('peft.save: adapters with different r/alpha/dropout (%s) cannot share one adapter_config.json'):format(name))
        end
        r, alpha, p, rs = ad.r, ad.alpha, ad.dropout, ad.rslora
        local A, B = set.params:get(ad.a_name), set.params:get(ad.b_name)
        tensors[PREFIX .. ad.a_name] = A:to(o.dtype or A:dtype(), 'cpu')
        tensors[PREFIX .. ad.b_name] = B:to(o.dtype or B:dtype(), 'cpu')
    end
    -- PEFT wraps transformers 5's fused experts in a ParamWrapper, which refuses lora_dropout != 0:
    -- with routed experts adapted the file says 0 (dropout only matters in training) unless
    -- opts.lora_dropout says otherwise
    local has_experts = false
    for _, name in ipairs(set.order) do if name:find('%.experts%.%d+%.') then has_experts = true break end end
    if o.lora_dropout ~= nil then p = o.lora_dropout elseif has_experts then p = 0 end
    local base = o.base_model_name_or_path or (set.config and set.config.base_model_name_or_path)
        or (m and m.source and m.source.path) or io.null
    local cfg = {
        base_model_name_or_path = base, bias = 'none', fan_in_fan_out = false, inference_mode = true,
        init_lora_weights = true, lora_alpha = alpha, lora_dropout = p, modules_to_save = io.null,
        peft_type = 'LORA', r = r, revision = io.null,
        target_modules = io.array(target_modules(store, set, m and m.cfg)),
        task_type = 'CAUSAL_LM', use_dora = false, use_rslora = rs,
    }
    io.mark_float(cfg, 'lora_dropout')
    if alpha ~= math.floor(alpha) then io.mark_float(cfg, 'lora_alpha') end
    os.execute(('mkdir -p %q'):format(dir))
    -- PEFT writes json.dumps(indent=2, sort_keys=True) without a final newline: so do we
    local text = io.encode_json(cfg):gsub('\n$', '')
    local path = dir .. '/adapter_config.json'
    local tmp = ('%s.tmp.%d'):format(path, os.time())
    local fh = _G.io.open(tmp, 'wb')
    if not fh then fail('peft.save: cannot write ' .. tmp) end
    fh:write(text)
    fh:close()
    local ok, err = os.rename(tmp, path)
    if not ok then fail(('peft.save: cannot rename %s to %s: %s'):format(tmp, path, tostring(err))) end
    io.save_safetensors(dir .. '/adapter_model.safetensors', tensors, {metadata = {format = 'pt'}})
    return dir
end

local function shape_str(t) return '(' .. table.concat(t:size(), ', ') .. ')' end

-- peft.load(model, dir[, {dtype = 'f32', seed = 0}]) -> the attached adapter set
function M.load(model, dir, o)
    o = o or {}
    local store = store_of(model)
    if store.lora then fail('peft.load: the model already has adapters (peft.detach or peft.merge first)') end
    local cpath = dir .. '/adapter_config.json'
    local cfg = io.read_json(cpath)
    if cfg.peft_type ~= 'LORA' then fail(('%s: peft_type %s is not LORA'):format(cpath, tostring(cfg.peft_type))) end
    if cfg.use_dora == true then fail(cpath .. ': DoRA adapters (use_dora) are not supported') end
    if cfg.fan_in_fan_out == true then fail(cpath .. ': fan_in_fan_out adapters are not supported') end
    if cfg.bias ~= nil and cfg.bias ~= 'none' then fail(('%s: bias %q is not supported (none)'):format(cpath, tostring(cfg.bias))) end
    for _, k in ipairs({'rank_pattern', 'alpha_pattern'}) do
        if type(cfg[k]) == 'table' and next(cfg[k]) ~= nil then fail(('%s: %s is not supported'):format(cpath, k)) end
    end
    if type(cfg.modules_to_save) == 'table' and #cfg.modules_to_save > 0 then
        fail(cpath .. ': modules_to_save is not supported')
    end
    local r, alpha = cfg.r, cfg.lora_alpha
    if type(r) ~= 'number' or type(alpha) ~= 'number' then fail(cpath .. ': r and lora_alpha must be numbers') end
    local dropout = cfg.lora_dropout
    if type(dropout) ~= 'number' then dropout = 0 end
    local wpath = dir .. '/adapter_model.safetensors'
    local f = io.safetensors_open(wpath)
    local pairs_ = {}
    local mods = {}
    for _, key in ipairs(f:keys()) do
        local mod, which = key:match('^base_model%.model%.(.+)%.lora_([AB])%.weight$')
        if not mod then fail(('%s: %s is not a LoRA tensor (base_model.model.<module>.lora_A/B.weight)'):format(wpath, key)) end
        if not pairs_[mod] then pairs_[mod] = {}; mods[#mods + 1] = mod end
        pairs_[mod][which] = f:tensor(key)
    end
    table.sort(mods)
    local set = lora.new_set{seed = o.seed or 0, dtype = o.dtype or 'f32'}
    set.config = {r = r, alpha = alpha, dropout = dropout, rslora = cfg.use_rslora == true,
                  base_model_name_or_path = cfg.base_model_name_or_path ~= io.null and cfg.base_model_name_or_path or nil}
    for _, mod in ipairs(mods) do
        local A, B = pairs_[mod].A, pairs_[mod].B
        if not A or not B then fail(('%s: %s has lora_%s but not lora_%s'):format(wpath, mod, A and 'A' or 'B', A and 'B' or 'A')) end
        if not store:has(mod .. '.weight') then fail(('%s: the model has no module %s'):format(wpath, mod)) end
        local why = not_adaptable(mod)
        if why then fail(('%s: %s is %s and cannot have a LoRA adapter'):format(wpath, mod, why)) end
        local W = store:get(mod .. '.weight')
        local out_f, in_f = W:size(1), W:size(2)
        if A:dim() ~= 2 or A:size(1) ~= r or A:size(2) ~= in_f or B:dim() ~= 2 or B:size(1) ~= out_f or B:size(2) ~= r then
            fail(('%s: %s has lora_A %s and lora_B %s, expected (%d, %d) and (%d, %d) for r = %d and weight %s'):format(
                wpath, mod, shape_str(A), shape_str(B), r, in_f, out_f, r, r, shape_str(W)))
        end
        set:add(mod, out_f, in_f, {r = r, alpha = alpha, dropout = dropout, rslora = set.config.rslora, A = A, B = B,
            device = W:device()})
    end
    f:close()
    freeze(store, set)
    lora.attach(store, set)
    return set
end

-- ---- merging ------------------------------------------------------------------------------------

-- the merged weight of one adapter: W + s B A, in W's dtype
local function merged_weight(store, ad)
    local W = store:get(ad.name .. '.weight')
    local d = lora.delta(ad)
    local out = core.convert(W, 'f32')
    out = require('lunar.ops').add_(out, d:to(W:device()))
    return out:to(W:dtype())
end

-- peft.merge(model): W += s B A for every adapter, then detach (base trainable flags restored)
function M.merge(model)
    local store = store_of(model)
    local set = store.lora
    if not set then fail('peft.merge: the model has no adapters') end
    for _, name in ipairs(set.order) do
        local ad = set.modules[name]
        store:get(name .. '.weight'):copy_(merged_weight(store, ad))
    end
    M.detach(model)
    return model
end

-- peft.save_merged(model, dir[, save_hf opts]): an HF checkpoint of the merged weights; the model
-- keeps its base weights and adapters
function M.save_merged(model, dir, o)
    local store, m = store_of(model)
    if not m or not m.save_hf then fail('peft.save_merged: expected a lunar model (with save_hf)') end
    local set = store.lora
    if not set then fail('peft.save_merged: the model has no adapters') end
    local orig = {}
    for _, name in ipairs(set.order) do
        local wname = name .. '.weight'
        local merged = core.persist(merged_weight(store, set.modules[name]))
        merged:set_name(wname)
        orig[wname] = store.tensors[wname]
        store.tensors[wname] = merged
    end
    local ok, err = pcall(m.save_hf, m, dir, o)
    for wname, t in pairs(orig) do
        store.tensors[wname]:free()
        store.tensors[wname] = t
    end
    if not ok then error(err, 0) end
    return dir
end

return M
