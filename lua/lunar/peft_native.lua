-- lunar.peft_native: PEFT's adapter layout for a model whose text tower lives under
-- model.language_model. and whose routed experts transformers 5 keeps fused (GLM-5.3-Flash,
-- glm5_next). PEFT 0.21 converts per-expert adapters onto fused experts only for the model types
-- in transformers' v4 conversion table, which glm5_next is not in, so lunar writes the adapters
-- as PEFT itself saves them on that model (lunar.peft calls this module; the GLM-5 / GLM-4.x
-- layout stays in lunar.peft):
--
--   modules   base_model.model.<object name>.lora_A/B.weight, the object's names being the
--             checkpoint's but where transformers' model renames a module (the forget gate's
--             f_a_proj / f_b_proj sit under self_attn.forget_gate); target_modules is one regex
--             anchored on the text tower, since PEFT's suffix match would also take the vision
--             tower's gate_proj / up_proj / down_proj
--   experts   one adapter per fused parameter (target_parameters mlp.experts.gate_up_proj,
--             mlp.experts.down_proj; PEFT nests the second wrapper around the first, so the
--             first's tensors are under experts.base_layer.), with A (E r', in) expert-major
--             and B (out, r' E) whose column j E + e is expert e's rank j (PEFT's ParamWrapper).
--             gate_up_proj holds the gate and up adapters of each expert as one of rank 2r with
--             B block-diagonal (rank_pattern 2r; alpha_pattern 2 alpha keeps alpha / r, or
--             sqrt(2) alpha under rslora keeps alpha / sqrt(r)); experts and layers without an
--             adapter get zeros, since PEFT wraps every layer's fused parameter
--
-- ParamWrapper refuses dropout, so a file with expert adapters says lora_dropout 0 (lunar's own
-- checkpoints keep the real value).
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local fparams = require 'lunar.model.glm5_next_params'

local fail = tensor.fail

local M = {}

local PREFIX = 'base_model.model.'
local TEXT = '^model%.language_model%.'
local EXPERT = '^(model%.language_model%.layers%.%d+%.mlp%.experts)%.(%d+)%.([%w_]+)$'
local LAYER = '^model%.language_model%.layers%.(%d+)%.(.+)$'
local FUSED = {gate_up_proj = 'mlp.experts.gate_up_proj', down_proj = 'mlp.experts.down_proj'}
local FUSED_ORDER = {'gate_up_proj', 'down_proj'}

-- does this adapter set (module names) use the layout?
function M.applies(names)
    for _, n in ipairs(names) do if n:find(TEXT) then return true end end
    return false
end

local function ends(s, e) return #s >= #e and s:sub(-#e) == e end

local function object_name(name)
    for _, r in ipairs(fparams.MODULE_RENAMES) do
        if ends(name, r[1]) then return name:sub(1, -#r[1] - 1) .. r[2] end
    end
    return name
end

local function checkpoint_name(name)
    for _, r in ipairs(fparams.MODULE_RENAMES) do
        if ends(name, r[2]) then return name:sub(1, -#r[2] - 1) .. r[1] end
    end
    return name
end

local function esc(s) return (s:gsub('%.', '\\.')) end

-- every expert container of the store: container -> {E =, H =, Im =}
local function expert_blocks(store)
    local blocks = {}
    for pname in store:names() do
        local c, e, leaf = pname:match('^(model%.language_model%.layers%.%d+%.mlp%.experts)%.(%d+)%.([%w_]+)%.weight$')
        if c then
            local b = blocks[c] or {E = 0}
            blocks[c] = b
            b.E = math.max(b.E, tonumber(e) + 1)
            if leaf == 'down_proj' then
                local t = store:get(pname)
                b.H, b.Im = t:size(1), t:size(2)
            end
        end
    end
    return blocks
end

local function rank_of(which, r) return which == 'gate_up_proj' and 2 * r or r end

-- the tensors' key of a fused parameter: listed in order, the first innermost
local function fused_key(container, k, n, ab)
    return PREFIX .. container .. ('.base_layer'):rep(n - k) .. '.lora_' .. ab .. '.weight'
end

-- layout(store, set, {r =, alpha =, rslora =, dtype =}) -> {tensors =, target_modules =,
-- target_parameters =, rank_pattern =, alpha_pattern =, wrapped =}
function M.layout(store, set, o)
    local r, dt = o.r, o.dtype
    local tensors = {}
    local experts, by_short, present = {}, {}, {}
    for _, name in ipairs(set.order) do
        local c, e, leaf = name:match(EXPERT)
        if c then
            experts[c] = experts[c] or {}
            experts[c][#experts[c] + 1] = {e = tonumber(e), leaf = leaf, ad = set.modules[name]}
        else
            local ad = set.modules[name]
            local key = PREFIX .. object_name(name)
            tensors[key .. '.lora_A.weight'] = set.params:get(ad.a_name):to(dt, 'cpu')
            tensors[key .. '.lora_B.weight'] = set.params:get(ad.b_name):to(dt, 'cpu')
            local layer, short = object_name(name):match(LAYER)
            if layer then
                by_short[short] = by_short[short] or {}
                by_short[short][#by_short[short] + 1] = tonumber(layer)
            else
                by_short[name] = false
            end
        end
    end
    -- the layers where each module exists, to write a short regex when every one is adapted
    for pname in store:names() do
        local mod = pname:match('^(.*)%.weight$')
        if mod then
            local layer, short = object_name(mod):match(LAYER)
            if layer then present[short] = (present[short] or 0) + 1 end
        end
    end
    local alts = {}
    for short, layers in pairs(by_short) do
        if layers == false then
            alts[#alts + 1] = esc(short)
        elseif #layers == present[short] then
            alts[#alts + 1] = 'model\\.language_model\\.layers\\.\\d+\\.' .. esc(short)
        else
            table.sort(layers)
            for i, l in ipairs(layers) do layers[i] = tostring(l) end
            alts[#alts + 1] = 'model\\.language_model\\.layers\\.(?:' .. table.concat(layers, '|') .. ')\\.' .. esc(short)
        end
    end
    table.sort(alts)
    -- the fused experts
    local used = {}
    for _, list in pairs(experts) do
        for _, x in ipairs(list) do used[x.leaf == 'down_proj' and 'down_proj' or 'gate_up_proj'] = true end
    end
    local listed = {}
    for _, w in ipairs(FUSED_ORDER) do if used[w] then listed[#listed + 1] = w end end
    local blocks = expert_blocks(store)
    for c, b in pairs(blocks) do
        for k, w in ipairs(listed) do
            local rr = rank_of(w, r)
            local in_f = w == 'down_proj' and b.Im or b.H
            local out_f = w == 'down_proj' and b.H or 2 * b.Im
            local A = core.empty({b.E * rr, in_f}, dt, 'cpu'):fill_(0)
            local B = core.empty({out_f, rr * b.E}, dt, 'cpu'):fill_(0)
            local B3 = B:view(out_f, rr, b.E)
            for _, x in ipairs(experts[c] or {}) do
                local mine = (w == 'down_proj') == (x.leaf == 'down_proj')
                if mine then
                    -- gate: ranks [0, r) and rows [0, Im); up: ranks [r, 2r) and rows [Im, 2 Im)
                    local j0 = x.leaf == 'up_proj' and r or 0
                    local row0 = x.leaf == 'up_proj' and b.Im or 0
                    local rows = w == 'down_proj' and b.H or b.Im
                    A:narrow(1, x.e * rr + j0 + 1, r):copy_(set.params:get(x.ad.a_name):to(dt, 'cpu'))
                    B3:select(3, x.e + 1):narrow(1, row0 + 1, rows):narrow(2, j0 + 1, r)
                        :copy_(set.params:get(x.ad.b_name):to(dt, 'cpu'))
                end
            end
            tensors[fused_key(c, k, #listed, 'A')] = A
            tensors[fused_key(c, k, #listed, 'B')] = B
        end
    end
    local params, rank_pattern, alpha_pattern = {}, {}, {}
    for _, w in ipairs(listed) do
        params[#params + 1] = FUSED[w]
        if w == 'gate_up_proj' then
            rank_pattern['.*\\.gate_up_proj'] = 2 * r
            alpha_pattern['.*\\.gate_up_proj'] = o.rslora and math.sqrt(2) * o.alpha or 2 * o.alpha
        end
    end
    return {tensors = tensors, target_modules = #alts > 0 and '(?:' .. table.concat(alts, '|') .. ')' or nil,
            target_parameters = params, rank_pattern = rank_pattern, alpha_pattern = alpha_pattern,
            wrapped = #listed > 0}
end

-- the rank and alpha patterns this layout writes, and nothing else, are understood
function M.check_patterns(cfg, cpath)
    local r, alpha = cfg.r, cfg.lora_alpha
    for _, k in ipairs({'rank_pattern', 'alpha_pattern'}) do
        local t = cfg[k]
        if type(t) == 'table' then
            for key, v in pairs(t) do
                local want = k == 'rank_pattern' and 2 * r
                    or (cfg.use_rslora == true and math.sqrt(2) * alpha or 2 * alpha)
                if key ~= '.*\\.gate_up_proj' or type(v) ~= 'number' or math.abs(v - want) > 1e-9 * math.abs(want) then
                    fail(('%s: %s {%q: %s} is not supported (only the fused experts\' gate_up_proj at %s)'):format(
                        cpath, k, key, tostring(v), tostring(want)))
                end
            end
        end
    end
end

-- read(f, cfg, store, wpath) -> {module -> {A =, B =}} in lunar's per-module form: the object's
-- names back to the checkpoint's, the fused experts split per expert
function M.read(f, cfg, store, wpath)
    local listed = {}
    for _, p in ipairs(type(cfg.target_parameters) == 'table' and cfg.target_parameters or {}) do
        for _, w in ipairs(FUSED_ORDER) do if p == FUSED[w] then listed[#listed + 1] = w end end
    end
    local blocks = expert_blocks(store)
    local out = {}
    for _, key in ipairs(f:keys()) do
        local mod, which = key:match('^base_model%.model%.(.+)%.lora_([AB])%.weight$')
        if not mod then fail(('%s: %s is not a LoRA tensor (base_model.model.<module>.lora_A/B.weight)'):format(wpath, key)) end
        local c, nest = mod:match('^(model%.language_model%.layers%.%d+%.mlp%.experts)(.*)$')
        local rest, depth = (nest or ''):gsub('%.base_layer', '')
        if c and rest == '' then
            local w = listed[#listed - depth]
            local b = blocks[c]
            if not w or not b then
                fail(('%s: %s: no fused expert parameter of the model is listed for it in target_parameters'):format(wpath, key))
            end
            local t = f:tensor(key)
            local rr = rank_of(w, cfg.r)
            local in_f = w == 'down_proj' and b.Im or b.H
            local out_f = w == 'down_proj' and b.H or 2 * b.Im
            local want = which == 'A' and {b.E * rr, in_f} or {out_f, rr * b.E}
            if t:dim() ~= 2 or t:size(1) ~= want[1] or t:size(2) ~= want[2] then
                fail(('%s: %s has shape (%s), expected (%d, %d) for %s of %d experts at rank %d'):format(wpath, key,
                    table.concat(t:size(), ', '), want[1], want[2], FUSED[w], b.E, rr))
            end
            local leaves = w == 'down_proj' and {'down_proj'} or {'gate_proj', 'up_proj'}
            for _, leaf in ipairs(leaves) do
                local j0 = leaf == 'up_proj' and cfg.r or 0
                local row0 = leaf == 'up_proj' and b.Im or 0
                local rows = w == 'down_proj' and b.H or b.Im
                for e = 0, b.E - 1 do
                    local m = ('%s.%d.%s'):format(c, e, leaf)
                    out[m] = out[m] or {}
                    if which == 'A' then
                        out[m].A = t:narrow(1, e * rr + j0 + 1, cfg.r):contiguous()
                    else
                        out[m].B = t:view(out_f, rr, b.E):select(3, e + 1):narrow(1, row0 + 1, rows)
                            :narrow(2, j0 + 1, cfg.r):contiguous()
                    end
                end
            end
        else
            local m = checkpoint_name(mod)
            out[m] = out[m] or {}
            out[m][which] = f:tensor(key)
        end
    end
    return out
end

return M
