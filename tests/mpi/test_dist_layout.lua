-- np: 4
-- Process groups from parallel layouts on 4 ranks: tp=2 x dp=2, ep=4, pp=2 x tp=2, tp=2 x ep=2.
-- Group sizes and members are checked against lists written out by hand (the rule: tp fastest,
-- then cp, dp, pp; experts regroup one stage's ranks as ep consecutive x edp), and a collective
-- runs inside every group.
local lunar = require 'lunar'
local common = dofile('tests/mpi/common.lua')
local d = lunar.dist

local T = common.suite('dist layout', 4)
local R = d.rank()

local function check(cond, msg) if not cond then error(msg, 2) end end

-- the group of this rank, from a table {members list, ...}: the list that holds R
local function mine(lists)
    for _, l in ipairs(lists) do
        for _, r in ipairs(l) do if r == R then return l end end
    end
    error('rank ' .. R .. ' is in none of the lists')
end

-- one group of a layout: members, size, position, name, a collective inside it, the pure plan
local function check_group(lay, axis, lists)
    local g = lay:group(axis)
    local want = mine(lists)
    T.equal(g:ranks(), want, axis .. ' members')
    T.equal(g:size(), #want, axis .. ' size')
    local pos
    for i, r in ipairs(want) do if r == R then pos = i - 1 end end
    T.equal(g:rank(), pos, axis .. ' rank')
    check(g:name() == axis, 'group name ' .. g:name())
    -- a collective inside the group: the members' world ranks, summed and gathered
    local s = d.all_reduce(lunar.tensor({R, 1}, 'i64'), {group = g})
    local sum = 0
    for _, r in ipairs(want) do sum = sum + r end
    T.equal(s:tolist_flat(), {sum, #want}, axis .. ' all_reduce')
    T.equal(g:all_gather(lunar.tensor({R})):tolist_flat(), want, axis .. ' all_gather')
    -- and the pure plan agrees
    T.equal(lay.plan.members(axis, R), want, axis .. ' plan.members')
end

-- groups: axis -> list of member lists (each in group order). Axes are visited in a fixed
-- order: pairs() order differs between processes (LuaJIT seeds its string hash), and
-- collectives on different groups must be issued in the same order everywhere.
local AXES = {'tp', 'cp', 'dp', 'pp', 'dp_cp', 'ep', 'edp', 'world'}
local function check_layout(lay, groups, coords)
    for _, axis in ipairs(AXES) do
        local lists = groups[axis]
        if lists then check_group(lay, axis, lists) end
    end
    local c = lay:coords()
    for k, v in pairs(coords[R + 1]) do T.equal(c[k], v, 'coord ' .. k) end
end

T:test('tp=2 x dp=2', function()
    local lay = d.layout{tp = 2}
    T.equal({lay.tp, lay.cp, lay.dp, lay.pp, lay.ep, lay.edp}, {2, 1, 2, 1, 1, 4}, 'sizes')
    check_layout(lay, {
        tp = {{0, 1}, {2, 3}},
        dp = {{0, 2}, {1, 3}},
        cp = {{0}, {1}, {2}, {3}},
        pp = {{0}, {1}, {2}, {3}},
        dp_cp = {{0, 2}, {1, 3}},
        ep = {{0}, {1}, {2}, {3}},
        edp = {{0, 1, 2, 3}},
        world = {{0, 1, 2, 3}},
    }, {
        {tp = 0, dp = 0, cp = 0, pp = 0, ep = 0, edp = 0},
        {tp = 1, dp = 0, cp = 0, pp = 0, ep = 0, edp = 1},
        {tp = 0, dp = 1, cp = 0, pp = 0, ep = 0, edp = 2},
        {tp = 1, dp = 1, cp = 0, pp = 0, ep = 0, edp = 3},
    })
    check(d.layout{tp = 2, pp = 1, ep = 1, cp = 1} == lay, 'the same spec gives the cached layout')
    check(lay:group('world') == d.world(), 'world group is the world')
end)

T:test('ep=4 (dp=4)', function()
    local lay = d.layout{ep = 4}
    T.equal({lay.tp, lay.dp, lay.ep, lay.edp}, {1, 4, 4, 1}, 'sizes')
    check_layout(lay, {
        tp = {{0}, {1}, {2}, {3}},
        dp = {{0, 1, 2, 3}},
        dp_cp = {{0, 1, 2, 3}},
        ep = {{0, 1, 2, 3}},
        edp = {{0}, {1}, {2}, {3}},
    }, {
        {dp = 0, ep = 0, edp = 0}, {dp = 1, ep = 1, edp = 0}, {dp = 2, ep = 2, edp = 0}, {dp = 3, ep = 3, edp = 0},
    })
    -- an expert all-to-all inside the ep group: rank i sends i+1 rows to each member
    local g = lay:group('ep')
    local sends, recvs, rows = {}, {}, 0
    for j = 0, 3 do sends[j + 1] = R + 1; recvs[j + 1] = j + 1; rows = rows + R + 1 end
    local t = lunar.full({rows, 2}, R)
    local out = g:all_to_all(t, sends, recvs)
    local want = {}
    for j = 0, 3 do for _ = 1, (j + 1) * 2 do want[#want + 1] = j end end
    T.equal(out:tolist_flat(), want, 'ep all_to_all')
end)

T:test('pp=2 x tp=2 (dp=1)', function()
    local lay = d.layout{pp = 2, tp = 2}
    T.equal({lay.tp, lay.dp, lay.pp, lay.ep, lay.edp}, {2, 1, 2, 1, 2}, 'sizes')
    check_layout(lay, {
        tp = {{0, 1}, {2, 3}},
        pp = {{0, 2}, {1, 3}},
        dp = {{0}, {1}, {2}, {3}},
        dp_cp = {{0}, {1}, {2}, {3}},
        ep = {{0}, {1}, {2}, {3}},
        edp = {{0, 1}, {2, 3}},
    }, {
        {tp = 0, pp = 0, dp = 0, edp = 0}, {tp = 1, pp = 0, dp = 0, edp = 1},
        {tp = 0, pp = 1, dp = 0, edp = 0}, {tp = 1, pp = 1, dp = 0, edp = 1},
    })
    -- a pipeline hand-off inside the pp group: stage 0 sends, stage 1 receives
    local g = lay:group('pp')
    local act = lunar.full({2, 2}, 10 + R)
    if lay:coords().pp == 0 then
        g:send(act, 1)
    else
        local got = g:recv(lunar.zeros(2, 2), 0)
        T.equal(got:tolist_flat(), {8 + R, 8 + R, 8 + R, 8 + R}, 'activation from the previous stage')
    end
end)

T:test('tp=2 x ep=2 (experts regroup the stage)', function()
    local lay = d.layout{tp = 2, ep = 2}
    T.equal({lay.tp, lay.dp, lay.ep, lay.edp}, {2, 2, 2, 2}, 'sizes')
    check_layout(lay, {
        tp = {{0, 1}, {2, 3}},
        dp = {{0, 2}, {1, 3}},
        ep = {{0, 1}, {2, 3}},
        edp = {{0, 2}, {1, 3}},
    }, {
        {tp = 0, dp = 0, ep = 0, edp = 0}, {tp = 1, dp = 0, ep = 1, edp = 0},
        {tp = 0, dp = 1, ep = 0, edp = 1}, {tp = 1, dp = 1, ep = 1, edp = 1},
    })
end)

T:test('cp=2 x tp=2: dp_cp joins cp and dp', function()
    local lay = d.layout{cp = 2, tp = 2}
    T.equal({lay.tp, lay.cp, lay.dp}, {2, 2, 1}, 'sizes')
    check_layout(lay, {
        cp = {{0, 2}, {1, 3}},
        dp = {{0}, {1}, {2}, {3}},
        dp_cp = {{0, 2}, {1, 3}},
    }, {{tp = 0, cp = 0}, {tp = 1, cp = 0}, {tp = 0, cp = 1}, {tp = 1, cp = 1}})
end)

T:test('layout errors name the numbers', function()
    T.raises(function() d.layout{tp = 3} end, 'world size 4 is not divisible by tp*pp*cp = 3*1*1 = 3')
    T.raises(function() d.layout{tp = 2, pp = 4} end, 'world size 4 is not divisible by tp*pp*cp = 2*4*1 = 8')
    T.raises(function() d.layout{ep = 3} end, 'ep=3 must divide tp*cp*dp = 1*1*4 = 4')
    T.raises(function() d.layout{pp = 2, ep = 4} end, 'ep=4 must divide tp*cp*dp = 1*1*2 = 2')
    T.raises(function() d.layout{tp = 0} end, 'tp must be a positive integer, got 0')
    T.raises(function() d.layout{tp = 1.5} end, 'tp must be a positive integer')
    T.raises(function() d.layout{tpp = 2} end, "unknown key 'tpp'")
    T.raises(function() d.layout{tp = 2, dp = 4} end, 'dp=4 does not match world size 4 / (tp*pp*cp = 2) = 2')
    T.raises(function() d.layout{tp = 2}:group('xp') end, "unknown axis 'xp'")
    d.barrier()
end)

os.exit(T:run())
