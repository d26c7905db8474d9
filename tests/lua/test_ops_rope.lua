-- test_ops_rope.lua: rotary embedding (three layouts, partial rotary, scale) against a plain-Lua
-- reference of glm5-architecture.md section 4.4, against torch fixtures of HF's formulas
-- (tests/fixtures/rope_hf.json), and its backward by finite differences.
--
-- Tolerances: f32 vs the reference atol 2e-6, rtol 1e-5 (the reference uses the same f32 angle
-- and f64 cos/sin; the kernel's cosf/sinf are within an ulp); vs torch atol 2e-6 (torch's
-- vectorised cos/sin differ by an ulp); bf16 rtol 2^-7, atol 1e-2; gradcheck eps 1e-2 in f32,
-- rtol 1e-2, atol 1e-3; rope_inv_freq vs torch: exact (every step is rounded to f32 as in HF).
local lunar = require 'lunar'
local ops = lunar.ops
local T = require('lunar.testing').suite('ops.rope')

lunar.manual_seed(4242)

local LAYOUTS = {'half', 'interleaved', 'interleaved_to_half'}

local function f32_list(list)
    if #list == 0 then return list end
    return lunar.tensor(list):tolist_flat()
end

local function read_json(name)
    local dir = debug.getinfo(1, 'S').source:match('^@(.*)/[^/]*$') or '.'
    local f = assert(io.open(dir .. '/../fixtures/' .. name, 'r'))
    local s = f:read('*a')
    f:close()
    -- our fixtures hold only objects, arrays, numbers and plain strings
    s = s:gsub('%[', '{'):gsub('%]', '}'):gsub('"([%w_]+)"%s*:', '["%1"]=')
    return assert(loadstring('return ' .. s))()
end

-- reference: x flat (T, H, D), positions list, inv_freq list (f32 values)
local function ref_rope(xv, tn, hn, d, pos, freq, layout, scale, inverse)
    local half = #freq
    local angles = {}
    for t = 1, tn do for i = 1, half do angles[(t - 1) * half + i] = pos[t] * freq[i] end end
    angles = f32_list(angles)   -- the angle is an f32 product
    local out = {}
    for k = 1, #xv do out[k] = xv[k] end   -- pass-through channels
    for t = 1, tn do
        for h = 1, hn do
            local base = ((t - 1) * hn + (h - 1)) * d
            for i = 0, half - 1 do
                local a = angles[(t - 1) * half + i + 1]
                local c, s = math.cos(a) * scale, math.sin(a) * scale
                local ia, ib, oa, ob
                if layout == 'half' then
                    ia, ib, oa, ob = i, i + half, i, i + half
                elseif layout == 'interleaved' then
                    ia, ib, oa, ob = 2 * i, 2 * i + 1, 2 * i, 2 * i + 1
                else
                    ia, ib, oa, ob = 2 * i, 2 * i + 1, i, i + half
                end
                if inverse then
                    ia, ib, oa, ob = oa, ob, ia, ib
                    s = -s
                end
                local xa, xb = xv[base + ia + 1], xv[base + ib + 1]
                out[base + oa + 1] = xa * c - xb * s
                out[base + ob + 1] = xb * c + xa * s
            end
        end
    end
    return out
end

local function rand_positions(n, hi, dtype)
    return lunar.randint(0, hi, {n}, dtype or 'i64')
end

local function dot(t, r)
    local a = t:tolist_flat()
    local s = 0
    for i = 1, #a do s = s + a[i] * r[i] end
    return s
end

-- (T, H, D, R) covering sizes 1, 3, 17 and 1000; R < D is partial rotary
local CASES = {{1, 1, 2, 2}, {3, 2, 8, 8}, {17, 3, 16, 8}, {1000, 1, 4, 4}, {2, 3, 1000, 64}, {5, 1, 7, 2}}

T:test('forward matches the reference for every layout, partial rotary and scale', function()
    for _, cs in ipairs(CASES) do
        local tn, hn, d, r = cs[1], cs[2], cs[3], cs[4]
        local x = lunar.randn(tn, hn, d)
        local pos = rand_positions(tn, 5000)
        local freq = ops.rope_inv_freq(r, 10000)
        for _, layout in ipairs(LAYOUTS) do
            for _, scale in ipairs({1, 0.75}) do
                local out = ops.rope(x, pos, freq, {layout = layout, scale = scale})
                local want = ref_rope(x:tolist_flat(), tn, hn, d, pos:tolist_flat(), freq:tolist_flat(), layout, scale)
                T.close(out, want, {rtol = 1e-5, atol = 2e-6,
                    msg = ('%s T%d H%d D%d R%d scale %g'):format(layout, tn, hn, d, r, scale)})
            end
        end
    end
end)

T:test('matches the torch fixture of HF rotate_half and apply_rotary_pos_emb_interleave', function()
    local fx = read_json('rope_hf.json').rope
    local x = lunar.tensor(fx.x):view(fx.T, fx.H, fx.D)
    local pos = lunar.tensor(fx.positions, 'i64')
    local freq = ops.rope_inv_freq(fx.R, fx.theta)
    T.close(ops.rope(x, pos, freq, {layout = 'half'}), fx.half, {rtol = 1e-6, atol = 2e-6, msg = 'half'})
    T.close(ops.rope(x, pos, freq, {layout = 'interleaved_to_half'}), fx.interleaved_to_half,
        {rtol = 1e-6, atol = 2e-6, msg = 'interleaved_to_half'})
end)

T:test('rope_inv_freq equals HF default rope init bit for bit', function()
    for _, c in ipairs(read_json('rope_hf.json').inv_freq) do
        local f = ops.rope_inv_freq(c.dim, c.theta)
        assert(f:dtype() == 'f32' and f:numel() == c.dim / 2)
        T.equal(f, c.inv_freq, ('inv_freq dim %d theta %g'):format(c.dim, c.theta))
    end
    T.raises(function() ops.rope_inv_freq(7, 10000) end, 'rot_dim must be a positive even number')
end)

T:test('layouts relate as documented: interleaved_to_half = de-interleave, then half', function()
    local tn, hn, d, r = 6, 2, 10, 8
    local x = lunar.randn(tn, hn, d)
    local pos = rand_positions(tn, 100)
    local freq = ops.rope_inv_freq(r, 10000)
    -- de-interleave the rotary channels: (0, 2, 4, 6, 1, 3, 5, 7) then the pass-through ones
    local perm = {}
    for i = 0, r / 2 - 1 do perm[#perm + 1] = 2 * i end
    for i = 0, r / 2 - 1 do perm[#perm + 1] = 2 * i + 1 end
    for i = r, d - 1 do perm[#perm + 1] = i end
    local p = lunar.tensor(perm, 'i64')
    local i2h = ops.rope(x, pos, freq, {layout = 'interleaved_to_half'})
    local via_half = ops.rope(x:index_select(3, p), pos, freq, {layout = 'half'})
    T.close(i2h, via_half, {rtol = 0, atol = 0, msg = 'de-interleave then half'})
    -- genuine pair rotation, then de-interleaving its output, gives the same tensor
    local inter = ops.rope(x, pos, freq, {layout = 'interleaved'})
    T.close(i2h, inter:index_select(3, p), {rtol = 0, atol = 0, msg = 'interleaved then de-interleave'})
end)

T:test('q.k after rope depends only on the position difference', function()
    local d = 16
    local freq = ops.rope_inv_freq(d, 10000)
    local q, k = lunar.randn(1, 1, d), lunar.randn(1, 1, d)
    for _, layout in ipairs(LAYOUTS) do
        local function score(pq, pk)
            local a = ops.rope(q, lunar.tensor({pq}, 'i64'), freq, {layout = layout}):tolist_flat()
            local b = ops.rope(k, lunar.tensor({pk}, 'i64'), freq, {layout = layout}):tolist_flat()
            local s = 0
            for i = 1, d do s = s + a[i] * b[i] end
            return s
        end
        T.close(score(10, 3), score(107, 100), {rtol = 1e-4, atol = 1e-4, msg = layout})
    end
end)

T:test('backward undoes the forward (scale 1) and is its transpose (any scale)', function()
    for _, cs in ipairs(CASES) do
        local tn, hn, d, r = cs[1], cs[2], cs[3], cs[4]
        local x = lunar.randn(tn, hn, d)
        local pos = rand_positions(tn, 1000, 'i32')
        local freq = ops.rope_inv_freq(r, 10000)
        for _, layout in ipairs(LAYOUTS) do
            local y = ops.rope(x, pos, freq, {layout = layout})
            T.close(ops.rope_backward(y, pos, freq, {layout = layout}), x, {rtol = 1e-5, atol = 1e-5, msg = layout})
            local dy = lunar.randn(tn, hn, d)
            local dx = ops.rope_backward(dy, pos, freq, {layout = layout, scale = 0.5})
            local want = ref_rope(dy:tolist_flat(), tn, hn, d, pos:tolist_flat(), freq:tolist_flat(), layout, 0.5, true)
            T.close(dx, want, {rtol = 1e-5, atol = 2e-6, msg = 'backward ' .. layout})
        end
    end
end)

T:test('gradcheck for every layout, with partial rotary and a scale', function()
    for _, layout in ipairs(LAYOUTS) do
        for _, cs in ipairs({{3, 2, 8, 8}, {2, 1, 10, 4}}) do
            local tn, hn, d, r = cs[1], cs[2], cs[3], cs[4]
            local x, w = lunar.randn(tn, hn, d), lunar.randn(tn, hn, d)
            local wl = w:tolist_flat()
            local pos = lunar.tensor({0, 5, 9}, 'i64'):narrow(1, 1, tn)
            local freq = ops.rope_inv_freq(r, 100)
            local opts = {layout = layout, scale = 0.9}
            local function loss(inp) return dot(ops.rope(inp[1], pos, freq, opts), wl) end
            local dx = ops.rope_backward(w, pos, freq, opts)
            T.gradcheck{name = layout .. ' R' .. r, f = loss, inputs = {x}, grads = {dx}, eps = 1e-2, rtol = 1e-2,
                        atol = 1e-3}
        end
    end
end)

T:test('(B, T, H, D) with (B, T) positions equals the flattened call', function()
    local b, tn, hn, d = 2, 3, 2, 8
    local x = lunar.randn(b, tn, hn, d)
    local pos = lunar.tensor({{0, 1, 2}, {7, 8, 9}}, 'i64')
    local freq = ops.rope_inv_freq(d, 10000)
    for _, layout in ipairs(LAYOUTS) do
        local out = ops.rope(x, pos, freq, {layout = layout})
        assert(out:dim() == 4 and out:size(1) == b)
        local flat = ops.rope(x:view(b * tn, hn, d), pos:view(b * tn), freq, {layout = layout})
        T.equal(out:view(b * tn, hn, d), flat, layout)
        local back = ops.rope_backward(out, pos, freq, {layout = layout})
        T.close(back, x, {rtol = 1e-5, atol = 1e-5})
        -- a non-contiguous 4-dim output is written through a temporary
        local big = lunar.zeros(b, tn, hn, d + 3)
        ops.rope(x, pos, freq, {layout = layout, out = big:narrow(4, 2, d)})
        T.equal(big:narrow(4, 2, d), out, 'strided 4-dim out')
    end
    T.raises(function() ops.rope(x, lunar.zeros(b * tn, 'i64'), freq) end, 'positions must be (B, T) = (2, 3)')
end)

T:test('strided inputs and outputs, bf16, and in place', function()
    local tn, hn, d, r = 17, 3, 16, 12
    local x = lunar.randn(hn, tn, d):transpose(1, 2)      -- (T, H, D) with T and H strides swapped
    local pos = lunar.randint(0, 100, {tn, 2}, 'i64'):select(2, 2)   -- stride-2 positions
    local fbig = ops.rope_inv_freq(r, 10000):view(r / 2, 1):expand(r / 2, 2)
    local freq = fbig:select(2, 1)                         -- stride-2 inv_freq view
    local obig = lunar.zeros(tn, hn, d + 4)
    local out = obig:narrow(3, 3, d)
    for _, layout in ipairs(LAYOUTS) do
        ops.rope(x, pos, freq, {layout = layout, out = out})
        local want = ref_rope(x:tolist_flat(), tn, hn, d, pos:tolist_flat(), freq:tolist_flat(), layout, 1)
        T.close(out, want, {rtol = 1e-5, atol = 2e-6, msg = 'strided ' .. layout})
        T.equal(obig:narrow(3, 1, 2), lunar.zeros(tn, hn, 2), 'untouched')
        -- bf16 in and out
        local xb = x:bf16()
        local ob = ops.rope(xb, pos, freq, {layout = layout})
        assert(ob:dtype() == 'bf16')
        T.close(ob, ref_rope(xb:tolist_flat(), tn, hn, d, pos:tolist_flat(), freq:tolist_flat(), layout, 1),
            {rtol = 2 ^ -7, atol = 1e-2, msg = 'bf16 ' .. layout})
        -- in place: out = x
        local xi = x:contiguous():clone()
        ops.rope(xi, pos, freq, {layout = layout, out = xi})
        T.close(xi, want, {rtol = 1e-5, atol = 2e-6, msg = 'in place ' .. layout})
    end
end)

T:test('bad arguments are reported', function()
    local x = lunar.randn(4, 2, 8)
    x:set_name('q_rot')
    local pos = lunar.arange(4, 'i64')
    local freq = ops.rope_inv_freq(8, 10000)
    T.raises(function() ops.rope(lunar.randn(4, 8), pos, freq) end, 'must be (T, H, D) or (B, T, H, D)')
    T.raises(function() ops.rope(x, lunar.arange(3, 'i64'), freq) end, "positions 'tensor' has shape (3), expected (4)")
    T.raises(function() ops.rope(x, pos, ops.rope_inv_freq(10, 10000)) end, "with R <= D for x 'q_rot' (4, 2, 8)")
    T.raises(function() ops.rope(x, pos, freq, {layout = 'sideways'}) end, "unknown layout 'sideways'")
    T.raises(function() ops.rope(x, lunar.arange(4), freq) end, 'must be i32 or i64, not f32')
    T.raises(function() ops.rope(x, pos, freq, {out = lunar.zeros(4, 2, 9)}) end, 'has shape (4, 2, 9), expected (4, 2, 8)')
    T.raises(function() ops.rope_backward(lunar.zeros(4, 2, 8, 'i32'), pos, freq) end, "dout 'tensor' (4, 2, 8) must be a float tensor")
end)

os.exit(T:run())
