-- np: 2
-- The collectives and layouts on 2 ranks (the smallest real world), blocking and non-blocking.
local lunar = require 'lunar'
local common = dofile('tests/mpi/common.lua')
local d = lunar.dist

local T = common.suite('dist np2', 2)
local R = d.rank()
local other = 1 - R
local values = common.values

T:test('all_reduce, all_gather, reduce_scatter, broadcast', function()
    local t = lunar.tensor({{R, 2 * R}, {3, R + 0.5}})
    d.all_reduce(t, {op = 'sum'})
    T.equal(values(t), {1, 2, 6, 2}, 'sum')
    local m = lunar.tensor({R, -R}, 'i64')
    d.all_reduce(m, {op = 'min'})
    T.equal(values(m), {0, -1}, 'i64 min')
    local b = lunar.tensor({R + 1, 8}, 'bf16')
    d.all_reduce(b, {op = 'avg'})
    T.equal(values(b), {1.5, 8}, 'bf16 avg')
    T.equal(values(d.all_gather(lunar.tensor({{R, R}}))), {0, 0, 1, 1}, 'all_gather')
    local rs = d.reduce_scatter(lunar.tensor({{1 + R}, {10 + R}}), {op = 'sum'})
    T.equal(values(rs), {R == 0 and 3 or 21}, 'reduce_scatter')
    local bc = lunar.full({3}, R + 7)
    d.broadcast(bc, {root = 1})
    T.equal(values(bc), {8, 8, 8}, 'broadcast from 1')
end)

T:test('all_to_all: one rank sends everything, the other nothing', function()
    local sends = R == 0 and {1, 3} or {0, 0}
    local recvs = R == 0 and {1, 0} or {3, 0}
    local t = R == 0 and lunar.tensor({{1, 2}, {3, 4}, {5, 6}, {7, 8}}) or lunar.zeros(0, 2)
    local out = d.all_to_all(t, sends, recvs)
    if R == 0 then
        T.equal(values(out), {1, 2}, 'kept its own row')
    else
        T.equal(values(out), {3, 4, 5, 6, 7, 8}, 'got three rows')
    end
end)

T:test('send/recv both ways and send_recv', function()
    local a = lunar.full({2, 2}, R + 1, {dtype = 'i64'})
    local got = lunar.zeros(2, 2, {dtype = 'i64'})
    if R == 0 then d.send(a, 1); d.recv(got, 1) else d.recv(got, 0); d.send(a, 0) end
    T.equal(values(got), {other + 1, other + 1, other + 1, other + 1}, 'send then recv')
    local into = lunar.zeros(3)
    d.send_recv(lunar.full({3}, 10 * R), other, into, other)
    T.equal(values(into), {10 * other, 10 * other, 10 * other}, 'send_recv swap')
end)

T:test('layouts tp=2, pp=2, ep=2 on 2 ranks', function()
    local tp = d.layout{tp = 2}
    T.equal(tp:group('tp'):ranks(), {0, 1}, 'tp members')
    T.equal(tp:group('dp'):ranks(), {R}, 'dp alone')
    T.equal(values(d.all_reduce(lunar.tensor({R + 1}), {group = tp:group('tp')})), {3}, 'tp all_reduce')
    T.equal(values(d.all_reduce(lunar.tensor({R + 1}), {group = tp:group('dp')})), {R + 1}, 'dp of one is a no-op')
    local pp = d.layout{pp = 2}
    T.equal(pp:group('pp'):ranks(), {0, 1}, 'pp members')
    T.equal(pp:coords().pp, R, 'pp coord')
    local ep = d.layout{ep = 2}
    T.equal(ep:group('ep'):ranks(), {0, 1}, 'ep members')
    T.equal(ep:group('dp'):ranks(), {0, 1}, 'dp members')
    T.equal(ep:group('edp'):ranks(), {R}, 'edp alone')
    T.raises(function() d.layout{ep = 4} end, 'ep=4 must divide tp*cp*dp = 1*1*2 = 2')
end)

T:test('non-blocking all_reduce_start and reduce_scatter_start with uneven and empty pieces', function()
    local t = lunar.tensor({1, 2, 3, 4, 5}, 'f32'):add(R)
    local req = d.all_reduce_start(t)
    req:wait()
    T.equal(values(t), {3, 5, 7, 9, 11}, 'sum')
    req:wait()   -- a second wait does nothing
    local x = lunar.tensor({1, 2, 3, 4, 5}, 'f32'):mul(R + 1)
    local r1, out = d.reduce_scatter_start(x, {3, 2})
    while not r1:test() do end
    r1:wait()
    T.equal(values(out), R == 0 and {3, 6, 9} or {12, 15}, 'uneven pieces')
    local r2, out2 = d.reduce_scatter_start(x, {5, 0}, {op = 'avg'})
    r2:wait()
    T.equal(out2:numel(), R == 0 and 5 or 0, 'an empty piece')
    if R == 0 then T.equal(values(out2), {1.5, 3, 4.5, 6, 7.5}, 'avg') end
    -- several in flight, finished in another order than started
    local a, b = lunar.tensor({R}, 'f64'), lunar.tensor({10 * R}, 'i64')
    local ra, rb = d.all_reduce_start(a), d.all_reduce_start(b, {op = 'max'})
    rb:wait()
    ra:wait()
    T.equal(values(a), {1}, 'f64 in flight')
    T.equal(values(b), {10}, 'i64 max in flight')
    T.raises(function() d.all_reduce_start(lunar.tensor({1, 2}, 'bf16')) end, 'MPI cannot reduce bf16 in place')
    T.raises(function() d.all_reduce_start(lunar.zeros(4, 3):t()) end, 'must be contiguous')
    T.raises(function() d.reduce_scatter_start(x, {3, 3}) end, 'the counts add up to 6 elements')
    T.raises(function() d.reduce_scatter_start(x, {5}) end, 'counts has 1 entries')
    -- a non-blocking call does not match a blocking one: both ranks fail, naming both
    T.raises(function()
        local y = lunar.zeros(4)
        if R == 0 then d.all_reduce(y) else d.all_reduce_start(y):wait() end
    end, 'members disagree')
end)

os.exit(T:run())
