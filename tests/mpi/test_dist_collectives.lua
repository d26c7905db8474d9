-- np: 4
-- Every collective on CPU tensors against values computed locally: each rank fills its data from
-- its rank number, so every rank knows what every other rank contributed.
local lunar = require 'lunar'
local common = dofile('tests/mpi/common.lua')
local d = lunar.dist

local T = common.suite('dist collectives', 4)
local R, N = d.rank(), d.world_size()
local values = common.values

-- value contributed by rank r at flat index i (exact in f32 and in the sums below)
local function v(r, i) return (r + 1) * 0.5 + i * 0.25 end

local function filled(r, n, dtype, f)
    local t = {}
    for i = 1, n do t[i] = (f or v)(r, i) end
    return lunar.tensor(t, {dtype = dtype or 'f32'})
end

-- bf16 rounding of a double, through lunar's own cast (round to nearest even)
local function check(cond, msg) if not cond then error(msg, 2) end end

local function bf16(x) return lunar.tensor({x}, 'f64'):to('bf16'):to('f64'):item() end

T:test('init: ranks, sizes, MPI world', function()
    check(d.is_initialized(), 'initialised')
    T.equal(d.world_size(), 4, 'world size')
    T.equal(d.rank(), tonumber(os.getenv('OMPI_COMM_WORLD_RANK')), 'rank')
    T.equal(d.local_rank(), tonumber(os.getenv('OMPI_COMM_WORLD_LOCAL_RANK')), 'local rank')
    local w = d.world()
    T.equal(w:ranks(), {0, 1, 2, 3}, 'world ranks')
    check(w:uses_mpi(), 'uses MPI')
    check(tostring(w):find("group 'world' (rank " .. R .. " of 4)", 1, true), 'tostring ' .. tostring(w))
end)

T:test('all_reduce sum/avg/max/min f32, sizes 1, 3, 17, 1000', function()
    for _, n in ipairs({1, 3, 17, 1000}) do
        for _, op in ipairs({'sum', 'avg', 'max', 'min'}) do
            local t = filled(R, n)
            local out = d.all_reduce(t, {op = op})
            check(rawequal(out, t), 'returns t')
            local want = {}
            for i = 1, n do
                local s, mx, mn = 0, -math.huge, math.huge
                for r = 0, N - 1 do
                    s = s + v(r, i); mx = math.max(mx, v(r, i)); mn = math.min(mn, v(r, i))
                end
                want[i] = ({sum = s, avg = s / N, max = mx, min = mn})[op]
            end
            T.equal(values(t), want, ('all_reduce %s n=%d'):format(op, n))
        end
    end
end)

T:test('all_reduce f64 and i64', function()
    local t = filled(R, 5, 'f64', function(r, i) return r * 1e-3 + i end)
    d.all_reduce(t, {op = 'avg'})
    local want = {}
    for i = 1, 5 do want[i] = (0 + 1 + 2 + 3) * 1e-3 / 4 + i end
    T.close(t, want, {rtol = 1e-15, atol = 0})
    local big = 2 ^ 40
    local ti = filled(R, 4, 'i64', function(r, i) return big + r * 7 - i end)
    d.all_reduce(ti)
    local wi = {}
    for i = 1, 4 do wi[i] = 4 * big + 7 * (0 + 1 + 2 + 3) - 4 * i end
    T.equal(values(ti), wi, 'i64 sum')
    local tm = filled(R, 3, 'i64', function(r, i) return (r - 2) * i end)
    d.all_reduce(tm, {op = 'max'})
    T.equal(values(tm), {1, 2, 3}, 'i64 max')
    local tb = lunar.tensor({R == 1 and 1 or 0, 0}, 'bool')
    d.all_reduce(tb, {op = 'max'})
    T.equal(values(tb), {1, 0}, 'bool max (any)')
    local tu = lunar.tensor({R, 10 * R}, 'u8')
    d.all_reduce(tu)
    T.equal(values(tu), {6, 60}, 'u8 sum')
end)

T:test('all_reduce bf16 reduces in f32 and rounds once', function()
    -- rank 0 gives 256, the others 1: summed in bf16 step by step the ones vanish (spacing 2
    -- at 256), summed in f32 the result is 259, rounded once to 260
    local t = lunar.tensor({R == 0 and 256 or 1, R + 0.5, 3}, 'bf16')
    d.all_reduce(t)
    T.equal(values(t), {bf16(259), bf16(0.5 + 1.5 + 2.5 + 3.5), 12}, 'bf16 sum')
    local a = lunar.tensor({R + 1, -R}, 'bf16')
    d.all_reduce(a, {op = 'avg'})
    T.equal(values(a), {2.5, -1.5}, 'bf16 avg')
    local m = lunar.tensor({R * 1.5}, 'f16')
    d.all_reduce(m, {op = 'max'})
    T.equal(values(m), {4.5}, 'f16 max')
end)

T:test('all_reduce non-contiguous views write through to their base', function()
    local base = lunar.zeros(3, 4)
    for i = 1, 3 do for j = 1, 4 do base:set(i, j, R * 100 + i * 10 + j) end end
    local tv = base:t()                       -- (4, 3) transposed view
    check(not tv:is_contiguous(), 'transposed view')
    d.all_reduce(tv, {op = 'sum'})
    local want = {}
    for i = 1, 3 do for j = 1, 4 do want[#want + 1] = 600 + 4 * (i * 10 + j) end end
    T.equal(values(base), want, 'sum through a transposed view')
    -- a narrowed column: only it changes
    local b2 = lunar.zeros(3, 4)
    for i = 1, 3 do for j = 1, 4 do b2:set(i, j, (R % 2 == 0 and R or -R) * 10 + i * 4 + j) end end
    d.all_reduce(b2:narrow(2, 2, 1), {op = 'max'})
    want = {}
    for i = 1, 3 do
        for j = 1, 4 do
            want[#want + 1] = (j == 2 and 20 or (R % 2 == 0 and R or -R) * 10) + i * 4 + j
        end
    end
    T.equal(values(b2), want, 'max through a narrowed column')
    -- a bf16 transposed view (f32 staging and a strided copy back)
    local b = lunar.zeros(2, 3, {dtype = 'bf16'})
    for i = 1, 2 do for j = 1, 3 do b:set(i, j, R + i + j) end end
    d.all_reduce(b:t(), {op = 'avg'})
    local wb = {}
    for i = 1, 2 do for j = 1, 3 do wb[#wb + 1] = 1.5 + i + j end end
    T.equal(values(b), wb, 'bf16 transposed view')
end)

T:test('all_gather concatenates along dim 1 in rank order (f32, bf16, i64, views)', function()
    for _, dt in ipairs({'f32', 'bf16', 'i64'}) do
        local t = lunar.zeros(2, 3, {dtype = dt})
        for i = 1, 2 do for j = 1, 3 do t:set(i, j, R * 10 + i * 3 + j) end end
        local g = d.all_gather(t)
        T.equal(g:size(), {8, 3}, dt .. ' shape')
        check(g:dtype() == dt, dt .. ' dtype')
        local want = {}
        for r = 0, N - 1 do for i = 1, 2 do for j = 1, 3 do want[#want + 1] = r * 10 + i * 3 + j end end end
        T.equal(values(g), want, dt .. ' values')
        -- non-contiguous input and output
        local out = common.strided_copy(lunar.zeros(8, 3, {dtype = dt}))
        d.all_gather(common.strided_copy(t), {out = out})
        T.equal(values(out), want, dt .. ' strided in and out')
    end
    local one = d.all_gather(lunar.tensor({R}))
    T.equal(values(one), {0, 1, 2, 3}, '1-element rows')
    -- 1000 rows, and an expanded (stride 0) input
    local big = d.all_gather(lunar.arange(R * 1000, R * 1000 + 1000))
    T.equal(big:size(), {4000}, '1000 rows')
    local wb = {}
    for i = 1, 4000 do wb[i] = i - 1 end
    T.equal(values(big), wb, '1000 rows values')
    local ex = lunar.tensor({{R, -R}}):expand(3, 2)
    local gx = d.all_gather(ex)
    local wx = {}
    for r = 0, N - 1 do for _ = 1, 3 do wx[#wx + 1] = r; wx[#wx + 1] = -r end end
    T.equal(values(gx), wx, 'expanded input')
end)

T:test('reduce_scatter sum/avg keeps this rank\'s rows (f32, bf16, strided)', function()
    local rows, cols = 8, 3
    local function x(r, i, j) return r * 0.5 + i + j * 0.25 end
    for _, dt in ipairs({'f32', 'bf16'}) do
        for _, op in ipairs({'sum', 'avg'}) do
            local t = lunar.zeros(rows, cols, {dtype = dt})
            for i = 1, rows do for j = 1, cols do t:set(i, j, x(R, i, j)) end end
            local outs = {d.reduce_scatter(t, {op = op}), nil}
            local o2 = common.strided_copy(lunar.zeros(2, cols, {dtype = dt}))
            outs[2] = d.reduce_scatter(common.strided_copy(t), {op = op, out = o2})
            local want = {}
            for i = R * 2 + 1, R * 2 + 2 do
                for j = 1, cols do
                    local s = 0
                    for r = 0, N - 1 do s = s + x(r, i, j) end
                    if op == 'avg' then s = s / N end
                    want[#want + 1] = dt == 'bf16' and bf16(s) or s
                end
            end
            for k, o in ipairs(outs) do
                T.equal(o:size(), {2, cols}, dt .. ' shape')
                T.equal(values(o), want, ('%s %s case %d'):format(dt, op, k))
            end
        end
    end
    local ti = lunar.tensor({{1}, {2}, {3}, {4}}, 'i64')
    local oi = d.reduce_scatter(ti, {op = 'max'})
    T.equal(values(oi), {R + 1}, 'i64 max')
end)

T:test('broadcast from each root (f32, bf16, i64, strided)', function()
    for root = 0, N - 1 do
        for _, dt in ipairs({'f32', 'bf16', 'i64'}) do
            local t = lunar.zeros(3, 2, {dtype = dt})
            for i = 1, 3 do for j = 1, 2 do t:set(i, j, R * 8 + i * 2 + j) end end
            local s = common.strided_copy(t)
            check(rawequal(d.broadcast(t, {root = root}), t), 'returns t')
            d.broadcast(s, {root = root})
            local want = {}
            for i = 1, 3 do for j = 1, 2 do want[#want + 1] = root * 8 + i * 2 + j end end
            T.equal(values(t), want, ('root %d %s'):format(root, dt))
            T.equal(values(s), want, ('root %d %s strided'):format(root, dt))
        end
    end
end)

-- rows rank i sends to rank j: uneven, with zeros (rank 3 sends nothing at all)
local function nsend(i, j)
    if i == 3 then return 0 end
    return (i + 2 * j) % 3
end

local function a2a_case(dt, strided)
    local sends, recvs = {}, {}
    for j = 0, N - 1 do sends[j + 1] = nsend(R, j); recvs[j + 1] = nsend(j, R) end
    local rows = 0
    for _, c in ipairs(sends) do rows = rows + c end
    local t = lunar.zeros(rows, 2, {dtype = dt})
    local row = 0
    for j = 0, N - 1 do
        for k = 1, nsend(R, j) do
            row = row + 1
            t:set(row, 1, 8 * R + 2 * j + k)
            t:set(row, 2, -(8 * R + 2 * j + k))
        end
    end
    local opts
    if strided then
        local recv_rows = 0
        for _, c in ipairs(recvs) do recv_rows = recv_rows + c end
        opts = {out = common.strided_copy(lunar.zeros(recv_rows, 2, {dtype = dt}))}
        if rows > 0 then t = common.strided_copy(t) end
    end
    local out = d.all_to_all(t, sends, recvs, opts)
    local want = {}
    for i = 0, N - 1 do
        for k = 1, nsend(i, R) do
            want[#want + 1] = 8 * i + 2 * R + k
            want[#want + 1] = -(8 * i + 2 * R + k)
        end
    end
    T.equal(out:size(2), 2, 'cols')
    T.equal(values(out), want, ('all_to_all %s%s'):format(dt, strided and ' strided' or ''))
end

T:test('all_to_all with uneven and zero splits (f32, bf16, i64, strided)', function()
    for _, dt in ipairs({'f32', 'bf16', 'i64'}) do
        a2a_case(dt, false)
        a2a_case(dt, true)
    end
    -- even splits of 3-d rows
    local t = lunar.zeros(4, 2, 2)
    for r = 1, 4 do for a = 1, 2 do for b = 1, 2 do t:set(r, a, b, R * 100 + r * 10 + a * 2 + b) end end end
    local out = d.all_to_all(t, {1, 1, 1, 1}, {1, 1, 1, 1})
    local want = {}
    for i = 0, N - 1 do for a = 1, 2 do for b = 1, 2 do want[#want + 1] = i * 100 + (R + 1) * 10 + a * 2 + b end end end
    T.equal(values(out), want, '3-d rows')
end)

T:test('send/recv ring (even ranks send first) and send_recv ring', function()
    local nxt, prv = (R + 1) % N, (R + N - 1) % N
    local mine = lunar.full({2, 3}, R + 0.5)
    local got = lunar.zeros(2, 3)
    if R % 2 == 0 then
        d.send(mine, nxt)
        d.recv(got, prv)
    else
        d.recv(got, prv)
        d.send(mine, nxt)
    end
    T.equal(values(got), {prv + 0.5, prv + 0.5, prv + 0.5, prv + 0.5, prv + 0.5, prv + 0.5}, 'ring recv')
    -- bf16 into a strided target, with send_recv (every rank at once)
    local src = lunar.tensor({{R, R + 1}, {R + 2, R + 3}}, 'bf16')
    local into = common.strided_copy(lunar.zeros(2, 2, {dtype = 'bf16'}))
    local r = d.send_recv(src, nxt, into, prv)
    check(rawequal(r, into), 'returns the receive tensor')
    T.equal(values(into), {prv, prv + 1, prv + 2, prv + 3}, 'send_recv')
    -- sending a strided view
    local big = lunar.zeros(4, 4)
    for i = 1, 4 do for j = 1, 4 do big:set(i, j, R * 16 + (i - 1) * 4 + j) end end
    local view = big:narrow(2, 2, 2)           -- (4, 2) non-contiguous
    local back = lunar.zeros(4, 2)
    d.send_recv(view, prv, back, nxt)          -- the other direction
    local want = {}
    for i = 1, 4 do for j = 2, 3 do want[#want + 1] = nxt * 16 + (i - 1) * 4 + j end end
    T.equal(values(back), want, 'strided send')
end)

T:test('barrier, and group methods', function()
    d.barrier()
    local w = d.world()
    w:barrier()
    local t = w:all_reduce(lunar.full({2}, R), {op = 'max'})
    T.equal(values(t), {3, 3}, 'g:all_reduce')
    T.equal(values(w:all_gather(lunar.tensor({R}))), {0, 1, 2, 3}, 'g:all_gather')
end)

T:test('local errors name the op, the group and the shapes', function()
    local e = T.raises(function() d.all_gather(lunar.zeros(2, 3), {out = lunar.zeros(7, 3)}) end, 'needs 8 rows')
    check(e:find("all_gather (group 'world', 4 ranks)", 1, true), e)
    check(e:find('(7, 3)', 1, true) and e:find('(2, 3)', 1, true), e)
    T.raises(function() d.all_gather(lunar.zeros(2, 3), {out = lunar.zeros(8, 4)}) end, 'differ past the first dim')
    T.raises(function() d.all_gather(lunar.zeros(2, 3), {out = lunar.zeros(8, 3, {dtype = 'bf16'})}) end,
        'different dtypes')
    T.raises(function() d.reduce_scatter(lunar.zeros(6, 2)) end, '6 rows do not split evenly')
    T.raises(function() d.reduce_scatter(lunar.zeros(8, 2), {out = lunar.zeros(3, 2)}) end, 'needs 2 rows')
    T.raises(function() d.all_reduce(lunar.zeros(3, {dtype = 'i64'}), {op = 'avg'}) end, 'op avg needs a floating dtype')
    T.raises(function() d.all_reduce(lunar.zeros(3, {dtype = 'bool'})) end, 'op sum is not defined for bool')
    T.raises(function() d.all_reduce(lunar.zeros(3), {op = 'prod'}) end, "unknown op 'prod'")
    T.raises(function() d.broadcast(lunar.zeros(3), {root = 4}) end, 'root 4 is not a rank of the group (0..3)')
    T.raises(function() d.send(lunar.zeros(3), R) end, 'is this rank')
    T.raises(function() d.recv(lunar.zeros(3), 9) end, 'source 9 is not a rank')
    T.raises(function() d.all_to_all(lunar.zeros(3, 1), {1, 1, 1}, {1, 1, 1, 0}) end, 'send_splits has 3 entries')
    T.raises(function() d.all_to_all(lunar.zeros(3, 1), {1, 1, 1, 1}, {1, 1, 1, 0}) end,
        'send counts add up to 4 rows')
    T.raises(function() d.all_reduce(lunar.zeros(3), {group = 'tp'}) end, 'group must be a process group')
    T.raises(function() d.all_reduce(42) end, 'must be a tensor')
    T.raises(function() d.all_reduce(lunar.zeros(1, 3):expand(2, 3)) end, 'is an expanded view and cannot be written')
    T.raises(function() d.broadcast(lunar.zeros(1, 3):expand(2, 3)) end, 'is an expanded view')
    T.raises(function() d.all_gather(lunar.zeros(1, 3), {out = lunar.zeros(1, 3):expand(4, 3)}) end, 'is an expanded view')
    local dead = lunar.zeros(3)
    dead:free()
    T.raises(function() d.all_reduce(dead) end, 'free')
    d.barrier()   -- still in step after the errors above (none reached MPI)
end)

T:test('mismatches across ranks fail on every rank, naming both shapes', function()
    -- every rank gets the same error, so all of them stay in step
    local e = T.raises(function() d.all_reduce(lunar.zeros(R == 2 and 5 or 4)) end, 'members disagree')
    check(e:find('rank 0 calls all_reduce of f32 (4)', 1, true), e)
    check(e:find('rank 2 calls all_reduce of f32 (5)', 1, true), e)
    e = T.raises(function() d.all_gather(lunar.zeros(2, R == 1 and 3 or 2, {dtype = R == 1 and 'bf16' or 'f32'})) end,
        'members disagree')
    check(e:find('rank 1 calls all_gather of bf16 (2, 3)', 1, true), e)
    T.raises(function() d.all_reduce(lunar.zeros(4), {op = R == 3 and 'max' or 'sum'}) end, 'op max')
    T.raises(function() d.broadcast(lunar.zeros(2), {root = R == 0 and 1 or 0}) end, 'root 1')
    -- a different collective on one rank
    T.raises(function()
        if R == 1 then d.barrier() else d.all_reduce(lunar.zeros(2)) end
    end, 'rank 1 calls barrier')
    -- all_to_all counts that do not pair up: rank 1 expects 2 rows from rank 0, which sends 1
    e = T.raises(function()
        local recv = {1, 1, 1, 1}
        if R == 1 then recv[1] = 2 end
        local rows = 0
        for _, c in ipairs(recv) do rows = rows + c end
        d.all_to_all(lunar.zeros(4, 3), {1, 1, 1, 1}, recv, {out = lunar.zeros(rows, 3)})
    end, 'rank 1 expects 2 rows from rank 0, which sends 1')
    -- point to point: the receiver checks what arrives
    if R == 0 then
        d.send(lunar.zeros(2, 3), 1)
    elseif R == 1 then
        T.raises(function() d.recv(lunar.zeros(3, 2), 0) end, 'rank 1 expects f32 (3, 2) on cpu from rank 0, which sends f32 (2, 3) on cpu')
    end
    d.barrier()
end)

T:test('checks can be turned off per group', function()
    local w = d.world()
    check(w:checks(), 'default on')
    w:checks(false)
    local t = d.all_reduce(lunar.full({3}, 1))
    T.equal(values(t), {4, 4, 4}, 'all_reduce without checks')
    w:checks(true)
    check(w:checks(), 'back on')
end)

os.exit(T:run())
