-- lunar.parallel.moe: the parts of a mixture-of-experts layer that depend on how it is split over
-- ranks (lunar.nn.MoE holds the math: router, sort by expert, the experts' products, combine).
--
--   local d = moe.dispatcher(name, E, ep_group, etp_group)   -- where the routed experts are
--   d.first, d.count                         -- the experts this rank holds: [first, first + count)
--   local plan = d:plan(counts)              -- counts (E): this rank's sorted rows per expert
--   local xr, wr = d:dispatch(mod, xs, ws, plan)   -- the rows (and routing weights) its experts run
--   local Y = d:combine(Yr, plan)            -- their unscaled outputs back in sorted order
--   local dyr = d:dispatch_grad(dys, plan); local a, dXs = d:combine_grad(ar, dXr, plan)
--   local xr = d:kept_rows(xr)               -- what backward finds of the rows (nil: take them again)
--
--   local tk = moe.tokens(kind, tp_group, K) -- which of the layer's rows this rank routes
--   local y, saved, routes = tk:forward(routed, shared, x, opts); dx = tk:backward(...)
--
-- Dispatchers. local: every expert is here; the sorted rows go to the experts as they are.
-- all_to_all (ep, and etp, > 1): member r of the ep group holds experts [r * E / ep, (r + 1) * E
-- / ep). After the sort the rows bound for each member are consecutive, so the per-expert counts
-- go first (an all_to_all of E / ep numbers to each member), then the rows and their routing
-- weights (all_to_all with uneven splits, zeros allowed); the member runs its experts on the
-- blocks it received (by sender, then expert) and the reverse all_to_all brings the unscaled
-- outputs back. With etp the members of an etp group hold the same experts, each a block of their
-- matrices: every member runs the rows all of them received, and the partial outputs are summed
-- back to the member that received each row. Every member takes part in every exchange, rows or
-- none.
--
-- Token strategies (tensor parallel): all: this rank routes every row and its routed output is
-- whole (no tp, or tp without ep or sequence parallel: the experts run on every member alike);
-- share (tp x ep): the tp members hold the same tokens and each routes only its share, rows
-- [first, first + n) of N (balanced, the first N % tp members one more), written into the shared
-- experts' partial sums, the routes gathered whole over tp; keep_share (sequence parallel
-- without ep): every member routes every row (the experts are whole) and only its share's rows
-- join the partial sums. In the last two the layer's output is partial over tp (reduced by the
-- MoE's output mapping, or by the decoder layer under sequence parallel).
local core = require 'lunar.core'
local ops = require 'lunar.ops'
local dist = require 'lunar.dist'
local tensor = require 'lunar.tensor'

local fail = tensor.fail

local M = {}

-- ---- dispatchers ------------------------------------------------------------------------------

local Local = {kind = 'local'}
Local.__index = Local

function Local:plan(counts)
    local hits, off = {}, 0
    for e = 0, #counts - 1 do
        local c = counts[e + 1]
        if c > 0 then hits[#hits + 1] = {e = e, off = off + 1, n = c} end
        off = off + c
    end
    return {hits = hits}
end
function Local:dispatch(_, xs, ws) return xs, ws end
function Local:combine(Y) return Y end
function Local:dispatch_grad(dys) return dys end
function Local:combine_grad(a, dXs) return a, dXs end
-- (the rows are the layer's input taken again in backward: nothing kept)
function Local:kept_rows() return nil end

local AllToAll = {kind = 'all_to_all'}
AllToAll.__index = AllToAll

-- counts (E): this rank's rows per expert. The row splits to send and receive (one per member)
-- and the blocks of the received rows (by sending member, then expert).
function AllToAll:plan(counts)
    local ep, El = self.ep:size(), self.count
    local send, sizes = {}, {}
    for j = 0, ep - 1 do
        local s = 0
        for le = 1, El do s = s + counts[j * El + le] end
        send[j + 1] = s
        sizes[j + 1] = El
    end
    local c = core.from_flat(counts, {#counts}, 'i64')
    local got = dist.all_to_all(c, sizes, sizes, {group = self.ep}):tolist_flat()   -- (ep * El)
    local recv, hits, off = {}, {}, 0
    for s = 0, ep - 1 do
        local total = 0
        for le = 0, El - 1 do
            local n = got[s * El + le + 1]
            if n > 0 then hits[#hits + 1] = {e = self.first + le, off = off + 1, n = n, src = s} end
            off, total = off + n, total + n
        end
        recv[s + 1] = total
    end
    local plan = {send = send, recv = recv, hits = hits}
    if self.etp then plan.hits, plan.et = self:_etp_plan(got) end
    return plan
end

-- expert tensor parallel: got, this member's received rows per (sender, local expert). Returns
-- the blocks of the rows of every etp member (by member, sender, expert) and {rows = each
-- member's row count, mine = this member's}.
function AllToAll:_etp_plan(got)
    local n, ep, El = self.etp:size(), self.ep:size(), self.count
    local per = ep * El
    local all = dist.all_gather(core.from_flat(got, {per}, 'i64'), {group = self.etp}):tolist_flat()
    local hits, rows, off = {}, {}, 0
    for m = 0, n - 1 do
        local total = 0
        for s = 0, ep - 1 do
            for le = 0, El - 1 do
                local c = all[m * per + s * El + le + 1]
                if c > 0 then hits[#hits + 1] = {e = self.first + le, off = off + 1, n = c, src = m * ep + s} end
                off, total = off + c, total + c
            end
        end
        rows[m + 1] = total
    end
    return hits, {rows = rows, mine = rows[self.etp:rank() + 1]}
end

-- every etp member's rows (R_m, C) stacked in member order: an all-gather of uneven pieces (an
-- all_to_all sending this member's rows to each)
function AllToAll:_etp_gather(t, et)
    local n, mine = self.etp:size(), et.mine
    local C = t:size(2)
    local rep = core.empty({n * mine, C}, t:dtype(), t:device())
    if mine > 0 then for m = 0, n - 1 do rep:narrow(1, m * mine + 1, mine):copy_(t) end end
    local sends = {}
    for m = 1, n do sends[m] = mine end
    local all = dist.all_to_all(rep, sends, et.rows, {group = self.etp})
    rep:free()
    return all
end

-- the partial sums over the stacked rows (sum R_m, C) back to their members, added in member
-- order: (R_me, C)
function AllToAll:_etp_reduce(t, et)
    local n, mine = self.etp:size(), et.mine
    local C = t:size(2)
    local recvs = {}
    for m = 1, n do recvs[m] = mine end
    local parts = dist.all_to_all(t:contiguous(), et.rows, recvs, {group = self.etp})   -- (n * mine, C)
    local out = core.empty({mine, C}, t:dtype(), t:device())
    if mine == 0 then parts:free(); return out end
    out:copy_(parts:narrow(1, 1, mine))
    for m = 1, n - 1 do ops.add_(out, parts:narrow(1, m * mine + 1, mine)) end
    parts:free()
    return out
end

-- the sorted rows xs (NK, H) and their routing weights ws (NK, 1) to the members holding their
-- experts (frees xs); mod: the MoE layer (its adapters)
function AllToAll:dispatch(mod, xs, ws, plan)
    local xr = dist.all_to_all(xs, plan.send, plan.recv, {group = self.ep})   -- (R, H) by sender, then expert
    xs:free()
    local wr = dist.all_to_all(ws, plan.send, plan.recv, {group = self.ep})
    if plan.et then   -- every etp member's rows, through this member's blocks of the experts
        if mod.store.lora then
            fail(('MoE %s: LoRA adapters on experts split by expert tensor parallel (etp = %d) are not implemented')
                :format(mod.name, self.etp:size()))
        end
        local xg, wg = self:_etp_gather(xr, plan.et), self:_etp_gather(wr, plan.et)
        xr:free(); wr:free()
        xr, wr = xg, wg
    end
    return xr, wr
end

-- the experts' unscaled outputs (R, H) back to the senders, in sorted order (frees Yr)
function AllToAll:combine(Yr, plan)
    if plan.et then
        local Ym = self:_etp_reduce(Yr, plan.et)
        Yr:free()
        Yr = Ym
    end
    local Y = dist.all_to_all(Yr, plan.recv, plan.send, {group = self.ep})   -- (NK, H) back in sorted order
    Yr:free()
    return Y
end

-- the output gradients of the sorted rows dys (NK, H) to the members that ran them (frees dys)
function AllToAll:dispatch_grad(dys, plan)
    local dyr = dist.all_to_all(dys, plan.send, plan.recv, {group = self.ep})
    dys:free()
    if plan.et then
        local dg = self:_etp_gather(dyr, plan.et)
        dyr:free()
        dyr = dg
    end
    return dyr
end

-- the routing-weight gradients ar (R) and input gradients dXr (R, H) of the rows back to their
-- senders: a (NK) and dXs (NK, H) (nil without dXr)
function AllToAll:combine_grad(ar, dXr, plan)
    if plan.et then   -- both are sums over the intermediate width: each member's is partial
        local am = self:_etp_reduce(ar:view(ar:numel(), 1), plan.et)
        ar:free()
        ar = am
        if dXr then
            local dm = self:_etp_reduce(dXr, plan.et)
            dXr:free()
            dXr = dm
        end
    end
    local a = dist.all_to_all(ar:view(ar:numel(), 1), plan.recv, plan.send, {group = self.ep})
    local NK = a:numel()
    local dXs
    if dXr then
        dXs = dist.all_to_all(dXr, plan.recv, plan.send, {group = self.ep})
        dXr:free()
    end
    return a:view(NK), dXs
end

function AllToAll:kept_rows(xr) return xr end

-- the dispatcher of MoE layer `name` with E routed experts: all_to_all over the ep group when ep
-- or etp splits the experts (etp needs the ep group, of one rank when ep = 1), else local
function M.dispatcher(name, E, ep, etp)
    etp = etp and etp:size() > 1 and etp or nil
    if ep and (ep:size() > 1 or etp) then
        local n = ep:size()
        if E % n ~= 0 then
            fail(('MoE %s: n_routed_experts %d is not divisible by the expert-parallel size ep = %d'):format(name, E, n))
        end
        local count = E / n
        return setmetatable({ep = ep, etp = etp, first = ep:rank() * count, count = count}, AllToAll)
    elseif etp then
        fail(('MoE %s: expert tensor parallel (etp = %d) needs the ep group (of size 1 when ep = 1)'):format(name, etp:size()))
    end
    return setmetatable({first = 0, count = E}, Local)
end

-- ---- which rows a tp member routes ------------------------------------------------------------

local All = {kind = 'all', shares_rows = false}
All.__index = All

-- forward(routed, shared, x, opts): routed(rows, opts) -> y (rows, H), saved, routes runs the
-- router and the experts; shared() -> ys (N, H), saved or nil when the layer has no shared
-- experts. Returns the layer's output (routed + shared), saved (saved.shared: the shared
-- experts'), the routes {idx =, weights =} of every row.
function All:forward(routed, shared, x, opts)
    local y, saved, routes = routed(x, opts)
    if shared then
        local ys, ss = shared()
        ops.add_(y, ys)
        ys:free()
        saved.shared = ss
    end
    return y, saved, routes
end

-- backward(routed_backward, dy, saved, dx, want_dx, like): routed_backward(dy_rows, saved,
-- dx_rows) adds the routed rows' input gradient into dx_rows (nil: none wanted); dx: the shared
-- experts' input gradient (N, H) or nil; like = {shape =, dtype =, device =} of a missing dx.
-- Returns dx (nil when not wanted).
function All:backward(routed_backward, dy, saved, dx, want_dx, like)
    if want_dx and not dx then dx = core.empty(like.shape, like.dtype, like.device):fill_(0) end
    routed_backward(dy, saved, dx)
    return dx
end

-- the names of parameters whose gradient is this member's share over tp (the router's, when
-- the members route shares of the rows): {} here
function All:partial() return {} end

local Share = {kind = 'share', shares_rows = true}
Share.__index = Share
function Share:partial(names) return names end

-- rows [first, first + n) of N this member routes, and the largest share (member: another
-- member's share count instead)
local function share_of(g, N, member)
    local T = g:size()
    local base, rem = math.floor(N / T), N % T
    if member then return base + (member < rem and 1 or 0) end
    local r = g:rank()
    return r * base + math.min(r, rem), base + (r < rem and 1 or 0), base + (rem > 0 and 1 or 0)
end
M.share_of = share_of

-- every tp member's routes, whole: idx (N, K) i64 and weights (N, K) f32 from this member's rows
-- (one all_gather of both, exact in f64, each member's rows padded to the largest share)
local function gather_routes(g, routes, N, K)
    local _, n, most = share_of(g, N)
    local dev = routes.weights:device()
    local pack = core.empty({most, 2 * K}, 'f64', dev):fill_(0)
    if n > 0 then
        pack:narrow(1, 1, n):narrow(2, 1, K):copy_(routes.idx)
        pack:narrow(1, 1, n):narrow(2, K + 1, K):copy_(routes.weights)
    end
    local all = dist.all_gather(pack, {group = g})             -- (T * most, 2K)
    local pick = {}
    for m = 0, g:size() - 1 do
        for i = 0, share_of(g, N, m) - 1 do pick[#pick + 1] = m * most + i end
    end
    local whole = ops.index_select(all, 1, core.from_flat(pick, {N}, 'i64', dev))
    return {idx = whole:narrow(2, 1, K):to('i64'), weights = whole:narrow(2, K + 1, K):to('f32')}
end

-- the shared experts' partial sums (zeros without shared experts), and their saved state
local function partial_of(shared, x)
    if shared then return shared() end
    return core.empty(x:size(), x:dtype(), x:device()):fill_(0), nil
end

function Share:forward(routed, shared, x, opts)
    local N = x:size(1)
    local first, n = share_of(self.tp, N)
    local out, ss = partial_of(shared, x)
    local yr, saved, routes = routed(x:narrow(1, first + 1, n), {replay_idx = opts.replay_idx and
        opts.replay_idx:narrow(1, first + 1, n), row_invariant = opts.row_invariant})
    ops.add_(out:narrow(1, first + 1, n), yr)
    routes = gather_routes(self.tp, routes, N, self.K)
    yr:free()
    saved.shared, saved.share = ss, {first = first, n = n, N = N}
    return out, saved, routes
end

function Share:backward(routed_backward, dy, saved, dx, want_dx, like)
    if want_dx and not dx then dx = core.empty(like.shape, like.dtype, like.device):fill_(0) end
    local sh = saved.share
    routed_backward(dy:narrow(1, sh.first + 1, sh.n), saved, dx and dx:narrow(1, sh.first + 1, sh.n))
    return dx
end

local KeepShare = {kind = 'keep_share', shares_rows = false}
KeepShare.__index = KeepShare
KeepShare.partial = All.partial

function KeepShare:forward(routed, shared, x, opts)
    local N = x:size(1)
    local first, n = share_of(self.tp, N)
    local out, ss = partial_of(shared, x)
    local yr, saved, routes = routed(x, opts)
    ops.add_(out:narrow(1, first + 1, n), yr:narrow(1, first + 1, n))
    yr:free()
    saved.shared, saved.share = ss, {first = first, n = n, N = N}
    return out, saved, routes
end

function KeepShare:backward(routed_backward, dy, saved, dx, want_dx, like)
    if want_dx and not dx then dx = core.empty(like.shape, like.dtype, like.device):fill_(0) end
    local sh = saved.share
    local dxr = want_dx and core.empty(like.shape, like.dtype, like.device):fill_(0) or nil
    routed_backward(dy, saved, dxr)
    if not want_dx then return nil end
    ops.add_(dx:narrow(1, sh.first + 1, sh.n), dxr:narrow(1, sh.first + 1, sh.n))
    dxr:free()
    return dx
end

-- the token strategy of a MoE layer of K experts a token: 'all', or 'share' / 'keep_share' over
-- the tp group
function M.tokens(kind, tp, K)
    if kind == 'all' then return setmetatable({}, All) end
    if kind == 'share' then return setmetatable({tp = tp, K = K}, Share) end
    if kind == 'keep_share' then return setmetatable({tp = tp}, KeepShare) end
    fail('lunar.parallel.moe.tokens: unknown kind ' .. tostring(kind))
end

return M
