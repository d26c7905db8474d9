-- lunar.train.recipe_diff: what a checkpoint records of the recipe that wrote it, and how a
-- resumed run's recipe differs from it.
--
--   local snap = recipe_diff.snapshot(cfg)           -- {['optim.lr'] = '0.0025', ...}
--   local diffs = recipe_diff.compare(saved, snap)   -- {{key =, old =, new =, breaking = why | nil}, ...}
--
-- A snapshot flattens the recipe to dotted keys with canonical string values (numbers with 17
-- significant digits trimmed, lists joined, paths made absolute), so it survives the JSON of the
-- checkpoint unchanged. Settings that only say how a run reports or where it writes (quiet,
-- threads, metrics.*, output.*, checkpoint.*, ...) are left out. A difference is `breaking` when
-- the resumed run could not be the continuation of the one that wrote the checkpoint: the data
-- and its order (data.*), the model (model.* but the device), the tokenizer, the adapters (peft.*)
-- and the batch (train.grad_accum). Others (the learning rate, the schedule, train.steps) change
-- the rest of the run on purpose and are only reported.
local core = require 'lunar.core'

local M = {}

-- top-level settings and sections that a snapshot leaves out
local IGNORED = {name = true, preset = true, plan = true, quiet = true, threads = true, stop_after = true,
    expect_loss_fall = true, notes = true, kind = true, metrics = true, output = true, checkpoint = true,
    hardware = true, silent = true, single_rank = true}
-- model settings that do not change what is computed
local IGNORED_KEYS = {['model.device'] = true, ['model.hf_id'] = true, ['model.strict'] = true,
    ['data.max_rejected'] = true, ['data.valid'] = true, ['train.log_every'] = true, ['train.eval_every'] = true,
    ['train.eval_batches'] = true, ['train.max_skipped_in_a_row'] = true, ['parallel.bucket_mb'] = true}
local PATH_KEYS = {tokenizer = true, ['model.path'] = true, ['data.train'] = true}

-- the shortest decimal that reads back as the number
local number_string = require('lunar.train.metrics').json_number

local function is_list(t)
    if type(t) ~= 'table' then return false end
    local n = 0
    for _ in pairs(t) do n = n + 1 end
    return n == #t
end

local function scalar_string(v, key)
    if type(v) == 'number' then return number_string(v) end
    if type(v) == 'string' and PATH_KEYS[key] then return core.fs.realpath(v) or v end
    return tostring(v)
end

-- snapshot(cfg) -> {dotted key = string}
function M.snapshot(cfg)
    local out = {}
    local function walk(t, prefix)
        for k, v in pairs(t) do
            local key = prefix and (prefix .. '.' .. tostring(k)) or tostring(k)
            if not (prefix == nil and IGNORED[k]) and not IGNORED_KEYS[key] then
                if is_list(v) and #v > 0 and type(v[1]) ~= 'table' then
                    local parts = {}
                    for i, x in ipairs(v) do parts[i] = scalar_string(x, key) end
                    out[key] = '[' .. table.concat(parts, ', ') .. ']'
                elseif type(v) == 'table' then
                    walk(v, key)
                else
                    out[key] = scalar_string(v, key)
                end
            end
        end
    end
    walk(cfg, nil)
    return out
end

-- why a difference at key breaks the continuation, or nil
local function breaking(key)
    if key:match('^data%.') then return 'changes the data or its order' end
    if key:match('^model%.') then return 'changes the model' end
    if key == 'tokenizer' then return 'changes the tokens' end
    if key:match('^peft%.') or key == 'peft' then return 'changes the adapters' end
    if key == 'train.grad_accum' then return 'changes the batch and the data position' end
    return nil
end

-- compare(saved, now) -> the differences, sorted by key
function M.compare(saved, now)
    local keys, seen = {}, {}
    for k in pairs(saved) do if not seen[k] then seen[k] = true; keys[#keys + 1] = k end end
    for k in pairs(now) do if not seen[k] then seen[k] = true; keys[#keys + 1] = k end end
    table.sort(keys)
    local out = {}
    for _, k in ipairs(keys) do
        local a, b = saved[k], now[k]
        if a ~= b then
            out[#out + 1] = {key = k, old = a == nil and '(unset)' or tostring(a), new = b == nil and '(unset)' or b,
                             breaking = breaking(k)}
        end
    end
    return out
end

return M
