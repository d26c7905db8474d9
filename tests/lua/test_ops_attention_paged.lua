-- test_ops_attention_paged.lua: lunar.ops.attention_paged, decode attention read in place from a
-- paged KV cache (lunar_attention_paged in lunar/ops.h; the decode step of lunar.generate):
--   * against a plain-Lua reference in double (rows found through the block table, softmax over
--     the attended positions) at rtol/atol 1e-5: GQA groups, one shared head (MLA: v a narrowed
--     view of k), lengths that end inside a block and on its edge, a table wider than a
--     sequence's blocks, DSA key lists with repeats and entries past the length;
--   * against ops.attention on the gathered dense cache with its mask;
--   * a sequence gets the same bits alone and in any batch, with 1 and 2 threads;
--   * a bf16 cache is read as it is (the same result as the f32 copy of its values);
--   * errors name the tensor: a block id outside the cache, a length of 0 or past the table,
--     shapes, dtypes, block size.
local lunar = require 'lunar'
local ops = lunar.ops
local T = require('lunar.testing').suite('ops.attention_paged')

lunar.manual_seed(37)

local function i64(list, shape) return lunar.tensor(list, {dtype = 'i64'}):view(shape) end

-- plain-Lua reference: o (B, NH, Dv) flat
local function ref(q, k, v, tbl, lengths, keys, bs, scale)
    local B, NH, Dq = unpack(q:size())
    local Hk = k:size(2) / Dq
    local Dv = v:size(2) / Hk
    local qf, kf, vf = q:contiguous():to('f64'):tolist_flat(), k:to('f64'):contiguous():tolist_flat(),
        v:to('f64'):contiguous():tolist_flat()
    local kw, vw = k:size(2), v:size(2)
    local tf, lf = tbl:tolist_flat(), lengths:tolist_flat()
    local NB = tbl:size(2)
    local kl = keys and keys:tolist_flat()
    local K = keys and keys:size(2)
    local out = {}
    for b = 0, B - 1 do
        local len = lf[b + 1]
        local pos = {}
        if kl then
            local last = -1
            for j = 0, K - 1 do
                local t = kl[b * K + j + 1]
                if t >= 0 and t < len and t > last then pos[#pos + 1] = t; last = t end
            end
        else
            for t = 0, len - 1 do pos[#pos + 1] = t end
        end
        for h = 0, NH - 1 do
            local g = math.floor(h / (NH / Hk))
            local sc, mx = {}, -math.huge
            for i, t in ipairs(pos) do
                local row = tf[b * NB + math.floor(t / bs) + 1] * bs + t % bs
                local d = 0
                for c = 0, Dq - 1 do d = d + qf[(b * NH + h) * Dq + c + 1] * kf[row * kw + g * Dq + c + 1] end
                sc[i] = {row, d * scale}
                if d * scale > mx then mx = d * scale end
            end
            local z = 0
            for _, s in ipairs(sc) do s[3] = math.exp(s[2] - mx); z = z + s[3] end
            for c = 0, Dv - 1 do
                local acc = 0
                for _, s in ipairs(sc) do acc = acc + s[3] / z * vf[s[1] * vw + g * Dv + c + 1] end
                out[(b * NH + h) * Dv + c + 1] = acc
            end
        end
    end
    return lunar.tensor(out, {dtype = 'f64'}):view({B, NH, Dv})
end

-- a cache of nblocks blocks and a random table for the given lengths (blocks not shared)
local function layout(lens, bs, nblocks, NB)
    local perm = {}
    for i = 0, nblocks - 1 do perm[#perm + 1] = i end
    for i = #perm, 2, -1 do
        local j = math.random(i)
        perm[i], perm[j] = perm[j], perm[i]
    end
    local flat, used = {}, 0
    for _, len in ipairs(lens) do
        local need = math.ceil(len / bs)
        for j = 1, NB do
            if j <= need then used = used + 1; flat[#flat + 1] = perm[used] else flat[#flat + 1] = flat[#flat - j + 2] end
        end
    end
    return i64(flat, {#lens, NB}), i64(lens, {#lens})
end

math.randomseed(5)

T:test('against plain Lua: GQA, one shared head (MLA), lengths at and inside block edges', function()
    local bs = 4
    local lens = {1, 4, 5, 11, 16}
    local tbl, lengths = layout(lens, bs, 24, 5)
    for _, c in ipairs({{NH = 4, Hk = 2, Dq = 8, Dv = 8}, {NH = 6, Hk = 6, Dq = 5, Dv = 7},
                        {NH = 3, Hk = 1, Dq = 12, Dv = 9, mla = true}}) do
        local q = lunar.randn(#lens, c.NH, c.Dq)
        local k = lunar.randn(24 * bs, c.Hk * c.Dq)
        local v = c.mla and k:narrow(2, 1, c.Dv) or lunar.randn(24 * bs, c.Hk * c.Dv)
        local scale = c.Dq ^ -0.5
        local o = ops.attention_paged(q, k, v, tbl, lengths, {block_size = bs, scale = scale})
        T.equal(o:size(), {#lens, c.NH, c.Dv}, 'shape')
        T.close(o:to('f64'), ref(q, k, v, tbl, lengths, nil, bs, scale), {rtol = 1e-5, atol = 1e-5})
    end
end)

T:test('DSA key lists: repeats, entries past the length and negative ones count nothing', function()
    local bs = 3
    local lens = {7, 10, 2}
    local tbl, lengths = layout(lens, bs, 12, 4)
    local q = lunar.randn(3, 2, 6)
    local k = lunar.randn(36, 6)
    local v = k:narrow(2, 1, 4)
    local keys = i64({0, 2, 2, 5, 6, 9,      1, 3, 4, 8, 9, 9,      -1, 0, 1, 1, 2, 40}, {3, 6})
    local o = ops.attention_paged(q, k, v, tbl, lengths, {block_size = bs, keys = keys})
    T.close(o:to('f64'), ref(q, k, v, tbl, lengths, keys, bs, 6 ^ -0.5), {rtol = 1e-5, atol = 1e-5})
end)

T:test('equals ops.attention over the gathered cache with its mask', function()
    local bs, B, NH, Hk, D = 8, 3, 4, 2, 16
    local lens = {9, 24, 3}
    local NB = 3
    local tbl, lengths = layout(lens, bs, 10, NB)
    local q = lunar.randn(B, NH, D)
    local k, v = lunar.randn(10 * bs, Hk * D), lunar.randn(10 * bs, Hk * D)
    local o = ops.attention_paged(q, k, v, tbl, lengths, {block_size = bs})
    -- dense: rows of each sequence's blocks, in order, masked past its length
    local rows = {}
    for _, blk in ipairs(tbl:tolist_flat()) do for r = 0, bs - 1 do rows[#rows + 1] = blk * bs + r end end
    local idx = i64(rows, {#rows})
    local K = ops.index_select(k, 1, idx):view({B, NB * bs, Hk, D})
    local V = ops.index_select(v, 1, idx):view({B, NB * bs, Hk, D})
    local mask = lunar.zeros(B, 1, NB * bs)
    for b = 1, B do
        if lens[b] < NB * bs then mask:select(1, b):narrow(2, lens[b] + 1, NB * bs - lens[b]):fill_(-3.4e38) end
    end
    local dense = ops.attention(q:view({B, 1, NH, D}), K, V, {mask = mask})
    T.close(o, dense:view({B, NH, D}), {rtol = 1e-5, atol = 1e-6})
end)

T:test('a sequence gets the same bits alone and in any batch, with 1 or 2 threads', function()
    local bs, NH, D = 16, 8, 32
    local lens = {1, 17, 200, 64, 33, 90}
    local B = #lens
    local tbl, lengths = layout(lens, bs, 40, 13)
    local q = lunar.randn(B, NH, D)
    local k, v = lunar.randn(40 * bs, D), lunar.randn(40 * bs, D)
    local saved = lunar.threads()
    lunar.threads(2)
    local all = ops.attention_paged(q, k, v, tbl, lengths, {block_size = bs})
    for b = 1, B do
        local alone = ops.attention_paged(q:narrow(1, b, 1), k, v, tbl:narrow(1, b, 1), lengths:narrow(1, b, 1),
            {block_size = bs})
        T.equal(alone, all:narrow(1, b, 1), 'sequence ' .. b .. ' alone')
    end
    local rev = i64({5, 4, 3, 2, 1, 0}, {B})
    local tf, rt, rl = tbl:tolist_flat(), {}, {}
    for b = B, 1, -1 do
        for j = 1, 13 do rt[#rt + 1] = tf[(b - 1) * 13 + j] end
        rl[#rl + 1] = lens[b]
    end
    local o_rev = ops.attention_paged(ops.index_select(q, 1, rev), k, v, i64(rt, {B, 13}), i64(rl, {B}),
        {block_size = bs})
    T.equal(ops.index_select(o_rev, 1, rev), all, 'reversed batch')
    lunar.threads(1)
    T.equal(ops.attention_paged(q, k, v, tbl, lengths, {block_size = bs}), all, 'one thread')
    lunar.threads(saved)
end)

T:test('a bf16 cache is read as it is', function()
    local bs = 4
    local tbl, lengths = layout({6, 13}, bs, 8, 4)
    local q = lunar.randn(2, 4, 8)
    local k = lunar.randn(32, 16):to('bf16')
    local v = lunar.randn(32, 16):to('bf16')
    local o = ops.attention_paged(q, k, v, tbl, lengths, {block_size = bs})
    assert(o:dtype() == 'f32', 'q and o in the compute dtype')
    local o32 = ops.attention_paged(q, k:to('f32'), v:to('f32'), tbl, lengths, {block_size = bs})
    T.close(o, o32, {rtol = 1e-6, atol = 1e-6})
end)

T:test('errors name the tensor and the reason', function()
    local bs = 4
    local q = lunar.randn(2, 2, 8)
    local k, v = lunar.randn(16, 8), lunar.randn(16, 8)
    local tbl, lengths = i64({0, 1, 2, 3}, {2, 2}), i64({5, 8}, {2})
    local function run(o) return ops.attention_paged(o.q or q, o.k or k, o.v or v, o.tbl or tbl, o.lengths or lengths,
        {block_size = o.bs or bs}) end
    run({})
    T.raises(function() run({tbl = i64({0, 1, 2, 4}, {2, 2})}) end, 'blocks of the cache')
    T.raises(function() run({lengths = i64({0, 8}, {2})}) end, 'lengths')
    T.raises(function() run({lengths = i64({5, 9}, {2})}) end, 'lengths')
    T.raises(function() run({k = lunar.randn(16, 6)}) end, "k '")
    T.raises(function() run({v = lunar.randn(12, 8)}) end, "v '")
    T.raises(function() run({bs = 5}) end, 'block_size')
    T.raises(function() run({bs = 0}) end, 'block_size')
    T.raises(function() run({v = lunar.randn(16, 8):to('bf16')}) end, 'share a dtype')
    T.raises(function() run({tbl = i64({0, 1, 2}, {3, 1})}) end, 'table')
    T.raises(function() run({q = lunar.randn(2, 8)}) end, 'q must be 3-dim')
end)

os.exit(T:run())
