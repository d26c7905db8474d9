-- lunar.nn.masks: additive attention masks as HF's eager path builds them
-- (glm5-architecture.md sections 3 and 5, pitfall 12).
--
-- A mask is f32 (B, T, T): mask[b, s, t] = 0 where query s may see key t and FMIN (f32
-- finfo.min = -3.4028234663852886e38) where it may not. Adding FMIN to a score rounds to FMIN,
-- so masked keys get exactly 0 probability; a row with no visible key stays all FMIN and the
-- softmax makes it uniform over the T keys, as in HF (not NaN).
--
--   masks.FMIN
--   masks.build{B=, T=, attention_mask=, cu_seqlens=, device=}  -> (B, T, T) f32
--       causal always; attention_mask (B, T), 0 = padding key (any dtype), hides those keys;
--       cu_seqlens (D+1) 0-based document offsets (cu[1] = 0, cu[D+1] = T) makes the mask
--       block-diagonal causal for packed documents (B must be 1), or a Lua list of B such
--       tensors, one per row. Both may be given.
--   masks.causal(B, T, {device=})                 -> the causal mask of every row
--   masks.packed_positions(cu_seqlens, {device=}) -> (1, T) i64 positions restarting at 0 per
--       document (or (B, T) for a list of B cu_seqlens), on device (default: cu_seqlens's)
--
-- cu_seqlens is read on the host (validation, positions): a device copy costs a read back per
-- use, so callers that build masks every step (lunar.model) keep it on the host; the mask itself
-- is built on `device` from a small copy of the offsets.
--   masks.select(mask, topk)                       -> new mask with every key that is not in
--       topk (B, T, k) i64 0-based set to FMIN (the DSA selection of section 5 step 10)
--   masks.query_valid(mask, attention_mask)        -> (B, T) f32, 1 where the query row sees at
--       least one key (and is not padding itself when attention_mask is given), else 0
local lunar_core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local ops = require 'lunar.ops'

local M = {}

M.FMIN = -3.4028234663852886e38

local function fail(msg) tensor.fail(msg) end

-- cu_seqlens as a Lua list of 0-based offsets, checked
local function offsets(cu, T, what)
    local list = cu:tolist_flat()
    T = T or list[#list]
    if #list < 2 or list[1] ~= 0 or list[#list] ~= T then
        fail(('masks: %s must start at 0 and end at T = %d, got {%s}'):format(what, T, table.concat(list, ', ')))
    end
    for i = 2, #list do
        if list[i] < list[i - 1] then
            fail(('masks: %s must be non-decreasing, got {%s}'):format(what, table.concat(list, ', ')))
        end
    end
    return list
end

-- the (T, T) f32 mask of one row: 0 / FMIN (the C masks give 0 / -inf; max with FMIN maps
-- -inf to FMIN and keeps 0)
local function row_mask(T, cu, device, what)
    local m
    if cu then
        offsets(cu, T, what)
        -- built where it is used: the (T, T) mask never crosses devices, only the offsets do
        if device and cu:device() ~= lunar_core.device_name(device) then cu = cu:to(device) end
        m = ops.block_mask(cu, {causal = true, out = lunar_core.empty({T, T}, 'f32', cu:device())})
    else
        m = ops.causal_mask(T, T, {dtype = 'f32', device = device})
    end
    return ops.maximum(m, M.FMIN)
end

function M.build(spec)
    local B, T = spec.B, spec.T
    if type(B) ~= 'number' or type(T) ~= 'number' or B < 1 or T < 1 then
        fail(('masks.build: B and T must be positive numbers, got B = %s, T = %s'):format(tostring(B), tostring(T)))
    end
    local device = spec.device
    local out = lunar_core.empty({B, T, T}, 'f32', device)
    local cu = spec.cu_seqlens
    if cu == nil then
        out:copy_(row_mask(T, nil, device):unsqueeze(1))
    elseif tensor.is_tensor(cu) then
        if B ~= 1 then fail(('masks.build: one cu_seqlens tensor describes one packed row, but B = %d (pass a list of B tensors)'):format(B)) end
        out:copy_(row_mask(T, cu, device, 'cu_seqlens'):unsqueeze(1))
    elseif type(cu) == 'table' then
        if #cu ~= B then fail(('masks.build: %d cu_seqlens for B = %d rows'):format(#cu, B)) end
        for b = 1, B do out:select(1, b):copy_(row_mask(T, cu[b], device, 'cu_seqlens[' .. b .. ']')) end
    else
        fail('masks.build: cu_seqlens must be a tensor or a list of tensors, got a ' .. type(cu))
    end
    local am = spec.attention_mask
    if am ~= nil then
        local s = am:size()
        if #s ~= 2 or s[1] ~= B or s[2] ~= T then
            fail(('masks.build: attention_mask must be (B, T) = (%d, %d), got (%s)'):format(B, T, table.concat(s, ', ')))
        end
        -- padding keys: every query row of batch row b hides key t where attention_mask[b, t] == 0
        ops.masked_fill_(out, ops.eq(am, 0):unsqueeze(2), M.FMIN)
    end
    return out
end

function M.causal(B, T, opts)
    opts = opts or {}
    return M.build{B = B, T = T, device = opts.device}
end

local function positions_of(list, T)
    local p = {}
    for d = 1, #list - 1 do
        for t = list[d], list[d + 1] - 1 do p[t + 1] = t - list[d] end
    end
    return p
end

function M.packed_positions(cu_seqlens, opts)
    local rows = tensor.is_tensor(cu_seqlens) and {cu_seqlens} or cu_seqlens
    local flat, T = {}, nil
    for b, cu in ipairs(rows) do
        local list = offsets(cu, T, 'cu_seqlens[' .. b .. ']')
        T = T or list[#list]
        local p = positions_of(list, T)
        for t = 1, T do flat[#flat + 1] = p[t] end
    end
    return lunar_core.from_flat(flat, {#rows, T}, 'i64', (opts and opts.device) or rows[1]:device())
end

function M.select(mask, topk)
    local s = mask:size()
    local sel = lunar_core.empty(s, 'f32', mask:device()):fill_(0)
    local ones = lunar_core.empty(topk:size(), 'f32', mask:device()):fill_(1)
    ops.scatter_(sel, 3, topk, ones)
    return ops.masked_fill(mask, ops.eq(sel, 0), M.FMIN)
end

function M.query_valid(mask, attention_mask)
    local rowmax = ops.max(mask, 3)
    local valid = ops.gt(rowmax, M.FMIN, {dtype = 'f32'})
    if attention_mask ~= nil then valid = ops.mul(valid, ops.ne(attention_mask, 0, {dtype = 'f32'})) end
    return valid
end

return M
