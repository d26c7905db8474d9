-- test_ops_index.lua: embedding, index_select / index_add_, gather / scatter_ / scatter_add_
-- against plain-Lua references (torch semantics), gradient checks of the gathers through their
-- scatter counterparts, determinism across thread counts, and range / shape errors.
--
-- Tolerances: gathers copy values, so they are compared exactly (also in bf16); accumulating ops
-- are compared with the f64 reference at rtol 1e-5, atol 1e-4 (f32 adds in index order, up to
-- ~350 terms of size ~1 per element, each rounding by at most 2^-24 of the running sum);
-- gradchecks eps 1e-2 in f32, rtol 1e-2, atol 1e-3.
local lunar = require 'lunar'
local ops = lunar.ops
local T = require('lunar.testing').suite('ops.index')

lunar.manual_seed(777)

local ACC = {rtol = 1e-5, atol = 1e-4}

-- ---- multi-index helpers (0-based coordinates, row-major) ------------------------------------

local function numel(shape)
    local n = 1
    for _, s in ipairs(shape) do n = n * s end
    return n
end

local function unflat(k, shape)
    local mi = {}
    for d = #shape, 1, -1 do
        mi[d] = k % shape[d]
        k = math.floor(k / shape[d])
    end
    return mi
end

local function flat_at(mi, shape)
    local k = 0
    for d = 1, #shape do k = k * shape[d] + mi[d] end
    return k
end

local function with(mi, d, v)
    local o = {}
    for i = 1, #mi do o[i] = mi[i] end
    o[d] = v
    return o
end

local function dot(t, r)
    local a = t:tolist_flat()
    local s = 0
    for i = 1, #a do s = s + a[i] * r[i] end
    return s
end

-- ---- references (dims 1-based, index values 0-based) ------------------------------------------

local function ref_embedding(idv, wv, c)
    local out = {}
    for n = 1, #idv do for j = 1, c do out[(n - 1) * c + j] = wv[idv[n] * c + j] end end
    return out
end

local function ref_embedding_backward(dwv, dv, idv, c)
    local o = {}
    for i = 1, #dwv do o[i] = dwv[i] end
    for n = 1, #idv do for j = 1, c do o[idv[n] * c + j] = o[idv[n] * c + j] + dv[(n - 1) * c + j] end end
    return o
end

local function ref_index_select(sv, sshape, dim, idv)
    local oshape = {}
    for i = 1, #sshape do oshape[i] = sshape[i] end
    oshape[dim] = #idv
    local out = {}
    for k = 0, numel(oshape) - 1 do
        local mi = unflat(k, oshape)
        out[k + 1] = sv[flat_at(with(mi, dim, idv[mi[dim] + 1]), sshape) + 1]
    end
    return out
end

local function ref_index_add(dv, dshape, dim, idv, sv, alpha)
    local o = {}
    for i = 1, #dv do o[i] = dv[i] end
    local sshape = {}
    for i = 1, #dshape do sshape[i] = dshape[i] end
    sshape[dim] = #idv
    for k = 0, numel(sshape) - 1 do
        local mi = unflat(k, sshape)
        local at = flat_at(with(mi, dim, idv[mi[dim] + 1]), dshape) + 1
        o[at] = o[at] + alpha * sv[k + 1]
    end
    return o
end

local function ref_gather(sv, sshape, dim, iv, ishape)
    local out = {}
    for k = 0, numel(ishape) - 1 do
        local mi = unflat(k, ishape)
        out[k + 1] = sv[flat_at(with(mi, dim, iv[k + 1]), sshape) + 1]
    end
    return out
end

local function ref_scatter(dv, dshape, dim, iv, ishape, sv, sshape, accumulate)
    local o = {}
    for i = 1, #dv do o[i] = dv[i] end
    for k = 0, numel(ishape) - 1 do
        local mi = unflat(k, ishape)
        local at = flat_at(with(mi, dim, iv[k + 1]), dshape) + 1
        local v = sv[flat_at(mi, sshape) + 1]
        o[at] = accumulate and o[at] + v or v
    end
    return o
end

-- ---- embedding ----------------------------------------------------------------------------------

T:test('embedding forward: rows of weight by id, any id shape, i32 and i64', function()
    for _, c in ipairs({{1, 1, {1}}, {1000, 17, {3}}, {3, 1000, {17}}, {17, 3, {2, 5}}, {5, 4, {1000}}}) do
        local v, ch, ishape = c[1], c[2], c[3]
        local w = lunar.randn(v, ch)
        for _, dt in ipairs({'i64', 'i32'}) do
            local ids = lunar.randint(0, v, ishape, dt)
            local out = ops.embedding(ids, w)
            local want_shape = {}
            for i = 1, #ishape do want_shape[i] = ishape[i] end
            want_shape[#want_shape + 1] = ch
            T.equal(lunar.tensor(out:size()), want_shape, 'shape')
            T.equal(out, ref_embedding(ids:tolist_flat(), w:tolist_flat(), ch), ('V%d C%d %s'):format(v, ch, dt))
        end
    end
end)

T:test('embedding: strided weight and ids, strided out, bf16 weight (exact)', function()
    local v, c, n = 17, 9, 6
    local w = lunar.randn(c, v):t()                            -- (V, C) transposed
    local ids = lunar.randint(0, v, {n, 3}, 'i64'):select(2, 2) -- stride 3
    local obig = lunar.zeros(n, c + 2)
    ops.embedding(ids, w, {out = obig:narrow(2, 2, c)})
    T.equal(obig:narrow(2, 2, c), ref_embedding(ids:tolist_flat(), w:tolist_flat(), c), 'strided')
    T.equal(obig:select(2, 1), lunar.zeros(n), 'untouched')
    local wb = w:bf16()
    local ob = ops.embedding(ids, wb)
    assert(ob:dtype() == 'bf16')
    T.equal(ob, ref_embedding(ids:tolist_flat(), wb:tolist_flat(), c), 'bf16 rows are copied exactly')
end)

T:test('embedding_backward accumulates in index order, with repeated ids', function()
    for _, c in ipairs({{1, 1, 1}, {3, 17, 1000}, {17, 1000, 3}, {1000, 3, 17}}) do
        local v, ch, n = c[1], c[2], c[3]
        local ids = lunar.randint(0, v, {n}, 'i64')
        local d = lunar.randn(n, ch)
        local dw = lunar.randn(v, ch)
        local start = dw:tolist_flat()
        local ret = ops.embedding_backward(dw, d, ids)
        assert(ret == dw)
        T.close(dw, ref_embedding_backward(start, d:tolist_flat(), ids:tolist_flat(), ch), ACC)
    end
    -- the same id many times
    local ids = lunar.tensor({2, 2, 2, 0, 2}, 'i32')
    local d = lunar.randn(5, 4)
    local dw = ops.embedding_backward(lunar.zeros(3, 4), d, ids)
    T.close(dw, ref_embedding_backward(lunar.zeros(3, 4):tolist_flat(), d:tolist_flat(), {2, 2, 2, 0, 2}, 4), ACC)
end)

T:test('embedding gradcheck through embedding_backward', function()
    local v, c, n = 5, 3, 7
    local ids = lunar.tensor({0, 4, 4, 1, 0, 2, 4}, 'i64')
    local w, r = lunar.randn(v, c), lunar.randn(n, c)
    local rl = r:tolist_flat()
    local function loss(inp) return dot(ops.embedding(ids, inp[1]), rl) end
    local dw = ops.embedding_backward(lunar.zeros(v, c), r, ids)
    T.gradcheck{name = 'embedding', f = loss, inputs = {w}, grads = {dw}, eps = 1e-2, rtol = 1e-2, atol = 1e-3}
end)

-- ---- index_select / index_add_ --------------------------------------------------------------

T:test('index_select along every dim matches the reference', function()
    for _, shape in ipairs({{1}, {17}, {3, 1000}, {1000, 3}, {3, 17, 4}, {2, 1, 3}}) do
        local src = lunar.randn(shape)
        for dim = 1, #shape do
            for _, k in ipairs({1, 3, 17}) do
                local idx = lunar.randint(0, shape[dim], {k}, 'i64')
                local out = src:index_select(dim, idx)
                T.equal(out, ref_index_select(src:tolist_flat(), shape, dim, idx:tolist_flat()),
                    ('shape %s dim %d k %d'):format(table.concat(shape, 'x'), dim, k))
            end
        end
    end
    -- negative dims count from the end
    local s = lunar.randn(3, 4)
    local idx = lunar.tensor({3, 0}, 'i32')
    T.equal(ops.index_select(s, -1, idx), ops.index_select(s, 2, idx), 'dim -1')
end)

T:test('index_select with strided src / out and bf16', function()
    local src = lunar.randn(6, 5):t()   -- (5, 6)
    local idx = lunar.tensor({4, 0, 4}, 'i64')
    local obig = lunar.zeros(5, 3, 2)
    local out = obig:select(3, 2)
    ops.index_select(src, 2, idx, {out = out})
    T.equal(out, ref_index_select(src:tolist_flat(), {5, 6}, 2, {4, 0, 4}), 'strided')
    local sb = src:bf16()
    T.equal(ops.index_select(sb, 1, idx), ref_index_select(sb:tolist_flat(), {5, 6}, 1, {4, 0, 4}), 'bf16')
end)

T:test('index_add_ with alpha and repeated indices matches the reference', function()
    for _, shape in ipairs({{1}, {17}, {3, 1000}, {1000, 3}, {3, 17, 4}}) do
        for dim = 1, #shape do
            local k = 5
            local idx = lunar.randint(0, shape[dim], {k}, 'i64')
            local sshape = {}
            for i = 1, #shape do sshape[i] = shape[i] end
            sshape[dim] = k
            local src = lunar.randn(sshape)
            local dst = lunar.randn(shape)
            local start = dst:tolist_flat()
            local ret = dst:index_add_(dim, idx, src, {alpha = -0.5})
            assert(ret == dst)
            T.close(dst, ref_index_add(start, shape, dim, idx:tolist_flat(), src:tolist_flat(), -0.5), ACC)
        end
    end
end)

T:test('index_select gradcheck through index_add_', function()
    local src = lunar.randn(4, 5)
    local idx = lunar.tensor({3, 1, 3}, 'i64')
    local r = lunar.randn(4, 3)
    local rl = r:tolist_flat()
    local function loss(inp) return dot(ops.index_select(inp[1], 2, idx), rl) end
    local g = ops.index_add_(lunar.zeros(4, 5), 2, idx, r)
    T.gradcheck{name = 'index_select', f = loss, inputs = {src}, grads = {g}, eps = 1e-2, rtol = 1e-2, atol = 1e-3}
end)

-- ---- gather / scatter -------------------------------------------------------------------------

T:test('gather follows torch.gather, index smaller than src in other dims', function()
    for _, c in ipairs({{{17}, {3}}, {{3, 1000}, {2, 17}}, {{1000, 3}, {17, 3}}, {{3, 4, 5}, {2, 3, 4}}, {{1, 1}, {1, 1}}}) do
        local sshape, ishape = c[1], c[2]
        local src = lunar.randn(sshape)
        for dim = 1, #sshape do
            local idx = lunar.randint(0, sshape[dim], ishape, 'i64')
            local out = ops.gather(src, dim, idx)
            T.equal(out, ref_gather(src:tolist_flat(), sshape, dim, idx:tolist_flat(), ishape),
                ('src %s index %s dim %d'):format(table.concat(sshape, 'x'), table.concat(ishape, 'x'), dim))
        end
    end
    -- the index may be longer than src along dim
    local src = lunar.tensor({{1, 2}, {3, 4}})
    T.equal(src:gather(2, lunar.tensor({{0, 0, 1}, {1, 0, 1}}, 'i64')), {1, 1, 2, 4, 3, 4}, 'longer along dim')
end)

T:test('gather with strided src / index / out and bf16', function()
    local src = lunar.randn(7, 6):t()                               -- (6, 7)
    local idx = lunar.randint(0, 7, {4, 6}, 'i64'):t()              -- (6, 4) transposed
    local obig = lunar.zeros(6, 9)
    ops.gather(src, 2, idx, {out = obig:narrow(2, 3, 4)})
    T.equal(obig:narrow(2, 3, 4), ref_gather(src:tolist_flat(), {6, 7}, 2, idx:tolist_flat(), {6, 4}), 'strided')
    local sb = src:bf16()
    T.equal(ops.gather(sb, 2, idx), ref_gather(sb:tolist_flat(), {6, 7}, 2, idx:tolist_flat(), {6, 4}), 'bf16')
end)

T:test('scatter_ (last duplicate wins) and scatter_add_ follow torch', function()
    for _, c in ipairs({{{17}, {3}, {5}}, {{3, 1000}, {2, 17}, {3, 20}}, {{1000, 3}, {17, 3}, {17, 3}},
                        {{3, 4, 5}, {2, 3, 4}, {2, 3, 4}}}) do
        local dshape, ishape, sshape = c[1], c[2], c[3]
        for dim = 1, #dshape do
            local idx = lunar.randint(0, dshape[dim], ishape, 'i64')
            local src = lunar.randn(sshape)
            for _, acc in ipairs({false, true}) do
                local dst = lunar.randn(dshape)
                local start = dst:tolist_flat()
                local ret = acc and dst:scatter_add_(dim, idx, src) or dst:scatter_(dim, idx, src)
                assert(ret == dst)
                local want = ref_scatter(start, dshape, dim, idx:tolist_flat(), ishape, src:tolist_flat(), sshape, acc)
                local what = ('%s dst %s dim %d'):format(acc and 'scatter_add_' or 'scatter_', table.concat(dshape, 'x'), dim)
                if acc then T.close(dst, want, {rtol = ACC.rtol, atol = ACC.atol, msg = what})
                else T.equal(dst, want, what) end
            end
        end
    end
    local dst = lunar.zeros(4)
    dst:scatter_(1, lunar.tensor({1, 1, 3, 1}, 'i64'), lunar.tensor({10, 20, 30, 40}))
    T.equal(dst, {0, 40, 0, 30}, 'last duplicate wins')
end)

T:test('scatter into a strided dst, bf16 dst', function()
    local dst = lunar.zeros(5, 4):t()                                -- (4, 5) transposed
    local idx = lunar.tensor({{0, 4}, {1, 1}, {2, 3}}, 'i64')        -- (3, 2)
    local src = lunar.randn(3, 2)
    dst:scatter_add_(2, idx, src)
    T.close(dst, ref_scatter(lunar.zeros(4, 5):tolist_flat(), {4, 5}, 2, idx:tolist_flat(), {3, 2}, src:tolist_flat(),
        {3, 2}, true), ACC)
    local db = lunar.zeros(4, 5, 'bf16')
    db:scatter_(2, idx, src:bf16())
    T.equal(db, ref_scatter(lunar.zeros(4, 5):tolist_flat(), {4, 5}, 2, idx:tolist_flat(), {3, 2},
        src:bf16():tolist_flat(), {3, 2}, false), 'bf16')
end)

T:test('gather gradcheck through scatter_add_', function()
    local src = lunar.randn(3, 5)
    local idx = lunar.tensor({{4, 4, 0, 1}, {2, 2, 2, 3}}, 'i64')
    local r = lunar.randn(2, 4)
    local rl = r:tolist_flat()
    local function loss(inp) return dot(ops.gather(inp[1], 2, idx), rl) end
    local g = lunar.zeros(3, 5):scatter_add_(2, idx, r)
    T.gradcheck{name = 'gather', f = loss, inputs = {src}, grads = {g}, eps = 1e-2, rtol = 1e-2, atol = 1e-3}
end)

T:test('accumulating ops give the same bits with 1 and 2 threads', function()
    local v, c, n = 50, 700, 400
    local ids = lunar.randint(0, v, {n}, 'i64')
    local d = lunar.randn(n, c)
    local idx = lunar.randint(0, 60, {n}, 'i64')
    local src = lunar.randn(30, n, 40)
    local sidx = lunar.randint(0, 60, {30, n, 40}, 'i64')
    local before = lunar.threads()
    local res = {}
    for k, th in ipairs({1, 2}) do
        lunar.threads(th)
        res[k] = {
            ops.embedding_backward(lunar.zeros(v, c), d, ids),
            lunar.zeros(30, 60, 40):index_add_(2, idx, src),
            lunar.zeros(30, 60, 40):scatter_add_(2, sidx, src),
        }
    end
    lunar.threads(before)
    for j = 1, 3 do T.equal(res[1][j], res[2][j], 'op ' .. j) end
end)

-- ---- errors ---------------------------------------------------------------------------------------

T:test('out-of-range indices name the op, the value and the valid range', function()
    local w = lunar.randn(10, 4)
    w:set_name('embed_tokens.weight')
    local err = T.raises(function() ops.embedding(lunar.tensor({1, 10, 2}, 'i64'), w) end,
        "embedding_forward: index 10 (at flat position 1 of the index) out of range: weight 'embed_tokens.weight' has 10 entries")
    assert(err:find('valid 0..9', 1, true), err)
    assert(err:find('test_ops_index.lua:%d+:'), 'error points at the test line: ' .. err)
    T.raises(function() ops.embedding(lunar.tensor({-1}, 'i32'), w) end, 'index -1')
    T.raises(function() ops.embedding_backward(lunar.zeros(10, 4), lunar.zeros(1, 4), lunar.tensor({12}, 'i64')) end,
        'embedding_backward: index 12')
    T.raises(function() ops.index_select(w, 2, lunar.tensor({0, 4}, 'i64')) end, 'index_select: index 4')
    T.raises(function() lunar.zeros(3):index_add_(1, lunar.tensor({3}, 'i64'), lunar.ones(1)) end, 'index_add: index 3')
    T.raises(function() ops.gather(w, 1, lunar.tensor({{0}, {10}}, 'i64')) end, 'gather: index 10')
    T.raises(function() lunar.zeros(2, 2):scatter_(2, lunar.tensor({{0, 2}}, 'i64'), lunar.ones(1, 2)) end,
        'valid 0..1')
    T.raises(function() lunar.zeros(2, 2):scatter_add_(1, lunar.tensor({{-3}}, 'i64'), lunar.ones(1, 1)) end,
        'scatter_add: index -3')
end)

T:test('shape, dtype and dim errors', function()
    local w = lunar.randn(10, 4)
    T.raises(function() ops.embedding(lunar.tensor({1.0}), w) end, "ids 'tensor' (1) must be i32 or i64, not f32")
    T.raises(function() ops.embedding(lunar.tensor({1}, 'i64'), lunar.randn(10)) end, 'must be 2-dim (V, C)')
    T.raises(function() ops.embedding(lunar.tensor({1}, 'i64'), w, {out = lunar.zeros(1, 5)}) end,
        'has shape (1, 5), expected (1, 4)')
    T.raises(function() ops.embedding_backward(lunar.zeros(10, 4), lunar.zeros(2, 4), lunar.tensor({1}, 'i64')) end,
        "dout 'tensor' has shape (2, 4), expected (1, 4)")
    T.raises(function() ops.index_select(w, 1, lunar.tensor({{1}}, 'i64')) end, 'index must be 1-dim')
    T.raises(function() ops.index_select(w, 3, lunar.tensor({1}, 'i64')) end, 'dim 3 out of range')
    T.raises(function() ops.index_select(w, 0, lunar.tensor({1}, 'i64')) end, 'dims are 1-based')
    T.raises(function() lunar.zeros(3, 4):index_add_(1, lunar.tensor({0, 1}, 'i64'), lunar.ones(3, 4)) end,
        "src 'tensor' has shape (3, 4), expected (2, 4)")
    T.raises(function() ops.gather(w, 1, lunar.tensor({1}, 'i64')) end, 'index must have as many dims as the data')
    T.raises(function() ops.gather(w, 1, lunar.zeros(2, 5, 'i64')) end, 'index is larger than src in dim 1 (5 > 4)')
    -- a dim out of range is reported in the caller's (1-based) numbering, for every index op
    local z2, i2 = lunar.zeros(2, 2), lunar.zeros(2, 2, 'i64')
    T.raises(function() ops.gather(z2, 3, i2) end, 'gather: dim 3 out of range for a 2-dim tensor of shape (2, 2)')
    T.raises(function() ops.index_select(z2, -3, lunar.zeros(1, 'i64')) end, 'index_select: dim -3 out of range')
    T.raises(function() z2:scatter_add_(3, i2, z2) end, 'scatter_add_: dim 3 out of range')
    T.raises(function() z2:index_add_(5, lunar.zeros(2, 'i64'), z2) end, 'index_add_: dim 5 out of range')
    T.raises(function() lunar.zeros(2, 2):scatter_(1, lunar.zeros(2, 2, 'i64'), lunar.ones(1, 2)) end,
        'index is larger than src in dim 0 (2 > 1)')
    T.raises(function() lunar.zeros(2, 2, 'i32'):scatter_(1, lunar.zeros(1, 1, 'i64'), lunar.ones(1, 1)) end,
        "must be a float tensor")
end)

-- ---- index_select_sum (the MoE combine) and bincount (its expert counts) ------------------------

-- the reference bits: index_add_ of src's rows, each row of index in k order, into base (or 0s)
local function sum_by_index_add(src, index, base)
    local n, k = index:size(1), index:size(2)
    local tok = {}
    for r = 0, n - 1 do for _ = 1, k do tok[#tok + 1] = r end end
    local rows = ops.index_select(src, 1, index:contiguous():view(n * k))
    local out = base and base:clone() or lunar.zeros(n, src:size(2)):to(src:dtype())
    return out:index_add_(1, lunar.tensor(tok, 'i64'), rows)
end

T:test('index_select_sum: each row of index summed in k order, the bits of index_add_ in that order', function()
    for _, c in ipairs({{1, 1, 1, 1}, {6, 3, 17, 2}, {40, 300, 17, 8}, {5, 600, 3, 5}, {9, 4, 1000, 1}}) do
        local r, ch, n, k = c[1], c[2], c[3], c[4]
        local msg = ('R%d C%d N%d K%d'):format(r, ch, n, k)
        local src = lunar.randn(r, ch)
        local index = lunar.randint(0, r, {n, k}, 'i64')   -- repeats within a row too
        T.equal(ops.index_select_sum(src, index), sum_by_index_add(src, index), msg)
        local base = lunar.randn(n, ch)
        local acc = base:clone()
        ops.index_select_sum(src, index:to('i32'), {out = acc, accumulate = true})
        T.equal(acc, sum_by_index_add(src, index, base), msg .. ' accumulate, i32 index')
    end
    -- the order is k's: (1e8 + 1) - 1e8 is 0 in f32, 1e8 - 1e8 + 1 is 1
    local src = lunar.tensor({{1e8}, {1}, {-1e8}})
    T.equal(ops.index_select_sum(src, lunar.tensor({{0, 1, 2}, {0, 2, 1}}, 'i64')), {0, 1}, 'k order')
    -- bf16: summed in f32 and rounded once (256 + 1 + 1 = 258; rounding after each add gives 256)
    local b = lunar.tensor({{256}, {1}}):bf16()
    local got = ops.index_select_sum(b, lunar.tensor({{0, 1, 1}}, 'i64'))
    assert(got:dtype() == 'bf16')
    T.equal(got, {258}, 'bf16 rounds once')
    local bsrc, bidx = lunar.randn(30, 70):bf16(), lunar.randint(0, 30, {11, 8}, 'i64')
    T.equal(ops.index_select_sum(bsrc, bidx), sum_by_index_add(bsrc, bidx), 'bf16 = index_add_ in bf16')
    -- a strided out keeps its other elements; K = 0 gives zeros (or leaves out as it was)
    local big = lunar.ones(4, 7)
    local s2 = lunar.randn(3, 5)
    local i2 = lunar.tensor({{2, 0}, {1, 1}, {0, 2}, {2, 2}}, 'i64')
    ops.index_select_sum(s2, i2, {out = big:narrow(2, 2, 5), accumulate = true})
    T.equal(big:narrow(2, 2, 5), sum_by_index_add(s2, i2, lunar.ones(4, 5)), 'strided out')
    T.equal(big:select(2, 1), lunar.ones(4), 'untouched column')
    T.equal(ops.index_select_sum(s2, lunar.zeros(4, 0, 'i64')), lunar.zeros(4, 5), 'K = 0')
    T.raises(function() ops.index_select_sum(s2, lunar.tensor({{0, 3}}, 'i64')) end,
        "index_select_sum: index 3 (at flat position 1 of the index) out of range: src 'tensor' has 3 entries")
    T.raises(function() ops.index_select_sum(s2, lunar.tensor({{-1}}, 'i64')) end, 'index_select_sum: index -1')
    T.raises(function() ops.index_select_sum(lunar.randn(3), i2) end, 'src must be 2-dim (rows, C)')
    T.raises(function() ops.index_select_sum(s2, lunar.tensor({0, 1}, 'i64')) end, 'index must be 2-dim (N, K)')
    T.raises(function() ops.index_select_sum(s2, i2, {out = lunar.zeros(4, 4)}) end, 'has shape (4, 4), expected (4, 5)')
    T.raises(function() ops.index_select_sum(s2, i2, {accumulate = true}) end, 'accumulate = true needs out =')
    T.raises(function() ops.index_select_sum(s2, lunar.zeros(4, 2)) end, 'must be i32 or i64, not f32')
    -- one dtype for src and out: a device summing in out's dtype would round an f32 src first
    T.raises(function() ops.index_select_sum(s2, i2, {out = lunar.zeros(4, 5, {dtype = 'bf16'})}) end,
        "is f32 but out 'tensor' is bf16: give both one dtype")
end)

T:test('bincount: how often each value occurs, any shape, i32 and i64; values outside the bins are errors', function()
    for _, c in ipairs({{1, {1}}, {7, {3, 50}}, {300, {1000}}, {5, {0}}}) do
        local bins, shape = c[1], c[2]
        for _, dt in ipairs({'i64', 'i32'}) do
            local v = lunar.randint(0, bins, shape, dt)
            local want = {}
            for b = 1, bins do want[b] = 0 end
            for _, x in ipairs(v:tolist_flat()) do want[x + 1] = want[x + 1] + 1 end
            local got = ops.bincount(v, bins)
            assert(got:dtype() == 'i64' and got:dim() == 1 and got:size(1) == bins, 'i64 (bins)')
            T.equal(got, want, ('bins %d %s'):format(bins, dt))
            local out32 = lunar.zeros(bins, 'i32'):fill_(7)
            ops.bincount(v, bins, {out = out32})
            T.equal(out32, want, 'into an i32 out (every bin written)')
        end
    end
    T.raises(function() ops.bincount(lunar.tensor({0, 5}, 'i64'), 5) end,
        "bincount: index 5 (at flat position 1 of the index) out of range: counts 'tensor' has 5 entries")
    T.raises(function() ops.bincount(lunar.tensor({-2}, 'i32'), 5) end, 'bincount: index -2')
    -- no bin at all: every value is out of range (no kernel would look at them on a device)
    T.raises(function() ops.bincount(lunar.tensor({0, 1}, 'i64'), 0) end, 'has 2 entries but counts')
    T.equal(ops.bincount(lunar.zeros(0, 'i64'), 0):numel(), 0, 'no value, no bin')
    T.raises(function() ops.bincount(lunar.tensor({0}, 'i64'), 2.5) end, 'bins must be a non-negative integer')
    T.raises(function() ops.bincount(lunar.tensor({0.0}), 3) end, "values 'tensor' (1) must be i32 or i64, not f32")
    T.raises(function() ops.bincount(lunar.tensor({0}, 'i64'), 3, {out = lunar.zeros(3)}) end,
        'must be i32 or i64, not f32')
    T.raises(function() ops.bincount(lunar.tensor({0}, 'i64'), 3, {out = lunar.zeros(3, 1, 'i64')}) end,
        'counts must be 1-dim (one per bin)')
end)

os.exit(T:run())
