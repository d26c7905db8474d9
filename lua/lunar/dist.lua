-- lunar.dist: ranks, process groups and collectives.
--
--   local dist = require('lunar').dist
--   dist.rank(), dist.world_size(), dist.local_rank()       -- 0-based ranks
--   dist.all_reduce(g, {op = 'avg', group = lay:group('dp')}) -- in place, returns g
--   local lay = dist.layout{tp = 2, pp = 1, cp = 1, ep = 1, etp = 1}  -- dp derived from the world size
--   lay:group('tp'):size(), lay:coords().dp
--
-- Every function initialises lazily: under mpirun (or srun) that starts MPI, alone it makes a
-- single-rank world without MPI, where every collective is a no-op or a copy. Collectives take
-- any strided CPU or CUDA tensor (CPU through MPI, CUDA through NCCL on the tensor's stream);
-- all members of the group call them in the same order. Group ranks, world ranks and layout
-- coordinates are 0-based. The C contract is host/include/lunar/comm.h; the layout rule is in
-- docs/parallel.md.
--
--   all_reduce(t, {op='sum'|'avg'|'max'|'min', group=})            -> t (in place)
--   all_gather(t, {group=, out=})                                 -> (size * N, ...) rank order
--   reduce_scatter(t, {op='sum'|'avg', group=, out=})             -> (N / size, ...) my slice
--   broadcast(t, {root=0, group=})                                -> t (in place)
--   all_to_all(t, send_splits, recv_splits, {group=, out=})       -> (sum(recv_splits), ...)
--   send(t, dst, {group=}); recv(t, src, {group=}) -> t;  send_recv(t, dst, into, src, {group=}) -> into
--   barrier({group=})
--   all_reduce_start(t, {op=, group=}) -> request   (non-blocking, in place; request:wait())
--   reduce_scatter_start(t, counts, {op=, group=, out=}) -> request, out   (uneven pieces of 1-D t)
--   group:rank(), group:size(), group:ranks() (world ranks), group:name()
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'

local C = core.dist
local fail = tensor.fail
local is_tensor = tensor.is_tensor
local group_methods = core.group_methods

local M = {}

local world    -- the world group, once initialised
local layouts = {}   -- layout cache: spec string -> layout (groups are MPI_Comm_split results)

-- os.exit under MPI: a clean exit finalises MPI first (mpirun treats a rank that leaves without
-- MPI_Finalize as failed); a failing exit aborts the job, so no other rank waits for this one.
local function install_exit_hook()
    if not C.mpi_active() then return end
    local exit = os.exit
    os.exit = function(code, close)
        if code == nil or code == true or code == 0 then
            C.finalize()
        else
            C.abort(type(code) == 'number' and code or 1)
        end
        return exit(code, close)
    end
end

-- init(): the world group. Called by every function below; cheap after the first time.
function M.init()
    if not world then
        world = C.init()
        install_exit_hook()
    end
    return world
end

function M.is_initialized() return world ~= nil end
function M.world() return M.init() end
function M.rank() return M.init():rank() end
function M.world_size() return M.init():size() end
-- rank among the processes of this node (OMPI_COMM_WORLD_LOCAL_RANK, or found through MPI);
-- the default CUDA device ("cuda") is this rank's, modulo the device count
function M.local_rank() return M.init():local_rank() end
function M.is_main() return M.rank() == 0 end
-- what the launcher says (no initialisation): {launched=, rank=, size=, local_rank=}
function M.env() return C.env() end

local function is_group(g) return type(g) == 'userdata' and getmetatable(g) == core.group_mt end
M.is_group = is_group

local function opts_of(opts, fname)
    if opts == nil then return {} end
    if type(opts) ~= 'table' then fail(('%s: options must be a table, got a %s'):format(fname, type(opts))) end
    return opts
end

local function group_of(opts, fname)
    local w = M.init()
    local g = opts.group
    if g == nil then return w end
    if not is_group(g) then fail(('%s: group must be a process group (from dist.world() or layout:group()), got a %s')
        :format(fname, type(g))) end
    return g
end

local function check_tensor(t, fname, what)
    if not is_tensor(t) then fail(('%s: %s must be a tensor, got a %s'):format(fname, what or 'argument 1', type(t))) end
end

local function check_rank(v, fname, what)
    if type(v) ~= 'number' or v ~= math.floor(v) then
        fail(('%s: %s must be a 0-based group rank, got %s'):format(fname, what, tostring(v)))
    end
end

-- a tensor like t with n rows
local function with_rows(t, n)
    if t:dim() < 1 then fail('collective along the first dim needs a tensor with at least 1 dim, got a scalar') end
    local shape = t:size()
    shape[1] = n
    return core.empty(shape, t:dtype(), t:device())
end

function M.all_reduce(t, opts)
    opts = opts_of(opts, 'all_reduce')
    check_tensor(t, 'all_reduce')
    return C.all_reduce(group_of(opts, 'all_reduce'), t, opts.op or 'sum')
end

function M.all_gather(t, opts)
    opts = opts_of(opts, 'all_gather')
    check_tensor(t, 'all_gather')
    if t:dim() == 0 then fail('all_gather: a 0-dim tensor has no rows to stack (view it as (1) first)') end
    local g = group_of(opts, 'all_gather')
    local out = opts.out or with_rows(t, t:size(1) * g:size())
    return C.all_gather(g, out, t)
end

function M.reduce_scatter(t, opts)
    opts = opts_of(opts, 'reduce_scatter')
    check_tensor(t, 'reduce_scatter')
    local g = group_of(opts, 'reduce_scatter')
    local out = opts.out
    if not out then
        local rows = t:dim() >= 1 and t:size(1) or 0
        if rows % g:size() ~= 0 then
            fail(('reduce_scatter (group \'%s\', %d ranks): %d rows do not split evenly'):format(g:name(), g:size(), rows))
        end
        out = with_rows(t, rows / g:size())
    end
    return C.reduce_scatter(g, out, t, opts.op or 'sum')
end

function M.broadcast(t, opts)
    opts = opts_of(opts, 'broadcast')
    check_tensor(t, 'broadcast')
    local root = opts.root or 0
    check_rank(root, 'broadcast', 'root')
    return C.broadcast(group_of(opts, 'broadcast'), t, root)
end

local function sum_of(splits, fname, what)
    if type(splits) ~= 'table' then fail(('%s: %s must be an array of row counts, got a %s'):format(fname, what, type(splits))) end
    local s = 0
    for i = 1, #splits do
        local v = splits[i]
        if type(v) ~= 'number' or v < 0 or v ~= math.floor(v) then
            fail(('%s: %s[%d] is %s, not a row count'):format(fname, what, i, tostring(v)))
        end
        s = s + v
    end
    return s
end

function M.all_to_all(t, send_splits, recv_splits, opts)
    opts = opts_of(opts, 'all_to_all')
    check_tensor(t, 'all_to_all')
    local g = group_of(opts, 'all_to_all')
    sum_of(send_splits, 'all_to_all', 'send_splits')
    local out = opts.out or with_rows(t, sum_of(recv_splits, 'all_to_all', 'recv_splits'))
    return C.all_to_all(g, out, t, send_splits, recv_splits)
end

function M.send(t, dst, opts)
    opts = opts_of(opts, 'send')
    check_tensor(t, 'send')
    check_rank(dst, 'send', 'dst')
    C.send(group_of(opts, 'send'), t, dst)
end

function M.recv(t, src, opts)
    opts = opts_of(opts, 'recv')
    check_tensor(t, 'recv')
    check_rank(src, 'recv', 'src')
    return C.recv(group_of(opts, 'recv'), t, src)
end

-- send t to dst and receive into `into` from src at once (rings, pipeline shifts): no ordering
-- deadlock, unlike a send and a recv that every rank issues in the same order
function M.send_recv(t, dst, into, src, opts)
    opts = opts_of(opts, 'send_recv')
    check_tensor(t, 'send_recv', 'the tensor to send')
    check_tensor(into, 'send_recv', 'the tensor to receive into')
    check_rank(dst, 'send_recv', 'dst')
    check_rank(src, 'send_recv', 'src')
    return C.send_recv(group_of(opts, 'send_recv'), into, src, t, dst)
end

function M.barrier(opts)
    opts = opts_of(opts, 'barrier')
    C.barrier(group_of(opts, 'barrier'))
end

-- ---- non-blocking collectives --------------------------------------------------------------
--
-- They start and return a request at once; request:wait() finishes it (request:test() says
-- whether it has, and lets MPI move data). The tensors are used in place: contiguous, f32/f64 or
-- an integer dtype on CPU, and left alone until the wait. Every member starts the same
-- operations in the same order (they do not match blocking ones). See host/include/lunar/comm.h.

function M.all_reduce_start(t, opts)
    opts = opts_of(opts, 'all_reduce_start')
    check_tensor(t, 'all_reduce_start')
    return C.all_reduce_start(group_of(opts, 'all_reduce_start'), t, opts.op or 'sum')
end

-- t: 1-D, sum(counts) elements; member j receives elements [sum(counts[1..j]), +counts[j+1]) reduced
-- (counts in member order, one per member, zeros allowed); returns the request and out (counts[me+1])
function M.reduce_scatter_start(t, counts, opts)
    opts = opts_of(opts, 'reduce_scatter_start')
    check_tensor(t, 'reduce_scatter_start')
    local g = group_of(opts, 'reduce_scatter_start')
    sum_of(counts, 'reduce_scatter_start', 'counts')
    local mine = counts[g:rank() + 1]
    if mine == nil then
        fail(('reduce_scatter_start: counts has %d entries, group \'%s\' has %d ranks'):format(#counts, g:name(), g:size()))
    end
    local out = opts.out or core.empty({mine}, t:dtype(), t:device())
    return C.reduce_scatter_start(g, out, t, counts, opts.op or 'sum'), out
end

-- ---- process groups from a parallel layout ------------------------------------------------
--
-- Rank order (Megatron's default): tp fastest, then cp, then dp, then pp:
--   rank = tp_i + tp * (cp_i + cp * (dp_i + dp * pp_i)),   dp = world / (tp * cp * pp)
-- Expert layout: inside one pipeline stage the tp*cp*dp ranks are regrouped as etp (expert tensor
-- parallel, fastest) x ep x edp (expert data parallel):
--   s = rank % (tp * cp * dp),  etp_i = s % etp,  ep_i = floor(s / etp) % ep,
--   edp_i = floor(s / (etp * ep)),   so ep * etp | tp*cp*dp
-- Groups: tp, cp, dp, pp vary one coordinate; dp_cp varies dp and cp (ordered cp fastest);
-- etp, ep and edp vary one expert coordinate within the stage; world is everyone.

local AXES = {'tp', 'cp', 'dp', 'pp', 'dp_cp', 'ep', 'etp', 'edp', 'world'}
local SPEC_KEYS = {tp = true, pp = true, ep = true, etp = true, cp = true, dp = true}

local function positive_int(spec, k)
    local v = spec[k]
    if v == nil then return 1 end
    if type(v) ~= 'number' or v < 1 or v ~= math.floor(v) then
        fail(('layout: %s must be a positive integer, got %s'):format(k, tostring(v)))
    end
    return v
end

-- plan(spec, world_size): the pure arithmetic of a layout (no MPI), for any world size.
-- Returns {tp=, cp=, dp=, pp=, ep=, edp=, world=, coords = function(rank), members = function(axis, rank)}.
function M.plan(spec, world_size)
    spec = spec or {}
    if type(spec) ~= 'table' then fail('layout: expected a table like {tp=2, pp=1, ep=1, cp=1}, got a ' .. type(spec)) end
    for k in pairs(spec) do
        if not SPEC_KEYS[k] then fail(('layout: unknown key \'%s\' (tp, pp, ep, etp, cp; dp is derived)'):format(tostring(k))) end
    end
    local tp, pp, cp, ep = positive_int(spec, 'tp'), positive_int(spec, 'pp'), positive_int(spec, 'cp'), positive_int(spec, 'ep')
    local etp = positive_int(spec, 'etp')
    local w = world_size
    local denom = tp * pp * cp
    if w % denom ~= 0 then
        fail(('layout: world size %d is not divisible by tp*pp*cp = %d*%d*%d = %d'):format(w, tp, pp, cp, denom))
    end
    local dp = w / denom
    if spec.dp ~= nil and spec.dp ~= dp then
        fail(('layout: dp=%s does not match world size %d / (tp*pp*cp = %d) = %d'):format(tostring(spec.dp), w, denom, dp))
    end
    local stage = tp * cp * dp
    if stage % (ep * etp) ~= 0 then
        if etp == 1 then
            fail(('layout: ep=%d must divide tp*cp*dp = %d*%d*%d = %d (the ranks of one pipeline stage)')
                :format(ep, tp, cp, dp, stage))
        end
        fail(('layout: ep*etp = %d*%d = %d must divide tp*cp*dp = %d*%d*%d = %d (the ranks of one pipeline stage)')
            :format(ep, etp, ep * etp, tp, cp, dp, stage))
    end
    local p = {tp = tp, cp = cp, dp = dp, pp = pp, ep = ep, etp = etp, edp = stage / (ep * etp), world = w,
               dp_cp = dp * cp}
    function p.coords(r)
        local s = r % stage
        return {
            tp = r % tp,
            cp = math.floor(r / tp) % cp,
            dp = math.floor(r / (tp * cp)) % dp,
            pp = math.floor(r / stage),
            etp = s % etp,
            ep = math.floor(s / etp) % ep,
            edp = math.floor(s / (etp * ep)),
        }
    end
    local function rank_of(c) return c.tp + tp * (c.cp + cp * (c.dp + dp * c.pp)) end
    -- color (which group) and key (position in it) of rank r for an axis
    function p.color_key(axis, r)
        local c = p.coords(r)
        if axis == 'tp' then return math.floor(r / tp), c.tp
        elseif axis == 'cp' then return c.tp + tp * (c.dp + dp * c.pp), c.cp
        elseif axis == 'dp' then return c.tp + tp * (c.cp + cp * c.pp), c.dp
        elseif axis == 'pp' then return r % stage, c.pp
        elseif axis == 'dp_cp' then return c.tp + tp * c.pp, c.cp + cp * c.dp
        elseif axis == 'ep' then return c.etp + etp * (c.edp + p.edp * c.pp), c.ep
        elseif axis == 'etp' then return c.ep + ep * (c.edp + p.edp * c.pp), c.etp
        elseif axis == 'edp' then return c.etp + etp * (c.ep + ep * c.pp), c.edp
        elseif axis == 'world' then return 0, r
        end
        fail(('layout: unknown axis \'%s\' (tp, cp, dp, pp, ep, etp, edp, dp_cp, world)'):format(tostring(axis)))
    end
    -- world ranks of the group of `axis` that holds rank r, in group order
    function p.members(axis, r)
        local color = p.color_key(axis, r)
        local list = {}
        for q = 0, w - 1 do
            local cq, kq = p.color_key(axis, q)
            if cq == color then list[#list + 1] = {kq, q} end
        end
        table.sort(list, function(a, b) return a[1] < b[1] end)
        for i, e in ipairs(list) do list[i] = e[2] end
        return list
    end
    p.rank_of = rank_of
    return p
end

local Layout = {}
Layout.__index = Layout

-- every rank must ask for the same layout: the group splits would otherwise pair ranks that
-- think in different layouts, and later collectives would run on groups of the wrong size
local function check_same_layout(w, p, key)
    if w:size() == 1 then return end
    local mine = {p.tp, p.cp, p.dp, p.pp, p.ep, p.etp}
    local all = M.all_gather(tensor.api.tensor(mine, 'i64'), {group = w}):tolist_flat()
    for r = 0, w:size() - 1 do
        for i = 1, 6 do
            if all[r * 6 + i] ~= mine[i] then
                fail(('layout: the ranks disagree: rank %d asks for %s, rank %d for tp=%d cp=%d dp=%d pp=%d ep=%d%s '
                    .. '(every rank must pass the same spec)'):format(w:rank(), key, r, all[r * 6 + 1], all[r * 6 + 2],
                    all[r * 6 + 3], all[r * 6 + 4], all[r * 6 + 5], all[r * 6 + 6] > 1 and (' etp=' .. all[r * 6 + 6]) or ''))
            end
        end
    end
end

-- layout{tp=, pp=, ep=, cp=}: every rank calls it with the same spec (it splits the world,
-- which is collective, as is every call: it first checks that the ranks agree); the same spec
-- again returns the same object.
function M.layout(spec)
    local w = M.init()
    local p = M.plan(spec, w:size())
    local key = ('tp=%d cp=%d dp=%d pp=%d ep=%d'):format(p.tp, p.cp, p.dp, p.pp, p.ep)
        .. (p.etp > 1 and (' etp=' .. p.etp) or '')
    check_same_layout(w, p, key)   -- before the cache: a cached layout on one rank must not skip it
    if layouts[key] then return layouts[key] end
    local me = w:rank()
    local lay = setmetatable({tp = p.tp, cp = p.cp, dp = p.dp, pp = p.pp, ep = p.ep, etp = p.etp, edp = p.edp,
                              world_size = p.world, plan = p, key = key, groups = {}, _coords = p.coords(me)}, Layout)
    for _, axis in ipairs(AXES) do
        if axis == 'world' then
            lay.groups.world = w
        else
            local color, k = p.color_key(axis, me)
            lay.groups[axis] = C.split(w, color, k, axis)
        end
    end
    layouts[key] = lay
    return lay
end

function Layout:group(axis)
    local g = self.groups[axis]
    if not g then fail(('layout: unknown axis \'%s\' (tp, cp, dp, pp, ep, etp, edp, dp_cp, world)'):format(tostring(axis))) end
    return g
end

-- this rank's 0-based index along each axis: {tp=, cp=, dp=, pp=, ep=, etp=, edp=}
function Layout:coords()
    local c = {}
    for k, v in pairs(self._coords) do c[k] = v end
    return c
end

function Layout:size(axis) return self:group(axis):size() end

function Layout:__tostring() return 'layout(' .. self.key .. ')' end

-- ---- group methods: g:all_reduce(t, opts) == dist.all_reduce(t, {group = g, ...}) ----------

local function with_group(g, opts)
    local o = {}
    if opts ~= nil then
        if type(opts) ~= 'table' then fail('options must be a table, got a ' .. type(opts)) end
        for k, v in pairs(opts) do o[k] = v end
    end
    o.group = g
    return o
end

function group_methods.all_reduce(g, t, opts) return M.all_reduce(t, with_group(g, opts)) end
function group_methods.all_gather(g, t, opts) return M.all_gather(t, with_group(g, opts)) end
function group_methods.reduce_scatter(g, t, opts) return M.reduce_scatter(t, with_group(g, opts)) end
function group_methods.broadcast(g, t, opts) return M.broadcast(t, with_group(g, opts)) end
function group_methods.all_to_all(g, t, s, r, opts) return M.all_to_all(t, s, r, with_group(g, opts)) end
function group_methods.send(g, t, dst) return M.send(t, dst, {group = g}) end
function group_methods.recv(g, t, src) return M.recv(t, src, {group = g}) end
function group_methods.send_recv(g, t, dst, into, src) return M.send_recv(t, dst, into, src, {group = g}) end
function group_methods.barrier(g) return M.barrier({group = g}) end
function group_methods.all_reduce_start(g, t, opts) return M.all_reduce_start(t, with_group(g, opts)) end
function group_methods.reduce_scatter_start(g, t, counts, opts) return M.reduce_scatter_start(t, counts, with_group(g, opts)) end

return M
