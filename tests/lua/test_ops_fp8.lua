-- test_ops_fp8.lua: FP8 block dequantisation against a plain-Lua formula,
--   out[i][j] = round_to_f32(f32(q[i][j]) * scale_inv[floor(i/bm)][floor(j/bn)]),
-- on shapes that are not multiples of the block (300x200, 576x130, 1x1, 3x17, 17x1000),
-- other block sizes, e4m3 and e5m2, bf16 outputs (= the f32 result rounded once),
-- non-contiguous q and out, and the error messages (a wrong scale shape names both tensors).
-- Exact comparison: the product of two f32 values is exact in a double, so rounding the
-- double reference to f32 gives the bits an f32 multiply gives.
local lunar = require 'lunar'
local ops = lunar.ops
local T = require('lunar.testing').suite('ops.fp8')

lunar.manual_seed(5)

-- random f8 codes covering the range (randn * 60 saturates some to +-448 / 57344)
local function random_q(m, n, dt)
    return (lunar.randn(m, n) * 60):to(dt or 'f8e4m3')
end

local function reference(q, s, bm, bn)
    local m, n = q:size(1), q:size(2)
    local qv = q:to('f32'):contiguous():tolist_flat()   -- exact decoding
    local sv = s:contiguous():tolist_flat()
    local sn = s:size(2)
    local out = {}
    for i = 0, m - 1 do
        local srow = math.floor(i / bm) * sn
        for j = 0, n - 1 do
            out[i * n + j + 1] = qv[i * n + j + 1] * sv[srow + math.floor(j / bn) + 1]
        end
    end
    return lunar.tensor(out, 'f32'):view(m, n)   -- rounds each double to f32 once
end

local function scales(m, n, bm, bn)
    return lunar.rand(math.ceil(m / bm), math.ceil(n / bn)) * 0.01 + 1e-4
end

T:test('f32 output equals the formula exactly on shapes that are not block multiples', function()
    for _, s in ipairs({{300, 200}, {576, 130}, {1, 1}, {3, 17}, {17, 1000}, {128, 128}, {129, 257}}) do
        local m, n = s[1], s[2]
        local q, sc = random_q(m, n), scales(m, n, 128, 128)
        local out = ops.fp8_block_dequant(q, sc)
        T.equal(out:size(), {m, n}, 'shape')
        T.equal(out, reference(q, sc, 128, 128), ('%dx%d'):format(m, n))
    end
end)

T:test('other block sizes and e5m2', function()
    for _, c in ipairs({{37, 45, 8, 16, 'f8e4m3'}, {300, 200, 1, 200, 'f8e5m2'}, {64, 96, 64, 32, 'f8e5m2'}}) do
        local m, n, bm, bn, dt = c[1], c[2], c[3], c[4], c[5]
        local q, sc = random_q(m, n, dt), scales(m, n, bm, bn)
        T.equal(ops.fp8_block_dequant(q, sc, {block = {bm, bn}}), reference(q, sc, bm, bn),
            ('%dx%d blocks %dx%d %s'):format(m, n, bm, bn, dt))
    end
end)

T:test('bf16 output is the f32 result rounded once', function()
    local q, sc = random_q(300, 200), scales(300, 200, 128, 128)
    local out = ops.fp8_block_dequant(q, sc, {dtype = 'bf16'})
    T.equal(out:dtype() == 'bf16' and 1 or 0, 1, 'dtype')
    T.equal(out, reference(q, sc, 128, 128):to('bf16'), 'bf16')
end)

T:test('non-contiguous q, scale and out', function()
    local qt = random_q(200, 300):t()            -- (300, 200) transposed view
    local st = scales(300, 200, 128, 128):t()    -- (2, 3): the wrong orientation, on purpose
    local s = scales(300, 200, 128, 128)
    local big = lunar.zeros(300, 400)
    local out = big:narrow(2, 101, 200)
    ops.fp8_block_dequant(qt, s, {out = out})
    T.equal(out, reference(qt, s, 128, 128), 'strided q and out')
    T.equal(big:narrow(2, 1, 100):abs():sum():item(), 0, 'nothing written outside the view')
    local s2 = s:t():contiguous():t()            -- a transposed view with the right shape
    T.equal(ops.fp8_block_dequant(qt, s2), reference(qt, s, 128, 128), 'strided scale')
    T.raises(function() ops.fp8_block_dequant(qt, st) end, 'has shape (2, 3)')
end)

T:test('errors name the problem and the tensors', function()
    local q = random_q(576, 130)
    q:set_name('model.layers.0.self_attn.kv_a_proj_with_mqa.weight')
    local s = lunar.ones(4, 2, {name = 'model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv'})
    local err = T.raises(function() ops.fp8_block_dequant(q, s) end, 'needs (5, 2)')
    T.equal(err:find("scale_inv 'model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv' has shape (4, 2)", 1, true)
        and err:find("q 'model.layers.0.self_attn.kv_a_proj_with_mqa.weight' (576, 130)", 1, true) and 1 or 0, 1, err)
    T.raises(function() ops.fp8_block_dequant(lunar.ones(4, 4), lunar.ones(1, 1)) end, 'must be f8e4m3 or f8e5m2, not f32')
    T.raises(function() ops.fp8_block_dequant(random_q(4, 4):view(16), lunar.ones(1, 1)) end, 'must be 2-dim')
    T.raises(function() ops.fp8_block_dequant(random_q(4, 4), lunar.ones(1, 1), {block = {0, 128}}) end,
        'block sizes must be positive')
    T.raises(function() ops.fp8_block_dequant(random_q(4, 4), lunar.ones(1, 1), {out = lunar.zeros(4, 5)}) end,
        'has shape (4, 5), expected (4, 4)')
    T.raises(function() ops.fp8_block_dequant(random_q(4, 4), lunar.ones(1, 1), {out = lunar.zeros(4, 4, {dtype = 'i32'})}) end,
        'must be a float tensor')
    local dead = lunar.ones(1, 1)
    dead:free()
    T.raises(function() ops.fp8_block_dequant(random_q(4, 4), dead) end, 'free')
end)

os.exit(T:run())
