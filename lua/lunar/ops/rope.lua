-- lunar.ops.rope: rotary position embedding (glm5-architecture.md section 4.4).
--   rope(x, positions, inv_freq, {layout='half', scale=1, out=})        -> out
--   rope_backward(dout, positions, inv_freq, {layout=, scale=, out=})    -> dx
--   rope_inv_freq(rot_dim, theta, {device=})                             -> (rot_dim/2) f32
-- x is (T, H, D) with positions (T), or (B, T, H, D) with positions (B, T). Only the first
-- R = 2 * numel(inv_freq) channels rotate; the rest is copied. Layouts:
--   'half'                 NeoX rotate_half: pairs (i, i + R/2)
--   'interleaved'          GPT-J / DeepSeek pairs (2i, 2i+1), rotated in place
--   'interleaved_to_half'  HF apply_rotary_pos_emb_interleave: pairs (2i, 2i+1) in, output in
--                          half-split order (rotated evens first, then rotated odds)
-- The angle is f32(position) * inv_freq[i] in f32; cos and sin are f32, times `scale`.
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local C = core.ops

local M = {}

local function apply(cfn, name, x, positions, inv_freq, opts)
    tensor.check(x, name == 'rope' and 'x' or 'dout', name)
    tensor.check(positions, 'positions', name)
    opts = opts or {}
    local shape = x:size()
    local layout, scale = opts.layout or 'half', opts.scale or 1
    local out = opts.out or core.empty(shape, x:dtype(), x:device())
    if #shape == 3 then return cfn(out, x, positions, inv_freq, layout, scale) end
    if #shape ~= 4 then
        tensor.fail(('%s: x must be (T, H, D) or (B, T, H, D), got %d dims'):format(name, #shape))
    end
    local ps = positions:size()
    if #ps ~= 2 or ps[1] ~= shape[1] or ps[2] ~= shape[2] then
        tensor.fail(('%s: positions must be (B, T) = (%d, %d) for x (B, T, H, D), got (%s)'):format(
            name, shape[1], shape[2], table.concat(ps, ', ')))
    end
    local bt = shape[1] * shape[2]
    local flat = {bt, shape[3], shape[4]}
    local ok, out3 = pcall(out.view, out, flat)
    local tmp
    if not ok then
        tmp = core.empty(flat, out:dtype(), out:device())
        out3 = tmp
    end
    cfn(out3, x:reshape(flat), positions:reshape(bt), inv_freq, layout, scale)
    if tmp then out:copy_(tmp:view(shape)) end
    return out
end

function M.rope(x, positions, inv_freq, opts)
    return apply(C.rope_forward, 'rope', x, positions, inv_freq, opts)
end

function M.rope_backward(dout, positions, inv_freq, opts)
    return apply(C.rope_backward, 'rope_backward', dout, positions, inv_freq, opts)
end

-- f32 rounding of a list of numbers
local function f32(list)
    if #list == 0 then return list end
    return core.from_flat(list, {#list}, 'f32'):tolist_flat()
end

-- HF's default rope init: inv_freq = 1 / theta^(arange(0, d, 2) / d), every step in f32
-- (arange to f32, the division, the power and the reciprocal each rounded to f32).
function M.rope_inv_freq(rot_dim, theta, opts)
    opts = opts or {}
    if type(rot_dim) ~= 'number' or rot_dim < 2 or rot_dim % 2 ~= 0 then
        tensor.fail('rope_inv_freq: rot_dim must be a positive even number, got ' .. tostring(rot_dim))
    end
    theta = theta or 10000
    if type(theta) ~= 'number' or theta <= 0 then
        tensor.fail('rope_inv_freq: theta must be a positive number, got ' .. tostring(theta))
    end
    local th = f32({theta})[1]
    local ex = {}
    for i = 0, rot_dim / 2 - 1 do ex[i + 1] = (2 * i) / rot_dim end
    ex = f32(ex)
    local pw = {}
    for i = 1, #ex do pw[i] = th ^ ex[i] end
    pw = f32(pw)
    local inv = {}
    for i = 1, #pw do inv[i] = 1 / pw[i] end
    return core.from_flat(inv, {#inv}, 'f32', opts.device)
end

return M
