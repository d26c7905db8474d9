-- test_ops_norm.lua: RMSNorm and LayerNorm (forward, backward_input, backward_params) against a
-- plain-Lua reference in f64, plus finite-difference gradient checks.
--
-- Tolerances: f32 results vs the f64 reference rtol 1e-5, atol 1e-5 (row sums are f32 lanes
-- combined in f64); bf16 inputs/outputs rtol 2^-7, atol 1e-2 against the reference evaluated on
-- the bf16-rounded inputs (one bf16 rounding of the output, plus f32 arithmetic);
-- gradchecks: central differences with eps 1e-2 in f32, rtol 1e-2, atol 2e-3.
local lunar = require 'lunar'
local ops = lunar.ops
local T = require('lunar.testing').suite('ops.norm')

lunar.manual_seed(20240611)

local F32 = {rtol = 1e-5, atol = 1e-5}
local BF16 = {rtol = 2 ^ -7, atol = 1e-2}

local function last_dim(x) local s = x:size() return s[#s] end

-- ---- reference ------------------------------------------------------------------------------

-- returns out (flat), stat tables; xv flat row-major (N, C); wv, bv flat or nil
local function ref_rmsnorm(xv, wv, n, c, eps)
    local out, rstd = {}, {}
    for r = 0, n - 1 do
        local ss = 0
        for i = 1, c do ss = ss + xv[r * c + i] ^ 2 end
        local rs = 1 / math.sqrt(ss / c + eps)
        rstd[r + 1] = rs
        for i = 1, c do out[r * c + i] = xv[r * c + i] * rs * (wv and wv[i] or 1) end
    end
    return out, rstd
end

local function ref_rmsnorm_backward(dv, xv, wv, n, c, eps)
    local _, rstd = ref_rmsnorm(xv, nil, n, c, eps)
    local dx, dw = {}, {}
    for i = 1, c do dw[i] = 0 end
    for r = 0, n - 1 do
        local rs, s = rstd[r + 1], 0
        for i = 1, c do s = s + dv[r * c + i] * (wv and wv[i] or 1) * xv[r * c + i] end
        for i = 1, c do
            local g = dv[r * c + i] * (wv and wv[i] or 1)
            dx[r * c + i] = rs * g - xv[r * c + i] * rs ^ 3 * s / c
            dw[i] = dw[i] + dv[r * c + i] * xv[r * c + i] * rs
        end
    end
    return dx, dw
end

local function ref_layernorm(xv, wv, bv, n, c, eps)
    local out, mean, rstd = {}, {}, {}
    for r = 0, n - 1 do
        local s = 0
        for i = 1, c do s = s + xv[r * c + i] end
        local mu = s / c
        local q = 0
        for i = 1, c do q = q + (xv[r * c + i] - mu) ^ 2 end
        local rs = 1 / math.sqrt(q / c + eps)
        mean[r + 1], rstd[r + 1] = mu, rs
        for i = 1, c do
            out[r * c + i] = (xv[r * c + i] - mu) * rs * (wv and wv[i] or 1) + (bv and bv[i] or 0)
        end
    end
    return out, mean, rstd
end

local function ref_layernorm_backward(dv, xv, wv, n, c, eps)
    local _, mean, rstd = ref_layernorm(xv, nil, nil, n, c, eps)
    local dx, dw, db = {}, {}, {}
    for i = 1, c do dw[i], db[i] = 0, 0 end
    for r = 0, n - 1 do
        local mu, rs = mean[r + 1], rstd[r + 1]
        local sg, sgx = 0, 0
        for i = 1, c do
            local g = dv[r * c + i] * (wv and wv[i] or 1)
            local xh = (xv[r * c + i] - mu) * rs
            sg, sgx = sg + g, sgx + g * xh
        end
        for i = 1, c do
            local g = dv[r * c + i] * (wv and wv[i] or 1)
            local xh = (xv[r * c + i] - mu) * rs
            dx[r * c + i] = rs * (g - sg / c - xh * sgx / c)
            dw[i] = dw[i] + dv[r * c + i] * xh
            db[i] = db[i] + dv[r * c + i]
        end
    end
    return dx, dw, db
end

local function add(a, b)
    local o = {}
    for i = 1, #a do o[i] = a[i] + b[i] end
    return o
end

local function dot(t, r)
    local a, b = t:tolist_flat(), r
    local s = 0
    for i = 1, #a do s = s + a[i] * b[i] end
    return s
end

-- shapes (..., C) covering sizes 1, 3, 17 and 1000
local SHAPES = {{1, 1}, {3, 17}, {17, 3}, {2, 1000}, {1000, 3}, {2, 3, 17}, {5}}

-- ---- RMSNorm --------------------------------------------------------------------------------

T:test('rmsnorm forward matches the reference, with and without weight', function()
    for _, shape in ipairs(SHAPES) do
        local c = shape[#shape]
        local n = 1
        for i = 1, #shape - 1 do n = n * shape[i] end
        local x, w = lunar.randn(shape), lunar.randn(c)
        for _, use_w in ipairs({true, false}) do
            local eps = 1e-5
            local out, rstd = ops.rmsnorm(x, use_w and w or nil, eps)
            local ro, rr = ref_rmsnorm(x:tolist_flat(), use_w and w:tolist_flat() or nil, n, c, eps)
            local what = ('shape %s weight %s'):format(table.concat(shape, 'x'), tostring(use_w))
            T.close(out, ro, {rtol = F32.rtol, atol = F32.atol, msg = what})
            T.close(rstd, rr, {rtol = F32.rtol, atol = 0, msg = what .. ' rstd'})
            assert(rstd:dtype() == 'f32' and rstd:numel() == n)
        end
    end
end)

T:test('rmsnorm follows HF: mean of squares, rsqrt(var + eps), then weight', function()
    -- a row whose mean square is 1 plus eps is scaled by exactly 1 / sqrt(1 + eps)
    local x = lunar.tensor({{1, -1, 1, -1}, {2, 2, 2, 2}})
    local w = lunar.tensor({1, 2, 3, 4})
    local out, rstd = ops.rmsnorm(x, w, 0)
    T.close(out, {1, -2, 3, -4, 1, 2, 3, 4}, {rtol = 1e-7, atol = 0})
    T.close(rstd, {1, 0.5}, {rtol = 1e-7, atol = 0})
    local _, r2 = x:rmsnorm(nil, 1e-6)   -- also a tensor method
    T.close(r2, {1 / math.sqrt(1 + 1e-6), 1 / math.sqrt(4 + 1e-6)}, {rtol = 1e-7, atol = 0})
end)

T:test('rmsnorm backward_input and backward_params (accumulating) match the reference', function()
    for _, shape in ipairs(SHAPES) do
        local c = shape[#shape]
        local n = 1
        for i = 1, #shape - 1 do n = n * shape[i] end
        local eps = 1e-6
        local x, w, d = lunar.randn(shape), lunar.randn(c), lunar.randn(shape)
        for _, use_w in ipairs({true, false}) do
            local wt = use_w and w or nil
            local _, rstd = ops.rmsnorm(x, wt, eps)
            local dx = ops.rmsnorm_backward(d, x, wt, rstd)
            local rdx, rdw = ref_rmsnorm_backward(d:tolist_flat(), x:tolist_flat(), use_w and w:tolist_flat() or nil,
                n, c, eps)
            T.close(dx, rdx, {rtol = 1e-4, atol = 1e-5, msg = 'dx ' .. table.concat(shape, 'x')})
            local dw0 = lunar.randn(c)
            local start = dw0:tolist_flat()
            local ret = ops.rmsnorm_backward_params(dw0, d, x, rstd)
            assert(ret == dw0, 'returns dw')
            T.close(dw0, add(start, rdw), {rtol = 1e-5, atol = 1e-4, msg = 'dw += ' .. table.concat(shape, 'x')})
        end
    end
end)

T:test('rmsnorm gradcheck (input and weight)', function()
    local eps = 1e-5
    for _, shape in ipairs({{3, 17}, {1, 3}, {2, 2, 5}}) do
        local c = shape[#shape]
        local x, w, r = lunar.randn(shape), lunar.randn(c), lunar.randn(shape)
        local rl = r:tolist_flat()
        local function loss(inp) return dot(ops.rmsnorm(inp[1], inp[2], eps), rl) end
        local _, rstd = ops.rmsnorm(x, w, eps)
        local dx = ops.rmsnorm_backward(r, x, w, rstd)
        local dw = ops.rmsnorm_backward_params(lunar.zeros(c), r, x, rstd)
        T.gradcheck{name = 'rmsnorm ' .. table.concat(shape, 'x'), f = loss, inputs = {x, w}, grads = {dx, dw},
                    eps = 1e-2, rtol = 1e-2, atol = 2e-3}
    end
end)

T:test('rmsnorm takes strided inputs and writes into strided outputs', function()
    local n, c = 17, 33
    local xt = lunar.randn(c, n):t()                 -- (N, C) transposed view
    local wbig = lunar.randn(c, 2)
    local w = wbig:select(2, 2)                      -- stride 2
    local obig = lunar.zeros(n, c + 5)
    local out = obig:narrow(2, 3, c)                 -- (N, C) inside a wider buffer
    local rbig = lunar.zeros(n, 2)
    local rstd = rbig:select(2, 1)
    ops.rmsnorm(xt, w, 1e-5, {out = out, rstd = rstd})
    local ro, rr = ref_rmsnorm(xt:tolist_flat(), w:tolist_flat(), n, c, 1e-5)
    T.close(out, ro, F32)
    T.close(rstd, rr, {rtol = 1e-5, atol = 0})
    T.equal(obig:narrow(2, 1, 2), lunar.zeros(n, 2), 'untouched columns stay 0')
    T.equal(rbig:select(2, 2), lunar.zeros(n), 'untouched stats stay 0')
    local d = lunar.randn(c, n):t()
    local dxbig = lunar.zeros(n, c, 2)
    local dx = dxbig:select(3, 1)
    ops.rmsnorm_backward(d, xt, w, rstd, {out = dx})
    local rdx, rdw = ref_rmsnorm_backward(d:tolist_flat(), xt:tolist_flat(), w:tolist_flat(), n, c, 1e-5)
    T.close(dx, rdx, {rtol = 1e-4, atol = 1e-5})
    local dwbig = lunar.zeros(c, 3)
    ops.rmsnorm_backward_params(dwbig:select(2, 2), d, xt, rstd)
    T.close(dwbig:select(2, 2), rdw, {rtol = 1e-5, atol = 1e-4})
end)

T:test('rmsnorm with bf16 tensors (tolerance 2^-7 relative, 1e-2 absolute)', function()
    local n, c = 17, 64
    local x, w = lunar.randn(n, c):bf16(), lunar.randn(c):bf16()
    local out, rstd = ops.rmsnorm(x, w, 1e-6)
    assert(out:dtype() == 'bf16' and rstd:dtype() == 'f32')
    local ro, rr = ref_rmsnorm(x:tolist_flat(), w:tolist_flat(), n, c, 1e-6)
    T.close(out, ro, BF16)
    T.close(rstd, rr, {rtol = 1e-5, atol = 0})
    local d = lunar.randn(n, c):bf16()
    local dx = ops.rmsnorm_backward(d, x, w, rstd)
    assert(dx:dtype() == 'bf16')
    local rdx, rdw = ref_rmsnorm_backward(d:tolist_flat(), x:tolist_flat(), w:tolist_flat(), n, c, 1e-6)
    T.close(dx, rdx, {rtol = 2 ^ -7, atol = 3e-2})
    -- f32 gradient accumulators of bf16 activations stay f32
    local dw = lunar.zeros(c)
    ops.rmsnorm_backward_params(dw, d, x, rstd)
    T.close(dw, rdw, {rtol = 1e-4, atol = 1e-3})
end)

T:test('backward_params is deterministic across thread counts', function()
    local n, c = 300, 200
    local x, d = lunar.randn(n, c), lunar.randn(n, c)
    local _, rstd = ops.rmsnorm(x, nil, 1e-5)
    local _, mean, lrstd = ops.layernorm(x, nil, nil, 1e-5)
    local before = lunar.threads()
    local results = {}
    for k, th in ipairs({1, 2}) do
        lunar.threads(th)
        local dw = ops.rmsnorm_backward_params(lunar.zeros(c), d, x, rstd)
        local lw, lb = ops.layernorm_backward_params(lunar.zeros(c), lunar.zeros(c), d, x, mean, lrstd)
        results[k] = {dw, lw, lb}
    end
    lunar.threads(before)
    for j = 1, 3 do T.equal(results[1][j], results[2][j], 'same bits with 1 and 2 threads') end
end)

-- ---- LayerNorm ------------------------------------------------------------------------------

T:test('layernorm forward matches the reference (biased variance), optional w and b', function()
    for _, shape in ipairs(SHAPES) do
        local c = shape[#shape]
        local n = 1
        for i = 1, #shape - 1 do n = n * shape[i] end
        local x, w, b = lunar.randn(shape), lunar.randn(c), lunar.randn(c)
        for _, combo in ipairs({{true, true}, {true, false}, {false, true}, {false, false}}) do
            local wt, bt = combo[1] and w or nil, combo[2] and b or nil
            local out, mean, rstd = ops.layernorm(x, wt, bt, 1e-5)
            local ro, rm, rr = ref_layernorm(x:tolist_flat(), wt and w:tolist_flat(), bt and b:tolist_flat(), n, c, 1e-5)
            local what = table.concat(shape, 'x') .. (wt and ' w' or '') .. (bt and ' b' or '')
            T.close(out, ro, {rtol = F32.rtol, atol = F32.atol, msg = what})
            T.close(mean, rm, {rtol = 1e-5, atol = 1e-6, msg = what .. ' mean'})
            T.close(rstd, rr, {rtol = 1e-5, atol = 0, msg = what .. ' rstd'})
        end
    end
end)

T:test('layernorm backward_input and backward_params match the reference', function()
    for _, shape in ipairs(SHAPES) do
        local c = shape[#shape]
        local n = 1
        for i = 1, #shape - 1 do n = n * shape[i] end
        local x, w, d = lunar.randn(shape), lunar.randn(c), lunar.randn(shape)
        for _, use_w in ipairs({true, false}) do
            local wt = use_w and w or nil
            local _, mean, rstd = ops.layernorm(x, wt, nil, 1e-5)
            local dx = ops.layernorm_backward(d, x, wt, mean, rstd)
            local rdx, rdw, rdb = ref_layernorm_backward(d:tolist_flat(), x:tolist_flat(), wt and w:tolist_flat(), n, c, 1e-5)
            -- c = 1: every xhat is 0 and dx is 0 up to rounding
            T.close(dx, rdx, {rtol = 1e-4, atol = 1e-4, msg = 'dx ' .. table.concat(shape, 'x')})
            local dw0, db0 = lunar.randn(c), lunar.randn(c)
            local s0, b0 = dw0:tolist_flat(), db0:tolist_flat()
            local rw, rb = ops.layernorm_backward_params(dw0, db0, d, x, mean, rstd)
            assert(rw == dw0 and rb == db0)
            T.close(dw0, add(s0, rdw), {rtol = 1e-5, atol = 1e-4, msg = 'dw'})
            T.close(db0, add(b0, rdb), {rtol = 1e-5, atol = 1e-4, msg = 'db'})
            -- either accumulator may be nil
            local only_b = lunar.zeros(c)
            ops.layernorm_backward_params(nil, only_b, d, x, mean, rstd)
            T.close(only_b, rdb, {rtol = 1e-5, atol = 1e-4, msg = 'db alone'})
        end
    end
end)

T:test('layernorm gradcheck (input, weight, bias)', function()
    local eps = 1e-5
    for _, shape in ipairs({{3, 17}, {2, 3}, {2, 2, 5}}) do
        local c = shape[#shape]
        local x, w, b, r = lunar.randn(shape), lunar.randn(c), lunar.randn(c), lunar.randn(shape)
        local rl = r:tolist_flat()
        local function loss(inp) return dot(ops.layernorm(inp[1], inp[2], inp[3], eps), rl) end
        local _, mean, rstd = ops.layernorm(x, w, b, eps)
        local dx = ops.layernorm_backward(r, x, w, mean, rstd)
        local dw, db = ops.layernorm_backward_params(lunar.zeros(c), lunar.zeros(c), r, x, mean, rstd)
        T.gradcheck{name = 'layernorm ' .. table.concat(shape, 'x'), f = loss, inputs = {x, w, b},
                    grads = {dx, dw, db}, eps = 1e-2, rtol = 1e-2, atol = 2e-3}
    end
end)

T:test('layernorm with strided and bf16 tensors', function()
    local n, c = 17, 40
    local x = lunar.randn(c, n):t()
    local w, b = lunar.randn(c, 2):select(2, 1), lunar.randn(2, c):select(1, 2)
    local obig = lunar.zeros(n, 2 * c)
    local out = obig:narrow(2, c + 1, c)
    ops.layernorm(x, w, b, 1e-5, {out = out})
    local ro = ref_layernorm(x:tolist_flat(), w:tolist_flat(), b:tolist_flat(), n, c, 1e-5)
    T.close(out, ro, F32)
    local xb, wb, bb = x:bf16(), w:bf16(), b:bf16()
    local outb = ops.layernorm(xb, wb, bb, 1e-5)
    assert(outb:dtype() == 'bf16')
    T.close(outb, (ref_layernorm(xb:tolist_flat(), wb:tolist_flat(), bb:tolist_flat(), n, c, 1e-5)), BF16)
end)

-- ---- errors ---------------------------------------------------------------------------------

T:test('bad shapes, dtypes and freed tensors are reported by name', function()
    local x = lunar.randn(4, 8)
    x:set_name('h')
    local w = lunar.randn(7)
    w:set_name('norm.weight')
    local err = T.raises(function() ops.rmsnorm(x, w) end, "rmsnorm_forward: w 'norm.weight' has shape (7), expected (8)")
    assert(err:find('test_ops_norm.lua:%d+:'), 'error points at the test line: ' .. err)
    T.raises(function() ops.rmsnorm(x, nil, 1e-5, {rstd = lunar.zeros(3)}) end, 'one element per row (4 rows)')
    T.raises(function() ops.rmsnorm(x, nil, 1e-5, {out = lunar.zeros(4, 9)}) end, 'has shape (4, 9), expected (4, 8)')
    T.raises(function() ops.rmsnorm(lunar.zeros(4, 8, 'i32')) end, "x 'tensor' (4, 8) must be a float tensor, not i32")
    T.raises(function() ops.rmsnorm_backward(lunar.zeros(4, 7), x, nil, lunar.zeros(4)) end, "dout 'tensor' has shape (4, 7)")
    T.raises(function() ops.layernorm(x, nil, lunar.zeros(9)) end, "layernorm_forward: b 'tensor' has shape (9), expected (8)")
    T.raises(function() ops.layernorm_backward_params(lunar.zeros(8), lunar.zeros(3), x, x, lunar.zeros(4), lunar.zeros(4)) end,
        "db 'tensor' has shape (3), expected (8)")
    local gone = lunar.randn(4, 8)
    gone:set_name('gone')
    gone:free()
    T.raises(function() ops.rmsnorm(gone) end, 'gone')
    T.raises(function() ops.rmsnorm_backward_params(lunar.zeros(8), x, x, lunar.zeros(5)) end, 'rstd')
end)

os.exit(T:run())
