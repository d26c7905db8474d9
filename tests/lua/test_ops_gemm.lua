-- test_ops_gemm.lua: gemm and matmul against a naive Lua triple loop, on odd shapes, views,
-- batches, accumulation and bf16; shape errors; the matmul backward expressed with gemm.
--
-- Tolerances: f32 results are compared with the f64 Lua loop at rtol = atol = 1e-4 (sums of up
-- to 1000 f32 products of N(0,1) values); bf16 inputs are compared with the loop over the same
-- bf16-rounded values, so only f32 accumulation (and, for a bf16 c, one rounding to 8
-- significant bits: rtol 2^-7) remains.
local lunar = require 'lunar'
local T = require('lunar.testing').suite('ops.gemm')

lunar.manual_seed(1234)

-- element (bi, i, j) of a 2-D or 3-D tensor (1-based); 2-D tensors ignore bi
local function getter(t)
    local v, s = t:tolist_flat(), t:size()
    if #s == 2 then return function(_, i, j) return v[(i - 1) * s[2] + j] end, s end
    return function(bi, i, j) return v[((bi - 1) * s[2] + i - 1) * s[3] + j] end, s
end

-- alpha * op(a) @ op(b) + beta * c0, flat in row-major order of c
local function ref_gemm(a, b, ta, tb, alpha, beta, c0)
    alpha, beta = alpha or 1, beta or 0
    local ga, sa = getter(a)
    local gb, sb = getter(b)
    local na, nb = #sa, #sb
    local m, k = sa[ta and na or na - 1], sa[ta and na - 1 or na]
    local n = sb[tb and nb - 1 or nb]
    local batch = (na == 3 and sa[1]) or (nb == 3 and sb[1]) or 1
    local c0v = c0 and c0:tolist_flat()
    local out = {}
    for bi = 1, batch do
        for i = 1, m do
            for j = 1, n do
                local s = 0
                for kk = 1, k do
                    local x = ta and ga(bi, kk, i) or ga(bi, i, kk)
                    local y = tb and gb(bi, j, kk) or gb(bi, kk, j)
                    s = s + x * y
                end
                local idx = #out + 1
                out[idx] = alpha * s + (beta ~= 0 and beta * c0v[idx] or 0)
            end
        end
    end
    return out
end

local F32 = {rtol = 1e-4, atol = 1e-4}

local function pool_gets()
    local s = lunar.memory_stats()
    return s.allocs + s.reuses
end

T:test('2-D, every trans combination, odd shapes incl. 1, 3, 17 and 1000', function()
    local shapes = {{1, 1, 1}, {3, 17, 1}, {17, 3, 5}, {1, 1000, 3}, {1000, 3, 2}, {17, 17, 17}}
    for _, s in ipairs(shapes) do
        local m, k, n = s[1], s[2], s[3]
        for _, ta in ipairs({false, true}) do
            for _, tb in ipairs({false, true}) do
                local a = ta and lunar.randn(k, m) or lunar.randn(m, k)
                local b = tb and lunar.randn(n, k) or lunar.randn(k, n)
                local c = lunar.ops.gemm(a, b, {trans_a = ta, trans_b = tb})
                assert(c:size(1) == m and c:size(2) == n and c:dtype() == 'f32')
                F32.msg = ('%dx%dx%d ta=%s tb=%s'):format(m, k, n, tostring(ta), tostring(tb))
                T.close(c, ref_gemm(a, b, ta, tb), F32)
            end
        end
    end
    F32.msg = nil
end)

T:test('transposed and narrowed views are read in place; other views are copied', function()
    local m, k, n = 17, 3, 5
    local out = lunar.empty(m, n)
    local views_a = {
        lunar.randn(m, k),                               -- contiguous
        lunar.randn(k, m):t(),                           -- unit stride in dim 1: flipped trans
        lunar.randn(m, k + 4):narrow(2, 3, k),           -- row stride k + 4
        lunar.randn(m, 2, k):select(2, 2),               -- row stride 2k
        lunar.randn(k + 2, m):narrow(1, 2, k):t(),       -- transposed and narrowed
    }
    local views_b = {
        lunar.randn(k, n),
        lunar.randn(n, k):t(),
        lunar.randn(k, n + 9):narrow(2, 9, n),
    }
    for ia, a in ipairs(views_a) do
        for ib, b in ipairs(views_b) do
            local before = pool_gets()
            lunar.ops.gemm(a, b, {out = out})
            assert(pool_gets() == before, ('view a%d b%d was copied'):format(ia, ib))
            T.close(out, ref_gemm(a, b, false, false), {rtol = 1e-4, atol = 1e-4, msg = ('a%d b%d'):format(ia, ib)})
            -- the same views used with trans flags
            local at, bt = a:t(), b:t()
            lunar.ops.gemm(at, bt, {out = out, trans_a = true, trans_b = true})
            T.close(out, ref_gemm(a, b, false, false), {rtol = 1e-4, atol = 1e-4, msg = 'trans views'})
        end
    end
    -- no unit stride at all (every other element) and an expanded matrix: copied, same result
    local strided = lunar.randn(m, k, 2):select(3, 1)
    local expanded = lunar.randn(k, 1):expand(k, n)
    local before = pool_gets()
    lunar.ops.gemm(strided, expanded, {out = out})
    assert(pool_gets() > before, 'a view without unit stride needs a contiguous copy')
    T.close(out, ref_gemm(strided, expanded, false, false), F32)
end)

T:test('beta accumulation into contiguous, narrowed, transposed and bf16 outputs', function()
    local m, k, n = 3, 17, 17
    local a, b = lunar.randn(m, k), lunar.randn(k, n)
    -- contiguous, alpha and beta
    local c = lunar.randn(m, n)
    local want = ref_gemm(a, b, false, false, 0.5, 2, c)
    lunar.ops.gemm(a, b, {out = c, alpha = 0.5, beta = 2})
    T.close(c, want, F32)
    -- narrowed: columns outside the view stay untouched
    local parent = lunar.randn(m, n + 4)
    local keep = parent:narrow(2, 1, 2):clone()
    local cv = parent:narrow(2, 3, n)
    want = ref_gemm(a, b, false, false, 1, 1, cv)
    lunar.ops.gemm(a, b, {out = cv, beta = 1})
    T.close(cv, want, F32)
    T.equal(parent:narrow(2, 1, 2), keep, 'outside the narrowed out')
    -- transposed out (unit stride in dim 1): computed as c^T = b^T a^T in place
    local ct = lunar.randn(n, m):t()
    want = ref_gemm(a, b, false, false, -1, 0.25, ct)
    local before = pool_gets()
    lunar.ops.gemm(a, b, {out = ct, alpha = -1, beta = 0.25})
    assert(pool_gets() == before, 'a transposed out is written in place')
    T.close(ct, want, F32)
    -- beta = 0 ignores whatever c holds, NaN included
    local cn = lunar.full({m, n}, 0 / 0)
    lunar.ops.gemm(a, b, {out = cn, beta = 0})
    T.close(cn, ref_gemm(a, b, false, false), F32)
    -- bf16 out: one rounding of the f32 result
    local cb = lunar.randn(m, n):bf16()
    want = ref_gemm(a, b, false, false, 1, 1, cb)
    lunar.ops.gemm(a, b, {out = cb, beta = 1})
    assert(cb:dtype() == 'bf16')
    T.close(cb, want, {rtol = 2 ^ -7, atol = 1e-3})
end)

T:test('an out that is an input (x = x @ w, w = a @ w, batched, transposed) is computed from the inputs', function()
    -- BLAS read the c it was writing: out = a gave garbage (beta = 0) without an error
    for _, n in ipairs({3, 64}) do
        local a, b = lunar.randn(n, n), lunar.randn(n, n)
        local want = ref_gemm(a, b, false, false)
        local a2 = a:clone()
        lunar.ops.gemm(a2, b, {out = a2})
        T.close(a2, want, F32)
        local b2 = b:clone()
        lunar.ops.gemm(a, b2, {out = b2})
        T.close(b2, want, F32)
        local c = a:clone()
        lunar.ops.gemm(c, b, {out = c, alpha = 2, beta = 0.5})
        T.close(c, ref_gemm(a, b, false, false, 2, 0.5, a), F32)
        local at = a:clone()
        lunar.ops.gemm(at:t(), b, {out = at, trans_a = false})
        T.close(at, ref_gemm(a:t():contiguous(), b, false, false), F32)
    end
    local x, w = lunar.randn(2, 5, 5), lunar.randn(5, 5)
    local want = ref_gemm(x, w, false, false)
    lunar.ops.matmul(x, w, {out = x})
    T.close(x, want, F32)
end)

T:test('batched: 3-D @ 3-D, shared 2-D operands, views, batch stride 0, batched out views', function()
    for _, s in ipairs({{1, 3, 17, 5}, {17, 3, 5, 2}, {3, 70, 70, 70}, {4, 1000, 3, 2}}) do
        local bsz, m, k, n = s[1], s[2], s[3], s[4]
        local msg = ('batch %d, %dx%dx%d'):format(bsz, m, k, n)
        local a3, b3 = lunar.randn(bsz, m, k), lunar.randn(bsz, k, n)
        local a2, b2 = lunar.randn(m, k), lunar.randn(k, n)
        local function tol(what) return {rtol = 1e-4, atol = 1e-4, msg = msg .. what} end
        T.close(lunar.ops.gemm(a3, b3), ref_gemm(a3, b3, false, false), tol(''))
        T.close(lunar.ops.gemm(a3, b2), ref_gemm(a3, b2, false, false), tol(' shared b'))
        T.close(lunar.ops.gemm(a2, b3), ref_gemm(a2, b3, false, false), tol(' shared a'))
        -- transposed per-batch views with trans flags, and a batch dim that is not outermost in memory
        local at = lunar.randn(bsz, k, m):transpose(2, 3)             -- (bsz, m, k), unit stride in dim 2
        local bp = lunar.randn(n, bsz, k):permute(2, 1, 3)            -- (bsz, n, k), batch stride k
        local c = lunar.ops.gemm(at, bp, {trans_b = true})
        T.close(c, ref_gemm(at, bp, false, true), tol(' views'))
        -- one matrix repeated over the batch (batch stride 0)
        local ae = lunar.randn(1, m, k):expand(bsz, m, k)
        T.close(lunar.ops.gemm(ae, b3), ref_gemm(ae, b3, false, false), tol(' expand'))
        -- batched out that is transposed per batch, with accumulation
        local co = lunar.randn(bsz, n, m):transpose(2, 3)
        local want = ref_gemm(a3, b3, false, false, 2, 1, co)
        lunar.ops.gemm(a3, b3, {out = co, alpha = 2, beta = 1})
        T.close(co, want, tol(' transposed out'))
    end
end)

T:test('bf16 inputs (f32 accumulation), bf16 and f32 outputs', function()
    local m, k, n = 17, 1000, 3
    local a, b = lunar.randn(m, k):bf16(), lunar.randn(n, k):bf16()
    local c = lunar.ops.gemm(a, b, {trans_b = true})
    assert(c:dtype() == 'bf16')
    -- reference over the same bf16 values (read back exactly as f32)
    local want = ref_gemm(a:float(), b:float(), false, true)
    T.close(c, want, {rtol = 2 ^ -7, atol = 1e-3})
    local c32 = lunar.empty(m, n)
    lunar.ops.gemm(a, b, {trans_b = true, out = c32})
    T.close(c32, want, {rtol = 1e-4, atol = 1e-3})
    -- mixed input dtypes compute in f32 and give f32
    local cm = lunar.ops.gemm(a, b:float(), {trans_b = true})
    assert(cm:dtype() == 'f32')
    T.close(cm, want, {rtol = 1e-4, atol = 1e-3})
end)

T:test('matmul: like torch.matmul for 1-D, 2-D and 3-D', function()
    local a, b = lunar.randn(3, 17), lunar.randn(17, 5)
    T.close(lunar.ops.matmul(a, b), ref_gemm(a, b, false, false), F32)
    T.close(a:matmul(b), ref_gemm(a, b, false, false), F32)
    local a3, b3 = lunar.randn(2, 3, 17), lunar.randn(2, 17, 5)
    local c3 = a3:matmul(b3)
    assert(c3:dim() == 3 and c3:size(1) == 2)
    T.close(c3, ref_gemm(a3, b3, false, false), F32)
    T.close(a3:matmul(b), ref_gemm(a3, b, false, false), F32)
    T.close(a:matmul(b3), ref_gemm(a, b3, false, false), F32)
    -- vectors
    local v = lunar.randn(17)
    local mv = a:matmul(v)
    assert(mv:dim() == 1 and mv:size(1) == 3)
    T.close(mv, ref_gemm(a, v:view(17, 1), false, false), F32)
    local vm = v:matmul(b)
    assert(vm:dim() == 1 and vm:size(1) == 5)
    T.close(vm, ref_gemm(v:view(1, 17), b, false, false), F32)
    local dot = v:matmul(v)
    assert(dot:dim() == 0)
    T.close(dot, ref_gemm(v:view(1, 17), v:view(17, 1), false, false), F32)
    -- into an out view
    local o = lunar.zeros(5, 3)
    lunar.ops.matmul(a, b, {out = o:t()})
    T.close(o:t(), ref_gemm(a, b, false, false), F32)
end)

T:test('empty dims: k = 0 scales c by beta, m = 0 is a no-op', function()
    local a, b = lunar.empty(3, 0), lunar.empty(0, 4)
    local c = lunar.full({3, 4}, 2)
    lunar.ops.gemm(a, b, {out = c, beta = 3})
    T.equal(c, lunar.full({3, 4}, 6), 'beta * c')
    lunar.ops.gemm(a, b, {out = c})
    T.equal(c, lunar.zeros(3, 4), 'beta = 0')
    local e = lunar.ops.gemm(lunar.empty(0, 3), lunar.randn(3, 4))
    assert(e:size(1) == 0 and e:size(2) == 4)
end)

T:test('errors name both shapes and the problem', function()
    local a, b = lunar.randn(3, 4), lunar.randn(5, 6)
    a:set_name('x')
    b:set_name('w')
    local err = T.raises(function() lunar.ops.gemm(a, b) end, 'inner dims differ (4 vs 5)')
    assert(err:find("'x' (3, 4)", 1, true) and err:find("'w' (5, 6)", 1, true), err)
    assert(err:find('test_ops_gemm.lua:%d+:'), 'error points at the caller: ' .. err)
    err = T.raises(function() lunar.ops.matmul(a, b) end, 'do not fit')
    assert(err:find('(3, 4)', 1, true) and err:find('(5, 6)', 1, true), err)
    T.raises(function() lunar.ops.gemm(a, b, {trans_a = true}) end, "'x' (3, 4) (transposed)")
    T.raises(function() lunar.ops.gemm(lunar.randn(2, 3, 4), lunar.randn(3, 4, 5)) end, 'batch sizes differ')
    T.raises(function() lunar.ops.gemm(lunar.randn(3, 4), lunar.randn(4, 5), {out = lunar.empty(3, 6)}) end,
        'has shape (3, 6), expected (3, 5)')
    T.raises(function() lunar.ops.gemm(lunar.randn(2, 3, 4), lunar.randn(4, 5), {out = lunar.empty(3, 5)}) end,
        'expected (2, 3, 5)')
    T.raises(function() lunar.ops.gemm(lunar.randn(4), lunar.randn(4, 5), {out = lunar.empty(1, 5)}) end,
        'must be 2-dim or 3-dim')
    T.raises(function() lunar.ops.matmul(lunar.randn(2, 2, 2, 2), lunar.randn(2, 2)) end, 'must have 1 to 3 dims')
    T.raises(function() lunar.ops.gemm(lunar.ones(3, 4, {dtype = 'i64'}), lunar.randn(4, 5)) end,
        'must be a float tensor, not i64')
    local expanded = lunar.randn(3, 1):expand(3, 5)
    T.raises(function() lunar.ops.gemm(lunar.randn(3, 4), lunar.randn(4, 5), {out = expanded}) end,
        'expanded (broadcast) view')
    local freed = lunar.randn(4, 5)
    freed:set_name('gone')
    freed:free()
    T.raises(function() lunar.ops.gemm(lunar.randn(3, 4), freed, {out = lunar.empty(3, 5)}) end, 'gone')
end)

-- loss = sum(C .* W) with C = A @ B: dA = W B^T, dB = A^T W (the matmul backward as two gemms).
-- gemm is linear in each input, so central differences are exact up to f32 rounding of the
-- forward: eps = 0.01, rtol = atol = 1e-3.
T:test('gradcheck: matmul backward with gemm (2-D and batched with a shared weight)', function()
    local function loss_of(c, w)
        local cv, wv = c:tolist_flat(), w:tolist_flat()
        local s = 0
        for i = 1, #cv do s = s + cv[i] * wv[i] end
        return s
    end
    local A, B, W = lunar.randn(3, 4), lunar.randn(4, 5), lunar.randn(3, 5)
    local dA = lunar.ops.gemm(W, B, {trans_b = true})
    local dB = lunar.ops.gemm(A, W, {trans_a = true})
    T.gradcheck{name = 'matmul 2-D', inputs = {A, B}, grads = {dA, dB}, eps = 1e-2, rtol = 1e-3, atol = 1e-3,
        f = function(x) return loss_of(lunar.ops.matmul(x[1], x[2]), W) end}
    -- batched activations (2, 3, 4) times a shared weight (4, 5): dB sums over the batch
    local X, W3 = lunar.randn(2, 3, 4), lunar.randn(2, 3, 5)
    local dX = lunar.ops.gemm(W3, B, {trans_b = true})
    local dW = lunar.ops.gemm(X:view(6, 4), W3:view(6, 5), {trans_a = true})
    T.gradcheck{name = 'matmul batched', inputs = {X, B}, grads = {dX, dW}, eps = 1e-2, rtol = 1e-3, atol = 1e-3,
        f = function(x) return loss_of(lunar.ops.matmul(x[1], x[2]), W3) end}
    -- accumulation into a parameter gradient (+=) with beta = 1
    local acc = dB:clone()
    lunar.ops.gemm(A, W, {trans_a = true, out = acc, beta = 1})
    T.close(acc, (dB * 2), {rtol = 1e-6, atol = 1e-6})
end)

os.exit(T:run())
