-- test_gpu_index_accumulate.lua: the CUDA index ops that write through an index
-- (kernels/cuda/index_accumulate.cu) against the CPU backend, bit for bit: index_select_sum (the
-- MoE combine), bincount (the MoE's expert counts), index_add_, scatter_ and scatter_add_ with
-- repeated indices, long runs of one destination, every float dtype; then the MoE layer itself,
-- whose dispatch and combine run on these ops: the same expert counts as on the CPU, and the same
-- bits from two runs. Skipped (exit 77) without a CUDA device. LUNAR_GPU_DRY_RUN=1 runs the same
-- checks with the CPU standing in for the GPU (small sizes), to check the test itself.
--
-- Tolerances: none for the index ops (each destination is summed in the CPU's order, in f32,
-- rounded once). The MoE output against the CPU: rtol/atol 1e-4 (cuBLAS and OpenBLAS gemms).
local lunar = require 'lunar'
local DRY = os.getenv('LUNAR_GPU_DRY_RUN') == '1'
if not DRY and lunar.device_count('cuda') == 0 then
    print('no CUDA device: skipped')
    os.exit(77)
end
local GPU = DRY and 'cpu' or 'cuda'
local T = require('lunar.testing').suite('gpu.index_accumulate' .. (DRY and ' (dry run on the cpu)' or ''))
local ops = lunar.ops
local nn = require 'lunar.nn'

lunar.manual_seed(41)

-- the same values on the cpu and on the device
local function pair(x, dt)
    local c = dt and x:to(dt) or x
    return c, c:to(GPU)
end

-- got (on the device) holds want's values exactly, in want's dtype
local function same(got, want, msg)
    assert(got:dtype() == want:dtype(), ('%s: dtype %s, expected %s'):format(msg, got:dtype(), want:dtype()))
    T.equal(got:to('cpu'), want, msg)
end

local DTYPES = {'f32', 'bf16', 'f16'}

T:test('index_select_sum: the CPU\'s bits, = and +=, sizes up to a GLM-5 combine row', function()
    local sizes = {{1, 1, 1, 1}, {7, 3, 5, 2}, {40, 300, 17, 8}, {9, 5, 1000, 1}}
    sizes[#sizes + 1] = DRY and {64, 6144, 8, 8} or {2048, 6144, 256, 8}   -- (N*K rows, H), N tokens, K = 8
    for _, dt in ipairs(DTYPES) do
        for _, s in ipairs(sizes) do
            local r, c, n, k = s[1], s[2], s[3], s[4]
            local msg = ('%s R%d C%d N%d K%d'):format(dt, r, c, n, k)
            local sc, sg = pair(lunar.randn(r, c), dt)
            local ic, ig = pair(lunar.randint(0, r, {n, k}, 'i64'))
            same(ops.index_select_sum(sg, ig), ops.index_select_sum(sc, ic), msg)
            local bc, bg = pair(lunar.randn(n, c), dt)
            ops.index_select_sum(sc, ic, {out = bc, accumulate = true})
            ops.index_select_sum(sg, ig, {out = bg, accumulate = true})
            same(bg, bc, msg .. ' accumulate')
        end
    end
    -- the order is k's, and bf16 rounds once: exact values
    local _, src = pair(lunar.tensor({{1e8}, {1}, {-1e8}}))
    same(ops.index_select_sum(src, lunar.tensor({{0, 1, 2}, {0, 2, 1}}, 'i64'):to(GPU)), lunar.tensor({0, 1}):view(2, 1),
        'k order')
    local _, b = pair(lunar.tensor({{256}, {1}}), 'bf16')
    same(ops.index_select_sum(b, lunar.tensor({{0, 1, 1}}, 'i64'):to(GPU)), lunar.tensor({{258}}):bf16(), 'bf16 once')
end)

T:test('bincount: the CPU\'s counts, shared-memory and global paths, skewed values', function()
    for _, s in ipairs({{1, 1}, {256, 8 * 4096}, {7, 100000}, {20000, 50000}}) do
        local bins, n = s[1], s[2]
        local vc, vg = pair(lunar.randint(0, bins, {n}, 'i64'))
        same(ops.bincount(vg, bins), ops.bincount(vc, bins), ('bins %d n %d'):format(bins, n))
        local wc, wg = pair(lunar.randint(0, bins, {n}, 'i32'))
        same(ops.bincount(wg, bins), ops.bincount(wc, bins), ('bins %d n %d i32'):format(bins, n))
    end
    local one = lunar.zeros(70000, 'i64'):fill_(3):to(GPU)   -- every value in one bin
    T.equal(ops.bincount(one, 5):to('cpu'), {0, 0, 0, 70000, 0}, 'one bin')
    same(ops.bincount(lunar.zeros(0, 'i64'):to(GPU), 4), lunar.zeros(4, 'i64'), 'no values')
end)

T:test('index_add_: the CPU\'s bits with repeated indices, alpha, every dim and dtype', function()
    for _, dt in ipairs(DTYPES) do
        for _, s in ipairs({{{3, 1000, 5}, 2, 17, 1000}, {{3, 10, 5}, 2, 1000, 10}, {{4, 6}, 1, 4000, 4},
                            {{50, 7}, 2, 300, 7}, {{1, 600}, 1, 5000, 1}}) do
            local shape, dim, k, n = s[1], s[2], s[3], s[4]
            local sshape = {}
            for i, v in ipairs(shape) do sshape[i] = v end
            sshape[dim] = k
            local ic, ig = pair(lunar.randint(0, n, {k}, 'i64'))
            local ac, ag = pair(lunar.randn(unpack(sshape)), dt)
            for _, alpha in ipairs({1, 0.5}) do
                local dc, dg = pair(lunar.randn(unpack(shape)), dt)
                dc:index_add_(dim, ic, ac, {alpha = alpha})
                dg:index_add_(dim, ig, ag, {alpha = alpha})
                same(dg, dc, ('%s shape %s dim %d K %d alpha %g'):format(dt, table.concat(shape, 'x'), dim, k, alpha))
            end
        end
    end
    -- the MoE backward's shape: N*K rows into N tokens
    local n, k, h = DRY and 64 or 1024, 8, DRY and 512 or 6144
    local tok = {}
    for t = 0, n - 1 do for _ = 1, k do tok[#tok + 1] = t end end
    local ic, ig = pair(ops.index_select(lunar.tensor(tok), 1, ops.argsort(lunar.randn(n * k))):to('i64'))
    local sc, sg = pair(lunar.randn(n * k, h))
    local dc, dg = pair(lunar.randn(n, h))
    same(dg:index_add_(1, ig, sg), dc:index_add_(1, ic, sc), 'N*K rows into N')
end)

T:test('scatter_ (last duplicate wins) and scatter_add_: the CPU\'s bits', function()
    for _, dt in ipairs(DTYPES) do
        for _, s in ipairs({{{3, 1000, 5}, 2, {3, 40, 5}, 1000}, {{3, 4, 5}, 2, {3, 300, 5}, 4},
                            {{6, 9}, 1, {200, 9}, 6}, {{5, 8}, 2, {5, 64}, 8}, {{100000}, 1, {100000}, 100000}}) do
            local dshape, dim, ishape, n = s[1], s[2], s[3], s[4]
            local ic, ig = pair(lunar.randint(0, n, ishape, 'i64'))
            local uc, ug = pair(lunar.randn(unpack(ishape)), dt)
            for _, acc in ipairs({false, true}) do
                local zc, zg = pair(lunar.randn(unpack(dshape)), dt)
                if acc then zc:scatter_add_(dim, ic, uc); zg:scatter_add_(dim, ig, ug)
                else zc:scatter_(dim, ic, uc); zg:scatter_(dim, ig, ug) end
                same(zg, zc, ('%s %s dst %s dim %d index %s'):format(dt, acc and 'scatter_add_' or 'scatter_',
                    table.concat(dshape, 'x'), dim, table.concat(ishape, 'x')))
            end
        end
    end
    local d = lunar.zeros(3):to(GPU)
    d:scatter_(1, lunar.tensor({2, 0, 2, 2}, 'i64'):to(GPU), lunar.tensor({1, 2, 3, 4}):to(GPU))
    T.equal(d:to('cpu'), {2, 0, 4}, 'the last duplicate wins')
    -- the inverse of a permutation, as the MoE layer computes it
    local m = DRY and 4096 or 65536
    local pc, pg = pair(ops.argsort(lunar.randn(m)))
    local ac, ag = pair(lunar.zeros(m):arange_(0, 1))
    same(ops.scatter_(lunar.zeros(m):to(GPU), 1, pg, ag), ops.scatter_(lunar.zeros(m), 1, pc, ac), 'inverse permutation')
end)

T:test('bad index values: named by the op (cpu) or by the next check point (cuda)', function()
    local function dev(t) return t:to(GPU) end
    local src = dev(lunar.randn(3, 4))
    T.raises(function() ops.index_select_sum(src, dev(lunar.tensor({{0, 3}}, 'i64'))); lunar.synchronize(GPU) end,
        'index_select_sum: index 3')
    T.raises(function() ops.bincount(dev(lunar.tensor({0, 5}, 'i64')), 5); lunar.synchronize(GPU) end,
        'bincount: index 5')
    T.raises(function()
        dev(lunar.zeros(3)):index_add_(1, dev(lunar.tensor({1, 3}, 'i64')), dev(lunar.ones(2))); lunar.synchronize(GPU)
    end, 'index_add: index 3')
    T.raises(function()
        dev(lunar.zeros(3)):scatter_add_(1, dev(lunar.tensor({-1}, 'i64')), dev(lunar.ones(1))); lunar.synchronize(GPU)
    end, 'scatter_add: index -1')
    lunar.synchronize(GPU)   -- each was raised once: nothing is left for the next check
end)

-- a GLM-5-shaped MoE layer at a small size: sigmoid router, groups, shared expert
local function moe_store(E, H, Im, device)
    local s = nn.params.new()
    local name = 'model.layers.3.mlp'
    local function w(a, b) return ops.mul(lunar.randn(a, b), 0.1):to(device) end
    s:add(name .. '.gate.weight', w(E, H))
    s:add(name .. '.gate.e_score_correction_bias', ops.mul(lunar.randn(E), 0.05):to(device), false)
    for e = 0, E - 1 do
        local p = name .. '.experts.' .. e
        s:add(p .. '.gate_proj.weight', w(Im, H))
        s:add(p .. '.up_proj.weight', w(Im, H))
        s:add(p .. '.down_proj.weight', w(H, Im))
    end
    local p = name .. '.shared_experts'
    s:add(p .. '.gate_proj.weight', w(Im, H))
    s:add(p .. '.up_proj.weight', w(Im, H))
    s:add(p .. '.down_proj.weight', w(H, Im))
    return s, name
end

T:test('MoE layer: the CPU\'s routing and expert counts, close outputs, the same bits from two runs', function()
    local cfg = {n_routed_experts = 32, num_experts_per_tok = 8, n_group = 4, topk_group = 2, norm_topk_prob = true,
                 routed_scaling_factor = 2.5, n_shared_experts = 1, hidden_act = 'silu'}
    local N, H, Im = DRY and 64 or 512, 256, 64
    lunar.manual_seed(7)
    local sc, name = moe_store(32, H, Im, 'cpu')
    lunar.manual_seed(7)
    local sg = moe_store(32, H, Im, GPU)
    local mc, mg = nn.MoE.new(sc, name, cfg), nn.MoE.new(sg, name, cfg)
    local xc, xg = pair(lunar.randn(N, H))
    local dc, dg = pair(lunar.randn(N, H))
    local yc, savedc, rc = mc:forward(xc)
    -- the CPU's expert ids, so that both sides route alike even where a router score is a near tie
    local yg, savedg = mg:forward(xg, {replay_idx = rc.idx:to(GPU)})
    assert(#savedg.hits == #savedc.hits, 'experts with tokens')
    for i, h in ipairs(savedc.hits) do
        assert(savedg.hits[i].e == h.e and savedg.hits[i].n == h.n, ('expert %d: %d tokens, the cpu %d'):format(h.e,
            savedg.hits[i].n, h.n))
    end
    T.equal(savedg.rows:to('cpu'), savedc.rows, 'each token\'s rows')
    T.close(yg:to('cpu'), yc, {rtol = 1e-4, atol = 1e-4, msg = 'y'})
    sc:zero_grad()
    sg:zero_grad()
    local dxc = mc:backward(dc, savedc)
    local dxg = mg:backward(dg, savedg)
    T.close(dxg:to('cpu'), dxc, {rtol = 1e-4, atol = 1e-4, msg = 'dx'})
    T.close(sg:grad(name .. '.gate.weight'):to('cpu'), sc:grad(name .. '.gate.weight'), {rtol = 1e-3, atol = 1e-4,
        msg = 'router gradient'})
    -- deterministic on the device: a second run gives the same bits
    local yg2, savedg2 = mg:forward(xg, {replay_idx = rc.idx:to(GPU)})
    same(yg2, yg:to('cpu'), 'y, second run')
    sg:zero_grad()
    same(mg:backward(dg, savedg2), dxg:to('cpu'), 'dx, second run')
end)

os.exit(T:run())
