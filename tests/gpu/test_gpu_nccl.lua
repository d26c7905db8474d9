-- test_gpu_nccl.lua: the collectives on CUDA tensors through NCCL, on one rank: a group whose
-- one-rank NCCL communicator is made explicitly (group:nccl_init(), from a local id, without
-- MPI) sends its CUDA collectives through NCCL, and every result must equal the CPU result of
-- the same collective (on one rank: a copy) bit for bit: all_reduce (sum, avg, max, min),
-- all_gather, reduce_scatter, broadcast and all_to_all, the non-blocking all_reduce_start and
-- reduce_scatter_start, on several dtypes, shapes and strided
-- views; plus the errors (devices, expanded outputs). Skipped (exit 77) without a CUDA device,
-- in a lunar built without NCCL, or when started by a launcher with several ranks.
-- LUNAR_GPU_DRY_RUN=1 runs the comparisons with the CPU standing in for the GPU (no NCCL then).
local lunar = require 'lunar'
local DRY = os.getenv('LUNAR_GPU_DRY_RUN') == '1'
if not DRY and lunar.device_count('cuda') == 0 then
    print('no CUDA device: skipped')
    os.exit(77)
end
local d = lunar.dist
if d.env().launched and d.env().size > 1 then
    print('started by a launcher with several ranks: this test runs alone, skipped')
    os.exit(77)
end
local GPU = DRY and 'cpu' or 'cuda'
local core = lunar.core

-- a fresh one-rank group (the world stays local-only), with its NCCL communicator
local g = core.dist.split(d.world(), 0, 0, 'nccl1')
if not DRY then
    local ok, err = pcall(g.nccl_init, g)
    if not ok and tostring(err):find('built without NCCL', 1, true) then
        print('this lunar was built without NCCL: skipped')
        os.exit(77)
    end
    assert(ok, err)
    assert(g:uses_nccl(), 'nccl_init made no communicator')
end
local T = require('lunar.testing').suite('gpu.nccl' .. (DRY and ' (dry run on the cpu)' or ''))

-- exact equality: NaN for NaN, zeros of one sign
local function same(got, want, msg)
    local gs, ws = table.concat(got:size(), 'x'), table.concat(want:size(), 'x')
    if gs ~= ws then error(('%s: shape %s, expected %s'):format(msg, gs, ws), 2) end
    if got:dtype() ~= want:dtype() then error(('%s: dtype %s, expected %s'):format(msg, got:dtype(), want:dtype()), 2) end
    local a, b = got:to('cpu'):tolist_flat(), want:to('cpu'):tolist_flat()
    for i = 1, #b do
        local x, y = a[i], b[i]
        local ok = (x ~= x and y ~= y) or (x == y and (x ~= 0 or 1 / x == 1 / y))
        if not ok then error(('%s: element %d is %.17g, expected %.17g (the CPU result)'):format(msg, i, x, y), 2) end
    end
end

-- a (rows, cols) tensor of dtype dt with values that every dtype holds (small integers, halves)
local function sample(rows, cols, dt)
    local x = lunar.randn(rows, cols):mul(8)
    if dt == 'bool' then return x:gt(0) end
    if dt == 'u8' then return x:abs():to('u8') end
    if dt == 'i8' or dt == 'i32' or dt == 'i64' then return x:to(dt) end
    return x:mul(2):to('i32'):to('f32'):mul(0.5):to(dt)
end

local REDUCE = {'f32', 'bf16', 'f16', 'f64', 'f8e4m3', 'i8', 'i32', 'i64', 'u8', 'bool'}
local MOVE = {'f32', 'bf16', 'f16', 'f64', 'f8e5m2', 'i8', 'i32', 'i64', 'u8', 'bool'}
local SHAPES = {{1, 1}, {3, 17}, {17, 3}, {1000, 3}}

local function ops_for(dt)
    if dt == 'bool' then return {'max', 'min'} end
    if dt == 'i8' or dt == 'i32' or dt == 'i64' or dt == 'u8' then return {'sum', 'max', 'min'} end
    return {'sum', 'avg', 'max', 'min'}
end

-- the same tensor as c on the device, and views of both: the tensor, a transpose, a narrow
local function views(c)
    local gpu = c:to(GPU)
    local r, k = c:size(1), c:size(2)
    local list = {{'contiguous', c:clone(), gpu}}
    if r > 1 and k > 1 then
        list[#list + 1] = {'transposed', c:clone():t(), c:to(GPU):t()}
        list[#list + 1] = {'narrowed', c:clone():narrow(2, 2, k - 1), c:to(GPU):narrow(2, 2, k - 1)}
    end
    return list
end

T:test('all_reduce: sum, avg, max, min on every dtype, contiguous and strided', function()
    for _, dt in ipairs(REDUCE) do
        for _, s in ipairs(SHAPES) do
            for _, op in ipairs(ops_for(dt)) do
                for _, v in ipairs(views(sample(s[1], s[2], dt))) do
                    local want = d.all_reduce(v[2], {op = op, group = g})
                    local got = d.all_reduce(v[3], {op = op, group = g})
                    same(got, want, ('all_reduce %s %s %dx%d %s'):format(op, dt, s[1], s[2], v[1]))
                end
            end
        end
    end
end)

T:test('all_gather and reduce_scatter, into fresh and strided outputs', function()
    for _, dt in ipairs(MOVE) do
        for _, s in ipairs(SHAPES) do
            for _, v in ipairs(views(sample(s[1], s[2], dt))) do
                local what = ('%s %dx%d %s'):format(dt, s[1], s[2], v[1])
                same(d.all_gather(v[3], {group = g}), d.all_gather(v[2], {group = g}), 'all_gather ' .. what)
                local rows, cols = v[2]:size(1), v[2]:size(2)
                local out_g = lunar.zeros(cols, rows, {dtype = dt, device = GPU}):t()
                d.all_gather(v[3], {group = g, out = out_g})
                same(out_g, v[2], 'all_gather into a transposed out, ' .. what)
                if dt ~= 'bool' and dt ~= 'f8e5m2' then
                    same(d.reduce_scatter(v[3], {group = g}), d.reduce_scatter(v[2], {group = g}),
                        'reduce_scatter ' .. what)
                end
            end
        end
    end
    -- an expanded (stride 0) input is read like any view
    local row = sample(1, 17, 'f32')
    same(d.all_gather(row:to(GPU):expand(5, 17), {group = g}), row:expand(5, 17):contiguous(), 'expanded input')
end)

T:test('broadcast and all_to_all', function()
    for _, dt in ipairs(MOVE) do
        for _, s in ipairs(SHAPES) do
            for _, v in ipairs(views(sample(s[1], s[2], dt))) do
                local what = ('%s %dx%d %s'):format(dt, s[1], s[2], v[1])
                same(d.broadcast(v[3], {root = 0, group = g}), d.broadcast(v[2], {root = 0, group = g}),
                    'broadcast ' .. what)
                local n = v[2]:size(1)
                same(d.all_to_all(v[3], {n}, {n}, {group = g}), d.all_to_all(v[2], {n}, {n}, {group = g}),
                    'all_to_all ' .. what)
            end
        end
    end
    same(d.all_to_all(lunar.zeros(0, 3, {device = GPU}), {0}, {0}, {group = g}), lunar.zeros(0, 3), 'all_to_all of nothing')
end)

T:test('non-blocking all_reduce_start and reduce_scatter_start (uneven counts) equal the CPU result', function()
    -- (bf16 in place is NCCL's; on the CPU MPI reduces it only through a staging copy, refused here)
    for _, dt in ipairs(DRY and {'f32', 'f64', 'i64'} or {'f32', 'f64', 'bf16', 'i64'}) do
        for _, op in ipairs({'sum', 'avg', 'max'}) do
            if not (op == 'avg' and dt == 'i64') then
                local x = sample(17, 3, dt)
                local want = x:clone()
                d.all_reduce(want, {op = op})   -- the one-rank world: the tensor itself
                local t = x:to(GPU)
                local req = d.all_reduce_start(t, {op = op, group = g})
                req:wait()
                same(t, want, ('all_reduce_start %s %s'):format(dt, op))
                local flat = x:contiguous():view(51)
                local r2, out = d.reduce_scatter_start(flat:to(GPU), {51}, {op = op, group = g})
                r2:wait()
                same(out, flat, ('reduce_scatter_start %s %s'):format(dt, op))
            end
        end
    end
    -- an empty piece, and a request that is tested before its wait
    local r3, empty = d.reduce_scatter_start(lunar.zeros(0):to(GPU), {0}, {group = g})
    assert(r3:test() ~= nil)
    r3:wait()
    T.equal(empty:numel(), 0, 'an empty piece')
end)

T:test('errors: devices, expanded outputs, counts, roots', function()
    local xg = sample(4, 8, 'f32'):to(GPU)
    if not DRY then
        local err = T.raises(function() d.all_gather(xg, {group = g, out = lunar.empty(4, 8)}) end,
            'are on different devices')
        assert(err:find('on cpu', 1, true) and err:find('on cuda:0', 1, true), err)
    end
    T.raises(function() d.all_reduce(lunar.zeros(3, {device = GPU}):expand(4, 3), {group = g}) end,
        'is an expanded view and cannot be written')
    T.raises(function() d.all_to_all(xg, {3}, {3}, {group = g}) end, 'send counts add up to 3 rows')
    T.raises(function() d.broadcast(xg, {root = 1, group = g}) end, 'root 1 is not a rank of the group')
    T.raises(function() d.all_reduce(lunar.zeros(2, {dtype = 'i32', device = GPU}), {op = 'avg', group = g}) end,
        'op avg needs a floating dtype')
    -- CPU collectives on the same group stay local copies; a group without nccl_init keeps CUDA
    -- collectives local too
    same(d.all_gather(lunar.ones(2, 3), {group = g}), lunar.ones(2, 3), 'a CPU collective on the NCCL group')
    local plain = core.dist.split(d.world(), 0, 0, 'plain')
    same(d.all_reduce(xg:clone(), {group = plain}), xg, 'a CUDA collective on a group without nccl_init')
    assert(not plain:uses_nccl(), 'a one-rank group without nccl_init made an NCCL communicator')
end)

os.exit(T:run())
