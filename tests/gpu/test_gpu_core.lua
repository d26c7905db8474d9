-- test_gpu_core.lua: the CUDA tensor core against the CPU: copies and casts between every dtype
-- pair (cpu -> cuda, cuda -> cpu, cuda -> cuda), strided and broadcast views on either side,
-- fill and arange, the random streams (same seed: identical uniform, randint and normal bits),
-- attention masks, arenas and scopes on the device (stale views, pool
-- reuse), and device-mismatch errors that name both devices. Skipped (exit 77) without a CUDA
-- device. LUNAR_GPU_DRY_RUN=1 runs the same checks with the CPU standing in for the GPU, to
-- check the test itself on a machine without one (the device-mismatch checks are then skipped).
--
-- Tolerances: none. Every value must be the same, NaN for NaN, and the same sign for zeros
-- (normal draws too: their log and cos are hd.h's, not libm's, so host and device agree).
local lunar = require 'lunar'
local DRY = os.getenv('LUNAR_GPU_DRY_RUN') == '1'
if not DRY and lunar.device_count('cuda') == 0 then
    print('no CUDA device: skipped')
    os.exit(77)
end
local GPU = DRY and 'cpu' or 'cuda'
local GPU_NAME = DRY and 'cpu' or 'cuda:0'
local T = require('lunar.testing').suite('gpu.core' .. (DRY and ' (dry run on the cpu)' or ''))
local ops = lunar.ops

local DTYPES = {'f32', 'f64', 'bf16', 'f16', 'f8e4m3', 'f8e5m2', 'i8', 'i32', 'i64', 'u8', 'bool'}
local FLOAT = {f32 = true, f64 = true, bf16 = true, f16 = true, f8e4m3 = true, f8e5m2 = true}
local inf, nan, negzero = math.huge, 0 / 0, -1 / math.huge

-- source values of each dtype: stored into the dtype on the CPU (exact or rounded there)
local FLOATS = {0, negzero, 1, -1, 0.5, -1.5, 2.5, 3.14159265358979, -7.75, 1e-3, 1e-8, 1e-40, 100.5, 127, 128,
                255.5, 256, 300, -129, 448, 464, 57344, 65504, 65520, 7e4, 16777217, 1e10, -1e10, 3.4e38, 1e300, inf,
                -inf, nan}
local INTS = {
    i8 = {0, 1, -1, 2, -2, 7, 100, 127, -128, -100},
    u8 = {0, 1, 2, 7, 100, 127, 128, 200, 254, 255},
    i32 = {0, 1, -1, 7, -300, 65504, 2 ^ 24 + 1, 2147483647, -2147483648, 123456789},
    i64 = {0, 1, -1, 7, -300, 2 ^ 24 + 1, 2 ^ 31, 2 ^ 53, -2 ^ 53 + 2, 2 ^ 62},
    bool = {0, 1, 1, 0, 1, 0, 0, 1, 1, 1},
}

local function source(dt)
    return lunar.tensor(FLOAT[dt] and FLOATS or INTS[dt], 'f64'):to(dt)
end

-- the values of t (any device; brought back as the same dtype, so the CPU reads both sides)
local function values(t)
    if t:device() ~= 'cpu' then t = t:to('cpu') end
    return t:tolist_flat()
end

-- got (any device) must hold exactly want's values: NaN where want has NaN, zeros of one sign
local function same(got, want, msg)
    local gs, ws = table.concat(got:size(), 'x'), table.concat(want:size(), 'x')
    if gs ~= ws then error(('%s: shape %s, expected %s'):format(msg, gs, ws), 2) end
    if got:dtype() ~= want:dtype() then error(('%s: dtype %s, expected %s'):format(msg, got:dtype(), want:dtype()), 2) end
    local a, b = values(got), values(want)
    for i = 1, #b do
        local x, y = a[i], b[i]
        local ok
        if x ~= x or y ~= y then
            ok = x ~= x and y ~= y
        else
            ok = x == y and (x ~= 0 or 1 / x == 1 / y)
        end
        if not ok then
            error(('%s: element %d is %.17g, expected %.17g (the CPU result)'):format(msg, i, x, y), 2)
        end
    end
end

T:test('casts between every dtype pair: cpu -> cuda, cuda -> cpu, cuda -> cuda', function()
    for _, sdt in ipairs(DTYPES) do
        local src = source(sdt)
        local src_g = src:to(GPU)
        same(src_g, src, sdt .. ' to the device and back')
        for _, ddt in ipairs(DTYPES) do
            local want = src:to(ddt)   -- the CPU's conversion
            local what = sdt .. ' -> ' .. ddt
            local n = src:numel()
            same(lunar.empty({n}, {dtype = ddt, device = GPU}):copy_(src), want, what .. ' (cpu -> cuda)')
            same(lunar.empty({n}, {dtype = ddt}):copy_(src_g), want, what .. ' (cuda -> cpu)')
            same(src_g:to(ddt), want, what .. ' (cuda -> cuda)')
            if ddt == 'f8e4m3' or ddt == 'f8e5m2' then
                local sat = lunar.empty({n}, {dtype = ddt}):copy_saturate_(src)
                same(lunar.empty({n}, {dtype = ddt, device = GPU}):copy_saturate_(src_g), sat, what .. ' saturating')
            end
        end
    end
end)

-- views of a (7, 9, 5) tensor: transposed, narrowed, selected, permuted, broadcast
local VIEWS = {
    {'transpose(1, 3)', function(t) return t:transpose(1, 3) end},
    {'narrow(2, 3, 4)', function(t) return t:narrow(2, 3, 4) end},
    {'select(2, 5)', function(t) return t:select(2, 5) end},
    {'permute(3, 1, 2)', function(t) return t:permute(3, 1, 2) end},
    {'narrowed transpose', function(t) return t:narrow(1, 2, 5):transpose(2, 3):narrow(3, 1, 8) end},
    {'expand of a row', function(t) return t:narrow(1, 4, 1):expand(7, 9, 5) end},
    {'expand of a column', function(t) return t:narrow(3, 2, 1):expand(7, 9, 5) end},
}
local PAIRS = {{'f32', 'bf16'}, {'bf16', 'f32'}, {'f32', 'f8e4m3'}, {'f16', 'f64'}, {'f64', 'f32'}, {'i64', 'i32'},
               {'bool', 'f32'}, {'u8', 'i64'}, {'f32', 'f32'}, {'bf16', 'bf16'}, {'i32', 'bf16'}}

T:test('strided and broadcast sources and destinations on either side', function()
    local base = lunar.randn(7, 9, 5):mul(40)
    for _, p in ipairs(PAIRS) do
        local sdt, ddt = p[1], p[2]
        local src = base:to(sdt)
        local src_g = src:to(GPU)
        for _, v in ipairs(VIEWS) do
            local what = ('%s -> %s, %s'):format(sdt, ddt, v[1])
            local want = v[2](src):to(ddt):contiguous()
            same(v[2](src_g):to(ddt), want, what .. ' (cuda -> cuda)')
            same(v[2](src_g):to('cpu', ddt), want, what .. ' (cuda -> cpu)')
            same(v[2](src):to(GPU, ddt), want, what .. ' (cpu -> cuda)')
        end
        -- into a permuted (non-contiguous) destination, from either device
        local full = src:to(ddt)
        for _, from in ipairs({{'cpu', src}, {'cuda', src_g}}) do
            for _, dev in ipairs({'cpu', GPU}) do
                local out = lunar.zeros(5, 9, 7, {dtype = ddt, device = dev}):permute(3, 2, 1)
                out:copy_(from[2])
                same(out, full, ('%s -> %s, %s into a permuted view on %s'):format(sdt, ddt, from[1], dev))
            end
        end
        -- broadcast: a (9, 5) slice into every row of a (7, 9, 5) destination, across devices
        local row = src:select(1, 3)
        local want = row:unsqueeze(1):expand(7, 9, 5):to(ddt):contiguous()
        same(lunar.empty({7, 9, 5}, {dtype = ddt, device = GPU}):copy_(row), want, sdt .. ' row broadcast cpu -> cuda')
        same(lunar.empty({7, 9, 5}, {dtype = ddt}):copy_(row:to(GPU)), want, sdt .. ' row broadcast cuda -> cpu')
        same(lunar.empty({7, 9, 5}, {dtype = ddt, device = GPU}):copy_(row:to(GPU)), want,
            sdt .. ' row broadcast cuda -> cuda')
    end
    -- sizes 1, 3, 17 and 1000, transposed on the device
    for _, s in ipairs({{1, 1}, {3, 17}, {17, 3}, {1000, 17}, {1, 1000}}) do
        local x = lunar.randn(s[1], s[2])
        same(x:to(GPU):t():to('bf16'), x:t():to('bf16'):contiguous(), ('%dx%d transposed to bf16'):format(s[1], s[2]))
        same(x:t():to(GPU), x:t():contiguous(), ('%dx%d transposed view to the device'):format(s[1], s[2]))
    end
    T.raises(function() lunar.zeros(3, {device = GPU}):expand(2, 3):copy_(lunar.ones(2, 3)) end,
        'is an expanded view and cannot be written')
end)

T:test('fill and arange on every dtype, contiguous and strided', function()
    local FILLS = {0, negzero, 1, -2.5, 300.75, 255.99999999, 16777217.5, 1e-50, -1e10, 1e300, -inf, nan}
    for _, dt in ipairs(DTYPES) do
        for _, v in ipairs(FILLS) do
            local what = ('fill_(%.17g) on %s'):format(v, dt)
            local want = lunar.empty({3, 17}, dt):fill_(v)
            same(lunar.empty({3, 17}, {dtype = dt, device = GPU}):fill_(v), want, what)
            local g = lunar.zeros(17, 6, {dtype = dt, device = GPU})
            g:t():narrow(1, 2, 3):fill_(v)
            local c = lunar.zeros(17, 6, {dtype = dt})
            c:t():narrow(1, 2, 3):fill_(v)
            same(g, c, what .. ' through a strided view')
        end
        local ranges = FLOAT[dt] and {{0, 1000, 1}, {0.3, 7.1, 0.1}, {-5, 5, 0.37}, {1e6, 1.001e6, 7.3}}
            or {{0, 100, 1}, {-50, 50, 3}, {250, 260, 1}}
        if dt == 'bool' then ranges = {{0, 3, 1}} end
        for _, r in ipairs(ranges) do
            local what = ('arange(%g, %g, %g) as %s'):format(r[1], r[2], r[3], dt)
            same(lunar.arange(r[1], r[2], r[3], {dtype = dt, device = GPU}), lunar.arange(r[1], r[2], r[3], dt), what)
            local g = lunar.zeros(2, 40, {dtype = dt, device = GPU})
            local c = lunar.zeros(2, 40, {dtype = dt})
            g:select(2, 3):arange_(r[1], r[3])
            c:select(2, 3):arange_(r[1], r[3])
            same(g, c, what .. ' into a strided column')
        end
    end
end)

T:test('random streams: identical uniform, randint and normal', function()
    for _, seed in ipairs({0, 7, 123456789}) do
        local rc, rg = lunar.rng(seed), lunar.rng(seed)
        for _, dt in ipairs({'f32', 'f64', 'bf16', 'f16'}) do
            same(rg:uniform_(lunar.empty({1000}, {dtype = dt, device = GPU})), rc:uniform_(lunar.empty({1000}, dt)),
                ('seed %d uniform %s'):format(seed, dt))
            same(rg:uniform_(lunar.empty({17, 3}, {dtype = dt, device = GPU}), -0.3, 2.7),
                rc:uniform_(lunar.empty({17, 3}, dt), -0.3, 2.7), ('seed %d uniform(-0.3, 2.7) %s'):format(seed, dt))
        end
        for _, dt in ipairs({'i64', 'i32', 'i8', 'f32'}) do
            local hi = dt == 'i8' and 100 or (dt == 'i64' and 2 ^ 40 or 100000)
            same(rg:randint_(lunar.empty({1000}, {dtype = dt, device = GPU}), -5, hi),
                rc:randint_(lunar.empty({1000}, dt), -5, hi), ('seed %d randint %s'):format(seed, dt))
        end
        -- a non-contiguous destination gets the numbers of a contiguous draw of its shape
        local g = lunar.zeros(9, 4, {device = GPU})
        local c = lunar.zeros(9, 4)
        rg:uniform_(g:t())
        rc:uniform_(c:t())
        same(g, c, ('seed %d uniform into a transposed view'):format(seed))
        -- split streams agree, and the parents have advanced by the same count
        same(rg:split('init'):uniform_(lunar.empty({64}, {device = GPU})), rc:split('init'):uniform_(lunar.empty({64})),
            'split stream')
        assert(rg:state() == rc:state(), ('states after the same draws: %s vs %s'):format(rg:state(), rc:state()))
        for _, dt in ipairs({'f32', 'f64', 'bf16', 'f16'}) do
            same(rg:normal_(lunar.empty({1000}, {dtype = dt, device = GPU}), 0.5, 2),
                rc:normal_(lunar.empty({1000}, dt), 0.5, 2), ('seed %d normal %s'):format(seed, dt))
        end
    end
    -- lunar.rand / randn / randint with the default stream
    lunar.manual_seed(99)
    local a = lunar.rand(3, 17, {device = GPU})
    local b = lunar.randint(0, 10, {3, 17}, {device = GPU})
    lunar.manual_seed(99)
    same(a, lunar.rand(3, 17), 'lunar.rand')
    same(b, lunar.randint(0, 10, {3, 17}), 'lunar.randint')
end)

T:test('causal and block masks on the device', function()
    for _, c in ipairs({{1, 1, 0}, {3, 3, 0}, {4, 7, 3}, {17, 17, 0}, {5, 3, -1}, {1000, 1000, 0}, {64, 1000, 936}}) do
        for _, dt in ipairs({'bool', 'f32', 'bf16', 'f16'}) do
            local o = {offset = c[3], dtype = dt}
            local want = ops.causal_mask(c[1], c[2], o)
            o.device = GPU
            same(ops.causal_mask(c[1], c[2], o), want, ('causal %dx%d offset %d %s'):format(c[1], c[2], c[3], dt))
        end
    end
    for _, cu_vals in ipairs({{0, 3, 4, 9}, {0, 1}, {0, 17, 300, 301}}) do
        for _, idt in ipairs({'i32', 'i64'}) do
            local cu = lunar.tensor(cu_vals, idt)
            for _, causal in ipairs({true, false}) do
                for _, dt in ipairs({'bool', 'f32', 'bf16'}) do
                    local want = ops.block_mask(cu, {causal = causal, dtype = dt})
                    same(ops.block_mask(cu:to(GPU), {causal = causal, dtype = dt}), want,
                        ('block mask %s causal=%s %s'):format(table.concat(cu_vals, ','), tostring(causal), dt))
                end
            end
        end
    end
    -- into a non-contiguous output view on the device
    local cu = lunar.tensor({0, 3, 4, 9}, 'i32')
    local big = lunar.zeros(9, 18, {dtype = 'bool', device = GPU})
    ops.block_mask(cu:to(GPU), {out = big:narrow(2, 10, 9)})
    same(big:narrow(2, 10, 9), ops.block_mask(cu), 'block mask into a view')
    same(big:narrow(2, 1, 9), lunar.zeros(9, 9, {dtype = 'bool'}), 'the rest of the view untouched')
end)

T:test('arenas on the device: views, reset, stale views, full, freed', function()
    local a = lunar.arena('gpu_step', 2 ^ 20, GPU)
    local info = a:info()
    assert(info.device == GPU_NAME, 'arena device ' .. tostring(info.device))
    local x = a:tensor({64, 64}, 'f32', 'acts.x')
    assert(x:device() == GPU_NAME, x:device())
    x:fill_(2)
    local y = a:tensor({64, 64}, 'bf16', 'acts.y')
    y:copy_(lunar.arange(4096):view(64, 64))
    same(x, lunar.full({64, 64}, 2), 'arena tensor x')
    same(y, lunar.arange(4096):view(64, 64):to('bf16'), 'arena tensor y')
    assert(a:info().used >= 64 * 64 * 6, 'used ' .. a:info().used)
    same(ops.add(x, y:float()), lunar.arange(4096):view(64, 64):to('bf16'):float():add(2), 'an op on arena views')
    a:reset()
    local err = T.raises(function() x:fill_(1) end, "is a view of arena 'gpu_step' generation")
    assert(err:find('acts.x', 1, true), err)
    T.raises(function() ops.add(y, y) end, 'acts.y')
    T.raises(function() y:clone() end, 'the arena was reset')
    T.raises(function() lunar.empty({64, 64}):copy_(y) end, 'the arena was reset')
    local z = a:tensor({128}, 'f32', 'acts.z')
    z:fill_(3)
    same(z, lunar.full({128}, 3), 'a view made after the reset')
    T.raises(function() a:tensor({2 ^ 20}) end, 'is full')
    a:free()
    T.raises(function() z:fill_(1) end, "is a view of arena 'gpu_step', which was freed")
end)

T:test('scopes and the device pool: freed views, reuse of freed blocks', function()
    local inner, inner_view
    local kept = lunar.scope(function()
        inner = lunar.zeros(1000, {device = GPU})
        inner_view = inner:narrow(1, 10, 5)
        local tmp = lunar.ones(3, {device = GPU})
        return tmp:mul(2)
    end)
    assert(not inner:is_valid(), 'a device tensor made in the scope is freed at its end')
    assert(kept:is_valid(), 'the returned device tensor is kept')
    same(kept, lunar.full({3}, 2), 'kept value')
    T.raises(function() inner_view:fill_(1) end, 'used after free')
    local t = lunar.empty({1000, 1000}, {device = GPU})
    t:free()
    local before = lunar.memory_stats(GPU)
    local u = lunar.empty({1000, 1000}, {device = GPU})
    local after = lunar.memory_stats(GPU)
    assert(after.reuses == before.reuses + 1, ('reuses %d -> %d'):format(before.reuses, after.reuses))
    assert(after.allocs == before.allocs, ('allocs %d -> %d: a fresh block was allocated'):format(before.allocs,
        after.allocs))
    assert(after.in_use > before.in_use and after.cached < before.cached, 'the cached block is in use again')
    u:fill_(1)
    same(u:narrow(1, 1000, 1), lunar.ones(1, 1000), 'the reused block')
    -- a steady-state step: the same shapes again allocate nothing new
    local function step()
        lunar.scope(function()
            local h = lunar.randn(256, 512, {device = GPU})
            local w = lunar.randn(512, 128, {device = GPU})
            ops.gemm(h, w):sum()
        end)
    end
    step()
    local s0 = lunar.memory_stats(GPU)
    for _ = 1, 3 do step() end
    local s1 = lunar.memory_stats(GPU)
    assert(s1.allocs == s0.allocs, ('steady-state steps allocated %d new blocks'):format(s1.allocs - s0.allocs))
end)

T:test('device mismatches name both devices', function()
    if DRY then
        print('      (dry run: one device only, skipped)')
        return
    end
    local xg = lunar.randn(4, 8):to('cuda')
    local xc = lunar.randn(4, 8)
    T.raises(function() ops.add(xg, xc) end, "is on cpu but the op runs on cuda:0")
    T.raises(function() ops.add(xc, xg) end, "is on cuda:0 but the op runs on cpu")
    local err = T.raises(function() ops.add(xc, xc, {out = lunar.empty({4, 8}, {device = 'cuda'})}) end, 'is on ')
    assert(err:find('cuda:0', 1, true) and err:find('cpu', 1, true), err)
    T.raises(function() ops.rmsnorm(xg, lunar.ones(8)) end, "is on cpu but the op runs on cuda:0")
    T.raises(function() ops.gemm(xg, lunar.randn(8, 3)) end, "is on cpu but the op runs on cuda:0")
    T.raises(function() ops.softmax(xg, {out = lunar.empty({4, 8})}) end, 'is on cpu but the op runs on cuda:0')
    T.raises(function() ops.cross_entropy(xg, lunar.tensor({1, 2, 3, 4}, 'i64')) end,
        'is on cpu but the op runs on cuda:0')
    T.raises(function() lunar.arena('bad', 1024, 'cuda:' .. lunar.device_count('cuda')) end, 'not available')
    -- copies across devices are allowed: they are how tensors move
    same(lunar.empty({4, 8}):copy_(xg), xg:to('cpu'), 'copy_ across devices')
end)

os.exit(T:run())
