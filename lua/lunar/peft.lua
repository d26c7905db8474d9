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
-- lora_dropout, target_modules, target_parameters, use_rslora, ... Routed experts are written per
-- expert (mlp.experts.<e>.gate_proj), the layout PEFT converts onto transformers 5's fused
-- experts. The section "files" below says how the config is chosen so that an unmodified PEFT
-- (0.21.2 on transformers 5.25) applies every adapter, and what it cannot apply: save() says so in
-- one line and writes the merged model beside the adapters.
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local io = require 'lunar.io'
local lora = require 'lunar.nn.lora'
local native = require 'lunar.peft_native'
local ops = require 'lunar.ops'

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

-- a module's name with the text tower's prefix as GLM-5's: GLM-5.3-Flash's decoder lives under
-- model.language_model. (Glm5NextForConditionalGeneration), GLM-5's and GLM-4.x's under model.
local function canon(name) return (name:gsub('^model%.language_model%.', 'model.')) end

-- the decoder layer a module belongs to, or nil
local function layer_of(name)
    local i = canon(name):match('^model%.layers%.(%d+)%.')
    return i and tonumber(i) or nil
end
M.layer_of = layer_of

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

-- tensor parallel: the model's split weights (name -> slice, lunar.model's tp_slices) and the whole
-- weights whose gradient is tp-partial (name -> true); both empty without tp
local function tp_of(m)
    if not (m and m.tp_slices and m.opts and m.opts.tp and m.opts.tp:size() > 1) then return {}, {} end
    local partial = {}
    for _, n in ipairs(m:tp_partial_params()) do partial[n] = true end
    return m:tp_slices('tp'), partial
end

-- an adapter on a tensor-parallel module: its block and gradient share (lunar.nn.lora's header)
local function mark_tp(ad, slices, partial)
    local w = ad.name .. '.weight'
    ad.tp, ad.tp_partial = slices[w], partial[w] or nil
    return ad
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
    local store, m = store_of(model)
    if store.lora then fail('peft.apply: the model already has adapters (peft.detach or peft.merge first)') end
    local slices, partial = tp_of(m)
    local r = o.r or 8
    local names, info = M.targets(model, o.targets, o)
    local set = lora.new_set{seed = o.seed or 0, dtype = o.dtype or 'f32'}
    set.config = {r = r, alpha = o.alpha or r, dropout = o.dropout or 0, rslora = o.rslora or false,
                  targets = o.targets, base_model_name_or_path = o.base_model_name_or_path}
    local init_rng = core.rng_new(set.seed):split('lora_init')
    for _, name in ipairs(names) do
        local w = store:get(name .. '.weight')
        local sl = slices[name .. '.weight']
        mark_tp(set:add(name, info[name].out, info[name]['in'], {r = r, alpha = set.config.alpha,
            dropout = set.config.dropout, rslora = set.config.rslora, init_rng = init_rng, device = w:device(),
            a_cols = sl and sl.dim == 2 and sl or nil}), slices, partial)
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
--
-- What PEFT (0.21.2, on transformers 5.25) does with an adapter_config.json, and so how save()
-- writes one (facts checked against PEFT by tests/ref/make_peft_fixtures.py and check_peft.py):
--
-- * transformers 5 fuses the routed experts of a MoE layer into two parameters,
--   mlp.experts.gate_up_proj (E, 2I, H) and mlp.experts.down_proj (E, H, I). PEFT rewrites every
--   target_modules entry that is, or ends in, gate_proj / up_proj / down_proj into target_parameters
--   gate_up_proj / down_proj, which hit the fused parameters of every MoE layer, and folds the
--   per-expert tensors of the file into one adapter per fused parameter (gate and up at rank 2r and
--   alpha 2 alpha, the same scale alpha / r). The fused adapter needs every expert of gate, up and
--   down: when any routed expert is adapted, the file holds an adapter for every routed expert of
--   every layer transformers builds, with A = B = 0 where lunar has none. Such an adapter changes
--   nothing and training never moves it (both of its gradients are zero), so load() skips it and a
--   checkpoint resumes with the adapters it had.
-- * The same rewrite takes the dense MLPs' and shared experts' gate/up/down_proj, even by full
--   module name, and their adapters are then dropped without a message (huggingface/peft#3711).
--   They are written as target_parameters '<module>.weight' instead, which PEFT applies to the
--   Linear's weight (its ParamWrapper) and loads from the same tensor names.
-- * PEFT's ParamWrapper (fused experts, target_parameters) refuses lora_dropout != 0: with either
--   in the file, lora_dropout is 0 (dropout only acts in training) unless opts.lora_dropout says
--   otherwise.
-- * Other modules go to target_modules: by their leaf name when every module with that leaf that
--   transformers builds is adapted, else by full name; dense MLP / shared-expert parameters by
--   their name within the layer ('mlp.gate_proj.weight') on the same condition.
-- * PEFT cannot apply adapters on the MTP layer (transformers builds none: PEFT drops them without
--   a message), nor, with use_rslora, on routed experts' gate_proj / up_proj (the fused pair is
--   scaled by 2 alpha / sqrt(2r), sqrt(2) times lunar's alpha / sqrt(r)).
local EXPERT = '^(model%.layers%.%d+%.mlp%.experts)%.(%d+)%.([%w_]+)$'
local MLP_LEAF = {gate_proj = true, up_proj = true, down_proj = true}

-- 'expert' (a routed expert's projection), 'mlp' (a dense MLP's or shared expert's) or 'module'
local function kind_of(name)
    name = canon(name)
    if name:find(EXPERT) then return 'expert' end
    if MLP_LEAF[name:match('([^%.]+)$')] and name:find('%.mlp%.') then return 'mlp' end
    return 'module'
end

-- the name that stands for every module like `name` in PEFT's suffix match
local function short_of(name, kind)
    if kind == 'mlp' then return (canon(name):gsub('^model%.layers%.%d+%.', '')) end
    return name:match('([^%.]+)$')
end

-- The layout of the adapter set in PEFT's terms: {target_modules, target_parameters, pads = {name
-- -> {out, in}} (zero adapters the fused experts need), gaps = {what PEFT cannot apply, ...}}
local function peft_layout(store, set, cfg)
    local n_hf = cfg and cfg.num_hidden_layers
    local function built(name) local L = layer_of(name); return not (n_hf and L and L >= n_hf) end
    local adapted = {}
    for _, name in ipairs(set.order) do adapted[name] = true end
    local list, info = candidates(store, cfg, true)
    local incomplete = {}
    for _, name in ipairs(list) do
        if built(name) and not adapted[name] then incomplete[short_of(name, kind_of(name))] = true end
    end
    local modules, params, seen = {}, {}, {}
    local function put(t, v) if not seen[v] then seen[v] = true; t[#t + 1] = v end end
    local mtp, rs_fused, experts = {}, 0, false
    for _, name in ipairs(set.order) do
        local kind = kind_of(name)
        if not built(name) then
            mtp[#mtp + 1] = name
        elseif kind == 'expert' then
            experts = true
            local leaf = name:match('([^%.]+)$')
            if set.modules[name].rslora and leaf ~= 'down_proj' then rs_fused = rs_fused + 1 end
        else
            local short = short_of(name, kind)
            local full = not incomplete[short]
            if kind == 'mlp' then put(params, (full and short or name) .. '.weight')
            else put(modules, full and short or name) end
        end
    end
    local pads = {}
    if experts then
        for _, leaf in ipairs({'down_proj', 'gate_proj', 'up_proj'}) do put(modules, leaf) end
        for _, name in ipairs(list) do
            if built(name) and kind_of(name) == 'expert' and not adapted[name] then
                pads[name] = {info[name].out, info[name]['in']}
            end
        end
    end
    local gaps = {}
    if #mtp > 0 then
        local layers, seen_l = {}, {}
        for _, name in ipairs(mtp) do
            local L = layer_of(name)
            if not seen_l[L] then seen_l[L] = true; layers[#layers + 1] = name:match('^(.-layers%.%d+)%.') end
        end
        gaps[#gaps + 1] = ('%d adapter(s) on the MTP layer (%s), which transformers does not build'):format(
            #mtp, table.concat(layers, ', '))
    end
    if rs_fused > 0 then
        gaps[#gaps + 1] = ('%d adapter(s) on routed experts\' gate_proj/up_proj with use_rslora (PEFT fuses each pair '
            .. 'at rank 2r and scales it by 2 alpha / sqrt(2r), not alpha / sqrt(r))'):format(rs_fused)
    end
    table.sort(modules)
    table.sort(params)
    return {target_modules = modules, target_parameters = params, pads = pads, gaps = gaps}
end

local function write_text(path, text, who)
    local tmp = ('%s.tmp.%d'):format(path, os.time())
    local fh = _G.io.open(tmp, 'wb')
    if not fh then fail(who .. ': cannot write ' .. tmp) end
    fh:write(text)
    fh:close()
    local ok, err = os.rename(tmp, path)
    if not ok then fail(('%s: cannot rename %s to %s: %s'):format(who, tmp, path, tostring(err))) end
end

-- peft.save(model, dir[, {base_model_name_or_path =, dtype =, lora_dropout =, merged =}]) -> dir, gaps
-- gaps lists what PEFT cannot apply (see above). When there is any, save prints one line naming it
-- and writes the merged model (peft.save_merged) to opts.merged or <dir>/merged; merged = false
-- does neither (a file only lunar reads back, such as a training checkpoint).
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
    end
    local layout, wrapped
    if native.applies(set.order) then
        layout = native.layout(store, set, {r = r, alpha = alpha, rslora = rs, dtype = o.dtype or set.dtype})
        layout.gaps = {}
        tensors, wrapped = layout.tensors, layout.wrapped
    else
        for _, name in ipairs(set.order) do
            local ad = set.modules[name]
            local A, B = set.params:get(ad.a_name), set.params:get(ad.b_name)
            tensors[PREFIX .. ad.a_name] = A:to(o.dtype or A:dtype(), 'cpu')
            tensors[PREFIX .. ad.b_name] = B:to(o.dtype or B:dtype(), 'cpu')
        end
        layout = peft_layout(store, set, m and m.cfg)
        for name, shape in pairs(layout.pads) do
            tensors[PREFIX .. name .. '.lora_A.weight'] = core.empty({r, shape[2]}, o.dtype or set.dtype, 'cpu'):fill_(0)
            tensors[PREFIX .. name .. '.lora_B.weight'] = core.empty({shape[1], r}, o.dtype or set.dtype, 'cpu'):fill_(0)
        end
        wrapped = #layout.target_parameters > 0 or next(layout.pads) ~= nil
        for _, name in ipairs(set.order) do if name:find(EXPERT) then wrapped = true break end end
    end
    if o.lora_dropout ~= nil then p = o.lora_dropout elseif wrapped then p = 0 end
    local base = o.base_model_name_or_path or (set.config and set.config.base_model_name_or_path)
        or (m and m.source and m.source.path) or io.null
    local cfg = {
        base_model_name_or_path = base, bias = 'none', fan_in_fan_out = false, inference_mode = true,
        init_lora_weights = true, lora_alpha = alpha, lora_dropout = p, modules_to_save = io.null,
        peft_type = 'LORA', r = r, revision = io.null,
        target_modules = type(layout.target_modules) == 'string' and layout.target_modules
            or io.array(layout.target_modules or {}),
        task_type = 'CAUSAL_LM', use_dora = false, use_rslora = rs,
    }
    if #layout.target_parameters > 0 then cfg.target_parameters = io.array(layout.target_parameters) end
    if layout.rank_pattern and next(layout.rank_pattern) then
        cfg.rank_pattern, cfg.alpha_pattern = layout.rank_pattern, layout.alpha_pattern
        for k in pairs(cfg.alpha_pattern) do io.mark_float(cfg.alpha_pattern, k) end
    end
    io.mark_float(cfg, 'lora_dropout')
    if alpha ~= math.floor(alpha) then io.mark_float(cfg, 'lora_alpha') end
    os.execute(('mkdir -p %q'):format(dir))
    -- PEFT writes json.dumps(indent=2, sort_keys=True) without a final newline: so do we
    write_text(dir .. '/adapter_config.json', (io.encode_json(cfg):gsub('\n$', '')), 'peft.save')
    io.save_safetensors(dir .. '/adapter_model.safetensors', tensors, {metadata = {format = 'pt'}})
    if #layout.gaps > 0 and o.merged ~= false then
        local line = 'peft.save: ' .. dir .. ': PEFT cannot apply ' .. table.concat(layout.gaps, '; ')
        if m and m.save_hf then
            local mdir = type(o.merged) == 'string' and o.merged or dir .. '/merged'
            M.save_merged(model, mdir)
            line = line .. '; the merged model is in ' .. mdir
        else
            line = line .. '; a parameter store has no merged model to write (peft.merge it into a lunar model)'
        end
        _G.io.stderr:write(line .. '\n')
    end
    return dir, layout.gaps
end

local function is_zero(t) return ops.max(ops.abs(t)):item() == 0 end

local function shape_str(t) return '(' .. table.concat(t:size(), ', ') .. ')' end

-- peft.load(model, dir[, {dtype = 'f32', seed = 0}]) -> the attached adapter set. The tensors
-- decide which modules get adapters (target_modules / target_parameters are PEFT's business); a
-- pair with A = B = 0 (save's padding of the fused experts) is skipped, and so is a module the
-- model does not have for which opts.skip(module) is true (an expert another rank holds). A
-- tensor-parallel model keeps its block of each split module's adapter.
function M.load(model, dir, o)
    o = o or {}
    local store, m = store_of(model)
    if store.lora then fail('peft.load: the model already has adapters (peft.detach or peft.merge first)') end
    local slices, partial = tp_of(m)
    local cpath = dir .. '/adapter_config.json'
    local cfg = io.read_json(cpath)
    if cfg.peft_type ~= 'LORA' then fail(('%s: peft_type %s is not LORA'):format(cpath, tostring(cfg.peft_type))) end
    if cfg.use_dora == true then fail(cpath .. ': DoRA adapters (use_dora) are not supported') end
    if cfg.fan_in_fan_out == true then fail(cpath .. ': fan_in_fan_out adapters are not supported') end
    if cfg.bias ~= nil and cfg.bias ~= 'none' then fail(('%s: bias %q is not supported (none)'):format(cpath, tostring(cfg.bias))) end
    local wpath = dir .. '/adapter_model.safetensors'
    local f = io.safetensors_open(wpath)
    local keys = f:keys()
    local names = {}
    for i, key in ipairs(keys) do names[i] = key:gsub('^base_model%.model%.', '') end
    local is_native = native.applies(names)
    if is_native then native.check_patterns(cfg, cpath) end
    for _, k in ipairs({'rank_pattern', 'alpha_pattern'}) do
        if not is_native and type(cfg[k]) == 'table' and next(cfg[k]) ~= nil then
            fail(('%s: %s is not supported'):format(cpath, k))
        end
    end
    if type(cfg.modules_to_save) == 'table' and #cfg.modules_to_save > 0 then
        fail(cpath .. ': modules_to_save is not supported')
    end
    local r, alpha = cfg.r, cfg.lora_alpha
    if type(r) ~= 'number' or type(alpha) ~= 'number' then fail(cpath .. ': r and lora_alpha must be numbers') end
    local dropout = cfg.lora_dropout
    if type(dropout) ~= 'number' then dropout = 0 end
    local pairs_ = {}
    local mods = {}
    if is_native then
        pairs_ = native.read(f, cfg, store, wpath)
        for mod in pairs(pairs_) do mods[#mods + 1] = mod end
    else
        for _, key in ipairs(keys) do
            local mod, which = key:match('^base_model%.model%.(.+)%.lora_([AB])%.weight$')
            if not mod then fail(('%s: %s is not a LoRA tensor (base_model.model.<module>.lora_A/B.weight)'):format(wpath, key)) end
            if not pairs_[mod] then pairs_[mod] = {}; mods[#mods + 1] = mod end
            pairs_[mod][which] = f:tensor(key)
        end
    end
    table.sort(mods)
    local set = lora.new_set{seed = o.seed or 0, dtype = o.dtype or 'f32'}
    set.config = {r = r, alpha = alpha, dropout = dropout, rslora = cfg.use_rslora == true,
                  base_model_name_or_path = cfg.base_model_name_or_path ~= io.null and cfg.base_model_name_or_path or nil}
    local mods_kept = {}
    for _, mod in ipairs(mods) do
        local A, B = pairs_[mod].A, pairs_[mod].B
        if not A or not B then fail(('%s: %s has lora_%s but not lora_%s'):format(wpath, mod, A and 'A' or 'B', A and 'B' or 'A')) end
        if store:has(mod .. '.weight') or not (o.skip and o.skip(mod)) then
            mods_kept[#mods_kept + 1] = mod
        end
    end
    for _, mod in ipairs(mods_kept) do
        local A, B = pairs_[mod].A, pairs_[mod].B
        if not store:has(mod .. '.weight') then fail(('%s: the model has no module %s'):format(wpath, mod)) end
        local why = not_adaptable(mod)
        if why then fail(('%s: %s is %s and cannot have a LoRA adapter'):format(wpath, mod, why)) end
        local W = store:get(mod .. '.weight')
        local out_f, in_f = W:size(1), W:size(2)
        -- tensor parallel: the file holds the whole adapter; this rank keeps its block
        local sl = slices[mod .. '.weight']
        local full_out, full_in = out_f, in_f
        if sl and sl.dim == 1 then full_out = sl.full elseif sl then full_in = sl.full end
        if A:dim() ~= 2 or A:size(1) ~= r or A:size(2) ~= full_in or B:dim() ~= 2 or B:size(1) ~= full_out or B:size(2) ~= r then
            fail(('%s: %s has lora_A %s and lora_B %s, expected (%d, %d) and (%d, %d) for r = %d and weight (%d, %d)')
                :format(wpath, mod, shape_str(A), shape_str(B), r, full_in, full_out, r, r, full_out, full_in))
        end
        -- A = B = 0: a no-op that training never moves (save pads the fused experts with them)
        if not (is_zero(A) and is_zero(B)) then
            if sl and sl.dim == 1 then B = B:narrow(1, sl.start + 1, sl.len) elseif sl then A = A:narrow(2, sl.start + 1, sl.len) end
            mark_tp(set:add(mod, out_f, in_f, {r = r, alpha = alpha, dropout = dropout, rslora = set.config.rslora,
                A = A, B = B, device = W:device()}), slices, partial)
        end
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
    out = ops.add_(out, d:to(W:device()))
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
