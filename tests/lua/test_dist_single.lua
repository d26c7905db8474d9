-- lunar.dist in a process started without a launcher: a single-rank world made without MPI,
-- where every collective is a no-op or a copy; and the layout arithmetic (lunar.dist.plan) on
-- larger worlds, checked against the rule written in docs/parallel.md.
local lunar = require 'lunar'
local T = require('lunar.testing').suite('dist single rank')
local d = lunar.dist
local core = lunar.core

local function check(cond, msg) if not cond then error(msg, 2) end end

if d.env().launched then
    io.write('dist single rank: started under a launcher, skipped\n')
    os.exit(77)
end

T:test('init without MPI', function()
    check(not d.is_initialized(), 'not initialised before the first call')
    T.equal(d.rank(), 0, 'rank')
    check(d.is_initialized(), 'initialised by rank()')
    T.equal(d.world_size(), 1, 'world size')
    T.equal(d.local_rank(), 0, 'local rank')
    check(not core.dist.mpi_active(), 'MPI was not initialised')
    check(not d.world():uses_mpi(), 'the world does not use MPI')
    T.equal(d.world():ranks(), {0}, 'ranks')
    check(d.is_main(), 'rank 0 is main')
end)

T:test('collectives on one rank are no-ops or copies', function()
    local t = lunar.tensor({{1, 2}, {3, 4}})
    for _, op in ipairs({'sum', 'avg', 'max', 'min'}) do
        d.all_reduce(t, {op = op})
        T.equal(t:tolist_flat(), {1, 2, 3, 4}, op)
    end
    T.raises(function() d.all_gather(lunar.tensor(3)) end, 'all_gather: a 0-dim tensor has no rows')
    local g = d.all_gather(t:t())
    T.equal(g:size(), {2, 2}, 'all_gather shape')
    T.equal(g:tolist_flat(), {1, 3, 2, 4}, 'all_gather of a transposed view')
    local rs = d.reduce_scatter(lunar.tensor({5, 6, 7}, 'bf16'), {op = 'avg'})
    T.equal(rs:tolist_flat(), {5, 6, 7}, 'reduce_scatter')
    check(rs:dtype() == 'bf16', 'reduce_scatter keeps the dtype')
    T.equal(d.broadcast(t, {root = 0}):tolist_flat(), {1, 2, 3, 4}, 'broadcast')
    T.equal(d.all_to_all(t, {2}, {2}):tolist_flat(), {1, 2, 3, 4}, 'all_to_all')
    T.equal(d.all_to_all(lunar.zeros(0, 3), {0}, {0}):size(), {0, 3}, 'all_to_all of nothing')
    d.barrier()
end)

T:test('errors on one rank', function()
    T.raises(function() d.send(lunar.zeros(2), 0) end, "send (group 'world', 1 rank): destination 0 is this rank")
    T.raises(function() d.recv(lunar.zeros(2), 1) end, 'source 1 is not a rank of the group (0..0)')
    T.raises(function() d.all_to_all(lunar.zeros(2, 1), {1}, {2}) end, 'send counts add up to 1 rows')
    T.raises(function() d.all_to_all(lunar.zeros(2, 1), {2}, {1}) end, 'sends 2 rows to itself but expects 1')
    T.raises(function() d.all_to_all(lunar.zeros(2, 1), {2}, {2}, {out = lunar.zeros(3, 1)}) end,
        'recv counts add up to 2 rows')
    T.raises(function() d.all_to_all(lunar.zeros(2, 1), {-1}, {2}) end, 'send_splits[1] is -1, not a row count')
    T.raises(function() d.all_reduce(lunar.zeros(2, {dtype = 'i32'}), {op = 'avg'}) end, 'op avg needs a floating dtype')
    T.raises(function() d.all_reduce(lunar.zeros(2), 'sum') end, 'options must be a table')
    T.raises(function() d.layout{tp = 2} end, 'world size 1 is not divisible by tp*pp*cp = 2*1*1 = 2')
end)

T:test('layout{} on one rank: every group is this rank', function()
    local lay = d.layout{}
    for _, axis in ipairs({'tp', 'cp', 'dp', 'pp', 'dp_cp', 'ep', 'edp', 'world'}) do
        T.equal(lay:group(axis):ranks(), {0}, axis)
    end
    T.equal(lay:coords().dp, 0, 'coords')
    check(tostring(lay) == 'layout(tp=1 cp=1 dp=1 pp=1 ep=1)', tostring(lay))
end)

-- every group of every axis, for a world of w ranks, checked against the rule itself
local function check_plan(spec, w)
    local p = d.plan(spec, w)
    T.equal(p.tp * p.cp * p.dp * p.pp, w, 'tp*cp*dp*pp = world')
    local stage = p.tp * p.cp * p.dp
    local varies = {tp = {'tp'}, cp = {'cp'}, dp = {'dp'}, pp = {'pp'}, dp_cp = {'dp', 'cp'},
                    ep = {'ep'}, etp = {'etp'}, edp = {'edp'}, world = {'tp', 'cp', 'dp', 'pp'}}
    for r = 0, w - 1 do
        local c = p.coords(r)
        T.equal(c.tp + p.tp * (c.cp + p.cp * (c.dp + p.dp * c.pp)), r, 'rank order tp, cp, dp, pp')
        T.equal(c.etp + p.etp * (c.ep + p.ep * c.edp), r % stage, 'expert coords regroup the stage')
        for axis, vs in pairs(varies) do
            local m = p.members(axis, r)
            local expect = 1
            for _, k in ipairs(vs) do expect = expect * p[k] end
            T.equal(#m, expect, ('%s group size (rank %d, %s)'):format(axis, r, tostring(w)))
            local seen_me = false
            for pos, q in ipairs(m) do
                if q == r then seen_me = true end
                local cq = p.coords(q)
                -- members agree with r on every coordinate the axis does not vary
                local same_stage = math.floor(q / stage) == math.floor(r / stage)
                if axis == 'ep' then
                    check(same_stage and cq.edp == c.edp and cq.etp == c.etp and cq.ep == pos - 1, axis .. ' member')
                elseif axis == 'etp' then
                    check(same_stage and cq.edp == c.edp and cq.ep == c.ep and cq.etp == pos - 1, axis .. ' member')
                elseif axis == 'edp' then
                    check(same_stage and cq.ep == c.ep and cq.etp == c.etp and cq.edp == pos - 1, axis .. ' member')
                else
                    for _, k in ipairs({'tp', 'cp', 'dp', 'pp'}) do
                        local free = false
                        for _, vk in ipairs(vs) do if vk == k then free = true end end
                        if not free then check(cq[k] == c[k], ('%s member %d differs in %s'):format(axis, q, k)) end
                    end
                end
            end
            check(seen_me, axis .. ' group holds its rank')
        end
    end
    return p
end

T:test('plan: the layout rule on 16 and 64 ranks', function()
    local p = check_plan({tp = 2, cp = 2, pp = 2}, 16)
    T.equal(p.dp, 2, 'dp derived')
    T.equal(p.members('tp', 5), {4, 5}, 'tp consecutive')
    T.equal(p.members('cp', 5), {5, 7}, 'cp stride tp')
    T.equal(p.members('dp', 5), {1, 5}, 'dp stride tp*cp')
    T.equal(p.members('pp', 5), {5, 13}, 'pp stride tp*cp*dp')
    T.equal(p.members('dp_cp', 5), {1, 3, 5, 7}, 'dp_cp cp fastest')
    p = check_plan({tp = 2, ep = 4, pp = 2}, 16)
    T.equal(p.members('ep', 9), {8, 9, 10, 11}, 'ep consecutive within the stage')
    T.equal(p.members('edp', 9), {9, 13}, 'edp stride ep within the stage')
    check_plan({tp = 4, ep = 8, pp = 2, cp = 2}, 64)
    check_plan({ep = 8}, 8)
    check_plan({}, 3)
    -- expert tensor parallel: etp fastest, then ep, then edp (Megatron's expert rank order)
    p = check_plan({tp = 2, ep = 2, etp = 2, pp = 2}, 16)
    T.equal(p.members('etp', 9), {8, 9}, 'etp consecutive within the stage')
    T.equal(p.members('ep', 9), {9, 11}, 'ep stride etp')
    T.equal(p.members('edp', 9), {9, 13}, 'edp stride ep*etp')
    check_plan({ep = 2, etp = 4}, 16)
end)

T:test('plan errors name the numbers', function()
    T.raises(function() d.plan({tp = 4, pp = 3}, 16) end, 'world size 16 is not divisible by tp*pp*cp = 4*3*1 = 12')
    T.raises(function() d.plan({tp = 2, ep = 16, pp = 2}, 16) end, 'ep=16 must divide tp*cp*dp = 2*1*4 = 8')
    T.raises(function() d.plan({ep = 2, etp = 4}, 4) end, 'ep*etp = 2*4 = 8 must divide tp*cp*dp = 1*1*4 = 4')
    T.raises(function() d.plan({tp = 2}, 16).members('zz', 0) end, "unknown axis 'zz'")
    T.raises(function() d.plan('tp=2', 16) end, 'expected a table')
end)

os.exit(T:run())
