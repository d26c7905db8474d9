-- lunar.nn.MoE: one mixture-of-experts layer of GLM-5 (GlmMoeDsaMoE) and GLM-4.5/4.6/4.7
-- (Glm4MoeMoE): a sigmoid top-k router, routed experts (gated MLPs) and shared experts.
-- x (N, H) -> y (N, H). Spec: glm5-architecture.md sections 7, 9.2 and 14.3; docs/model.md.
--
--   local moe = MoE.new(store, 'model.layers.3.mlp', cfg[, {group_fill = -math.huge, ep = group}])
--   local y, saved, routing = moe:forward(x[, {replay_idx = idx, row_invariant = false}])
--   local dx = moe:backward(dy, saved[, need_dx])
--   local idx, w, sk = MoE.route(logits, bias, cfg[, {replay_idx =, group_fill =}])
--
-- Parameters (checkpoint names under `name`): gate.weight (E, H), gate.e_score_correction_bias
-- (E) f32 (frozen, used only to choose experts; optional), experts.<e>.{gate,up,down}_proj.weight
-- for e = 0..E-1, shared_experts.{gate,up,down}_proj.weight (when n_shared_experts > 0).
--
-- cfg holds the HF config fields: n_routed_experts (or num_local_experts), num_experts_per_tok,
-- n_group (1), topk_group (1), norm_topk_prob (true), routed_scaling_factor (1.0),
-- n_shared_experts (1), hidden_act ('silu'; any of lunar.nn.MLP.ACTIVATIONS, for the routed and
-- the shared experts alike); defaults in brackets.
--
-- Router (f32 whatever the model dtype): l = x W^T, s = sigmoid(l), c = s + bias; with
-- n_group > 1 each group scores the sum of its two largest c and only the best topk_group
-- groups stay (the others' c become group_fill: -inf as in transformers 5, 0.0 in older code);
-- idx = topk(c, K) (sorted by c, ties to the lower expert id); w = s[idx] (no bias), divided by
-- (sum + 1e-20) when norm_topk_prob, times routed_scaling_factor.
--
-- Experts run grouped by expert: the N*K (token, slot) pairs are sorted by expert id (stable),
-- the tokens gathered once in that order, and each expert with tokens does three gemms on its
-- contiguous block of rows (their sizes: a histogram of the expert ids, read by the host); the
-- activation and the scaling by the routing weights are single ops over all rows. The combine
-- goes back through the inverse of the sort: each token's K rows, in ascending row order, which
-- is ascending expert order as in HF's eager loop, are summed in that fixed order by one op
-- (index_select_sum), so every output element is one independent sum, parallel on a GPU and the
-- same bits on every backend. The backward's dx goes the same way, and the router's gradient
-- comes back to the (token, slot) layout by a gather through the inverse.
--
-- Expert parallel (MoE.new's opts.ep, a lunar.dist group): this rank holds a range of the
-- experts; after the sort, the rows bound for each member are consecutive, so one all_to_all
-- (counts first) sends them, the members run their experts on the blocks they received (by
-- sender, then expert) and a reverse all_to_all brings the unscaled outputs back to be scaled
-- and combined as above; backward sends the output gradients the same way and brings back the
-- input gradients and each row's routing-weight gradient. Every member takes part in every
-- exchange, rows or none. With tensor parallel too (opts.tp), the tp members hold the same tokens:
-- each routes and dispatches only its share of the rows, adds the routed outputs into the shared
-- experts' partial sums, and one all-reduce over tp makes the output whole (the input gradient
-- likewise); the router's gradient is then the member's share (MoE:tp_partial). docs/parallel.md.
--
-- Routing replay (R3): opts.replay_idx (N, K) gives the expert ids to use; the weights are still
-- computed from the current router at those ids, so the router gets its gradient.
--
-- opts.row_invariant: every product of the forward (router, experts, their adapters, shared
-- experts) is row-invariant (lunar.ops.gemm's option): a token's output bits do not depend on the
-- other tokens, whose number decides how many rows each expert gets. Generation's decode steps
-- ask for it (a request must give the same bits alone or batched); training does not (BLAS).
--
-- LoRA: an expert projection with an adapter in the store (store:adapter(
-- '<name>.experts.<e>.gate_proj'), lunar.nn.lora) adds its low-rank path to that expert's block
-- of rows; the shared experts are a lunar.nn.MLP, whose Linears do the same.
local core = require 'lunar.core'
local ops = require 'lunar.ops'
local dist = require 'lunar.dist'
local tensor = require 'lunar.tensor'
local MLP = require 'lunar.nn.mlp'
local lora = require 'lunar.nn.lora'

local fail = tensor.fail

local MoE = {}
MoE.__index = MoE

local function shape_str(t) return '(' .. table.concat(t:size(), ', ') .. ')' end

-- The routing parameters of cfg, checked, with defaults.
local function routing_cfg(cfg, where)
    local E = cfg.n_routed_experts or cfg.num_local_experts
    local K = cfg.num_experts_per_tok
    local G = cfg.n_group or 1
    local TG = cfg.topk_group or 1
    local function bad(msg) error(('%s: %s'):format(where, msg), 3) end
    if type(E) ~= 'number' or E < 1 or E ~= math.floor(E) then
        bad('n_routed_experts must be a positive integer, got ' .. tostring(E))
    end
    if type(K) ~= 'number' or K < 1 or K > E or K ~= math.floor(K) then
        bad(('num_experts_per_tok must be an integer in [1, %d], got %s'):format(E, tostring(K)))
    end
    if type(G) ~= 'number' or G < 1 or E % G ~= 0 then
        bad(('n_group %s must be a positive divisor of n_routed_experts %d'):format(tostring(G), E))
    end
    if G > 1 then
        if E / G < 2 then bad(('n_group %d leaves fewer than 2 experts per group (n_routed_experts %d)'):format(G, E)) end
        if type(TG) ~= 'number' or TG < 1 or TG > G then
            bad(('topk_group must be in [1, n_group = %d], got %s'):format(G, tostring(TG)))
        end
        if TG * (E / G) < K then
            bad(('topk_group %d groups of %d experts hold fewer than num_experts_per_tok %d'):format(TG, E / G, K))
        end
    end
    local fill = cfg.group_fill
    if fill == nil then fill = -math.huge end
    return {routing = true, E = E, K = K, G = G, TG = TG, norm = cfg.norm_topk_prob ~= false,
            scale = cfg.routed_scaling_factor or 1.0, fill = fill}
end

-- idx (N, K) i64 of the chosen experts; s (N, E) f32 sigmoid scores, bias (E) or nil.
local function choose(s, bias, rc)
    local c = bias and ops.add(s, bias) or s
    if rc.G > 1 then
        local N, per = s:size(1), rc.E / rc.G
        local c3 = c:view(N, rc.G, per)
        local top2 = ops.topk(c3, 2)                    -- (N, G, 2)
        local group_score = ops.sum(top2, 3)            -- (N, G)
        local _, gidx = ops.topk(group_score, rc.TG)    -- (N, TG)
        local keep = core.empty({N, rc.G}, 'f32', s:device()):fill_(0)
        ops.scatter_(keep, 2, gidx, core.empty({N, rc.TG}, 'f32', s:device()):fill_(1))
        c = ops.masked_fill(c3, ops.eq(keep, 0):view(N, rc.G, 1), rc.fill):view(N, rc.E)
    end
    local _, idx = ops.topk(c, rc.K)
    return idx
end

-- routing weights (N, K) from the selected sigmoid scores sk (N, K)
local function weights_of(sk, rc)
    local w = sk
    if rc.norm then w = ops.div(sk, ops.add(ops.sum(sk, 2, {keepdim = true}), 1e-20)) end
    return ops.mul(w, rc.scale)
end

local function check_replay(idx, N, rc)
    if not tensor.is_tensor(idx) then fail('MoE: replay_idx must be a tensor, got a ' .. type(idx)) end
    if idx:dim() ~= 2 or idx:size(1) ~= N or idx:size(2) ~= rc.K then
        fail(('MoE: replay_idx has shape %s, expected (%d, %d) (tokens, num_experts_per_tok)'):format(
            shape_str(idx), N, rc.K))
    end
    if idx:dtype() ~= 'i64' and idx:dtype() ~= 'i32' then
        fail(('MoE: replay_idx must be an integer tensor (i64), got %s'):format(idx:dtype()))
    end
    return idx:to('i64'):contiguous()
end

-- The pure routing function. logits (N, E) f32, bias (E) f32 or nil, cfg as MoE.new.
-- Returns idx (N, K) i64 (0-based expert ids), weights (N, K) f32 and the selected sigmoid
-- scores sk (N, K) f32. opts.replay_idx: use these ids instead of choosing.
function MoE.route(logits, bias, cfg, opts)
    opts = opts or {}
    local rc = cfg.routing and cfg or routing_cfg(cfg, 'MoE.route')
    if opts.group_fill ~= nil and opts.group_fill ~= rc.fill then
        local copy = {}
        for k, v in pairs(rc) do copy[k] = v end
        copy.fill, rc = opts.group_fill, copy
    end
    if not tensor.is_tensor(logits) or logits:dim() ~= 2 or logits:size(2) ~= rc.E then
        fail(('MoE.route: logits must be (N, %d), got %s'):format(rc.E,
            tensor.is_tensor(logits) and shape_str(logits) or type(logits)))
    end
    local s = ops.sigmoid(logits:to('f32'))
    local idx
    if opts.replay_idx ~= nil then
        idx = check_replay(opts.replay_idx, s:size(1), rc)
    else
        idx = choose(s, bias, rc)
    end
    local sk = ops.gather(s, 2, idx)
    return idx, weights_of(sk, rc), sk
end

-- MoE.new(store, name, cfg[, opts]): opts.group_fill overrides the value given to the experts of
-- dropped groups (default -inf; 0.0 reproduces transformers 4.5x / early v5 Glm4Moe).
-- opts.ep: a lunar.dist group of expert-parallel ranks: member r holds the routed experts
-- [r * E / ep, (r + 1) * E / ep) (lunar.model.params.expert_range) and runs them for the tokens
-- of every member (all_to_all dispatch and combine); the router is replicated. opts.tp (a
-- lunar.dist group): the shared experts split over it (lunar.nn.MLP); with opts.ep as well, each
-- tp member sends its share of the tokens to the experts.
function MoE.new(store, name, cfg, opts)
    opts = opts or {}
    local rc = routing_cfg(cfg, 'MoE ' .. name)
    if opts.group_fill ~= nil then rc.fill = opts.group_fill end
    local act = cfg.hidden_act or 'silu'
    MLP.check_act(act, 'MoE ' .. name)
    local self = setmetatable({
        store = store, name = name, rc = rc, act = act,
        router_name = name .. '.gate.weight',
        bias_name = name .. '.gate.e_score_correction_bias',
        gate_names = {}, up_names = {}, down_names = {},
        gate_mods = {}, up_mods = {}, down_mods = {},     -- module names (LoRA adapters)
        first = 0, count = rc.E,                           -- the experts held here: [first, first + count)
    }, MoE)
    local etp = opts.etp and opts.etp:size() > 1 and opts.etp or nil
    if opts.ep and (opts.ep:size() > 1 or etp) then
        local ep = opts.ep:size()
        if rc.E % ep ~= 0 then
            fail(('MoE %s: n_routed_experts %d is not divisible by the expert-parallel size ep = %d'):format(name, rc.E, ep))
        end
        self.ep, self.count = opts.ep, rc.E / ep
        self.first = opts.ep:rank() * self.count
    elseif etp then
        fail(('MoE %s: expert tensor parallel (etp = %d) needs the ep group (of size 1 when ep = 1)'):format(name, etp:size()))
    end
    self.etp = etp
    for e = self.first, self.first + self.count - 1 do
        local p = name .. '.experts.' .. e
        self.gate_mods[e], self.up_mods[e], self.down_mods[e] = p .. '.gate_proj', p .. '.up_proj', p .. '.down_proj'
        self.gate_names[e] = p .. '.gate_proj.weight'
        self.up_names[e] = p .. '.up_proj.weight'
        self.down_names[e] = p .. '.down_proj.weight'
    end
    local ns = cfg.n_shared_experts
    if ns == nil then ns = 1 end
    if self.ep and opts.tp and opts.tp:size() > 1 then self.tp_rows = opts.tp end
    -- sequence parallel (opts.sp with opts.tp): the output and the input gradient are left as
    -- partial sums (the routed rows of this rank's share added in) for the caller to reduce-scatter
    if opts.sp and opts.tp and opts.tp:size() > 1 then self.sp = opts.tp end
    -- under tp x ep (or sequence parallel) the shared experts' partial sums are reduced together
    -- with the routed rows
    if ns > 0 then
        self.shared = MLP.new(store, name .. '.shared_experts', act, {tp = opts.tp,
            defer_reduce = self.tp_rows ~= nil or self.sp ~= nil})
    end
    return self
end

local activate = MLP.activate

-- The routed experts on rows grouped in blocks: xs (R, H), hits = {{e=, off=, n=}, ...} (each
-- block one expert's rows; an expert may have several blocks, one per sending rank under ep).
-- Returns Y (R, H), the unscaled outputs, and what backward needs.
local function experts_forward(self, xs, hits, ri, opts)
    local store = self.store
    local R = xs:size(1)
    local dt, dev = xs:dtype(), xs:device()
    local Im = store:get(self.gate_names[self.first]):size(1)
    if R == 0 then return core.empty({0, xs:size(2)}, dt, dev), {Im = Im, empty = true} end
    local G = core.empty({R, Im}, dt, dev)
    local U = core.empty({R, Im}, dt, dev)
    local ls = store.lora and {gate = {}, up = {}, down = {}} or nil    -- LoRA saved state per block
    -- the experts' products side by side (gemm_grouped), gate and up together
    local as, bs, cs = {}, {}, {}
    for _, h in ipairs(hits) do
        local xe = xs:narrow(1, h.off, h.n)
        as[#as + 1], bs[#bs + 1], cs[#cs + 1] = xe, store:get(self.gate_names[h.e]), G:narrow(1, h.off, h.n)
        as[#as + 1], bs[#bs + 1], cs[#cs + 1] = xe, store:get(self.up_names[h.e]), U:narrow(1, h.off, h.n)
    end
    if #as > 0 then ops.gemm_grouped(as, bs, {trans_b = true, out = cs, row_invariant = ri}) end
    if ls then   -- the adapters add their low-rank path into the base products
        for k, h in ipairs(hits) do
            local xe = xs:narrow(1, h.off, h.n)
            local ag, au = store:adapter(self.gate_mods[h.e]), store:adapter(self.up_mods[h.e])
            if ag then ls.gate[k] = lora.forward(ag, xe, G:narrow(1, h.off, h.n), ri and opts) end
            if au then ls.up[k] = lora.forward(au, xe, U:narrow(1, h.off, h.n), ri and opts) end
        end
    end
    local A = activate(self.act, G, U)
    local Y = core.empty({R, xs:size(2)}, dt, dev)
    as, bs, cs = {}, {}, {}
    for _, h in ipairs(hits) do
        as[#as + 1], bs[#bs + 1], cs[#cs + 1] = A:narrow(1, h.off, h.n), store:get(self.down_names[h.e]),
            Y:narrow(1, h.off, h.n)
    end
    if #as > 0 then ops.gemm_grouped(as, bs, {trans_b = true, out = cs, row_invariant = ri}) end
    if ls then
        for k, h in ipairs(hits) do
            local ad = store:adapter(self.down_mods[h.e])
            if ad then ls.down[k] = lora.forward(ad, A:narrow(1, h.off, h.n), Y:narrow(1, h.off, h.n), ri and opts) end
        end
    end
    A:free()
    return Y, {G = G, U = U, Im = Im, lora = ls}
end

-- The experts' backward on the same blocks: dys (R, H) the unscaled output gradients, ws (R, 1)
-- the routing weights, se what experts_forward saved. Accumulates (+=) the experts' weight
-- gradients; returns a (R) f32, d loss / d routing weight of each row, and dXs (R, H) (nil
-- unless want_dx).
local function experts_backward(self, xs, dys, ws, hits, se, want_dx)
    local store = self.store
    local R, H = xs:size(1), xs:size(2)
    local dt, dev, Im = xs:dtype(), xs:device(), se.Im
    local a = core.empty({R}, 'f32', dev)
    if R == 0 then return a, want_dx and core.empty({0, H}, dt, dev) or nil end
    local A = activate(self.act, se.G, se.U)                          -- (R, Im)
    local dA = core.empty({R, Im}, dt, dev)
    local as, bs, cs = {}, {}, {}
    for _, h in ipairs(hits) do
        as[#as + 1], bs[#bs + 1], cs[#cs + 1] = dys:narrow(1, h.off, h.n), store:get(self.down_names[h.e]),
            dA:narrow(1, h.off, h.n)
    end
    if #as > 0 then ops.gemm_grouped(as, bs, {out = cs}) end
    local ls = se.lora
    if ls then   -- the adapter's share of d act (unscaled like dA): dA += mask * (s dy B) A
        for k, h in ipairs(hits) do
            local sv = ls.down[k]
            if sv then
                lora.backward(store:adapter(self.down_mods[h.e]), dys:narrow(1, h.off, h.n), sv,
                    A:narrow(1, h.off, h.n), dA:narrow(1, h.off, h.n), 'input')
            end
        end
    end
    -- a = <dy, y_unscaled> = <dy W_down, act> (+ the adapter's part, through dA)
    local prod = ops.mul(dA, A, {out = core.empty({R, Im}, 'f32', dev)})
    ops.sum(prod, 2, {out = a})
    prod:free()
    -- the down adapters' parameters see the routing-weighted dy, and the unscaled act
    if ls then
        for k, h in ipairs(hits) do
            local sv = ls.down[k]
            if sv then
                local dyw = ops.mul(dys:narrow(1, h.off, h.n), ws:narrow(1, h.off, h.n))
                lora.backward(store:adapter(self.down_mods[h.e]), dyw, sv, A:narrow(1, h.off, h.n), nil, 'params')
                dyw:free()
            end
        end
    end
    ops.mul(dA, ws, {out = dA})
    ops.mul(A, ws, {out = A})
    -- weight gradients (+=): one grouped call per sending rank, so that no call has two blocks
    -- writing the same gradient
    local passes = {}
    for _, h in ipairs(hits) do
        local s = (h.src or 0) + 1
        passes[s] = passes[s] or {}
        table.insert(passes[s], h)
    end
    local function each_pass(fn)
        for s = 1, table.maxn(passes) do if passes[s] then fn(passes[s]) end end
    end
    each_pass(function(list)
        local wa, wb, wc = {}, {}, {}
        for _, h in ipairs(list) do
            local gd = store:grad(self.down_names[h.e])
            if gd then wa[#wa + 1], wb[#wb + 1], wc[#wc + 1] = dys:narrow(1, h.off, h.n), A:narrow(1, h.off, h.n), gd end
        end
        if #wa > 0 then ops.gemm_grouped(wa, wb, {trans_a = true, out = wc, beta = 1}) end
    end)
    A:free()
    local dG, dU = MLP.activate_backward(self.act, dA, se.G, se.U)
    dA:free()
    local dXs = want_dx and core.empty({R, H}, dt, dev) or nil
    each_pass(function(list)
        local wa, wb, wc = {}, {}, {}
        for _, h in ipairs(list) do
            local e, o, n = h.e, h.off, h.n
            local gg, gu = store:grad(self.gate_names[e]), store:grad(self.up_names[e])
            if gg then wa[#wa + 1], wb[#wb + 1], wc[#wc + 1] = dG:narrow(1, o, n), xs:narrow(1, o, n), gg end
            if gu then wa[#wa + 1], wb[#wb + 1], wc[#wc + 1] = dU:narrow(1, o, n), xs:narrow(1, o, n), gu end
        end
        if #wa > 0 then ops.gemm_grouped(wa, wb, {trans_a = true, out = wc, beta = 1}) end
    end)
    if dXs and #hits > 0 then   -- dX = dG Wg, then += dU Wu
        local ga, gb, gc, ua, ub, uc = {}, {}, {}, {}, {}, {}
        for _, h in ipairs(hits) do
            local e, o, n = h.e, h.off, h.n
            local dxe = dXs:narrow(1, o, n)
            ga[#ga + 1], gb[#gb + 1], gc[#gc + 1] = dG:narrow(1, o, n), store:get(self.gate_names[e]), dxe
            ua[#ua + 1], ub[#ub + 1], uc[#uc + 1] = dU:narrow(1, o, n), store:get(self.up_names[e]), dxe
        end
        ops.gemm_grouped(ga, gb, {out = gc})
        ops.gemm_grouped(ua, ub, {out = uc, beta = 1})
    end
    if ls then   -- the adapters: their parameter gradients, and their share of dX (after the base dX)
        for k, h in ipairs(hits) do
            local e, o, n = h.e, h.off, h.n
            local xe, dxe = xs:narrow(1, o, n), dXs and dXs:narrow(1, o, n) or nil
            if ls.gate[k] then lora.backward(store:adapter(self.gate_mods[e]), dG:narrow(1, o, n), ls.gate[k], xe, dxe) end
            if ls.up[k] then lora.backward(store:adapter(self.up_mods[e]), dU:narrow(1, o, n), ls.up[k], xe, dxe) end
        end
    end
    dG:free()
    dU:free()
    return a, dXs
end

-- Expert parallel: the sorted (token, slot) rows of this rank go to the members holding their
-- experts. counts (E): this rank's rows per expert. Returns the row splits to send and receive
-- (one per member) and the blocks of the received rows (by sending member, then expert).
local function ep_plan(self, counts)
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
    return send, recv, hits, got
end

-- Expert tensor parallel: the etp members hold the same experts, each a block of their matrices
-- (gate/up rows, down columns). Every member runs the rows all of them received, and the partial
-- outputs are summed back to the member that received each row. got: this member's received
-- rows per (sender, local expert). Returns the blocks of the rows of every member (by member,
-- sender, expert) and {rows = each member's row count, mine = this member's}.
local function etp_plan(self, got)
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
local function etp_gather(self, t, plan)
    local n, mine = self.etp:size(), plan.mine
    local C = t:size(2)
    local rep = core.empty({n * mine, C}, t:dtype(), t:device())
    if mine > 0 then for m = 0, n - 1 do rep:narrow(1, m * mine + 1, mine):copy_(t) end end
    local sends = {}
    for m = 1, n do sends[m] = mine end
    local all = dist.all_to_all(rep, sends, plan.rows, {group = self.etp})
    rep:free()
    return all
end

-- the partial sums over the stacked rows (sum R_m, C) back to their members, added in member
-- order: (R_me, C)
local function etp_reduce(self, t, plan)
    local n, mine = self.etp:size(), plan.mine
    local C = t:size(2)
    local recvs = {}
    for m = 1, n do recvs[m] = mine end
    local parts = dist.all_to_all(t:contiguous(), plan.rows, recvs, {group = self.etp})   -- (n * mine, C)
    local out = core.empty({mine, C}, t:dtype(), t:device())
    if mine == 0 then parts:free(); return out end
    out:copy_(parts:narrow(1, 1, mine))
    for m = 1, n - 1 do ops.add_(out, parts:narrow(1, m * mine + 1, mine)) end
    parts:free()
    return out
end

-- The routed experts and the router on x (N, H): out (N, H) (without the shared experts), saved,
-- {idx =, weights =}.
local function routed_forward(self, x, opts)
    local rc, store = self.rc, self.store
    local N, H = x:size(1), x:size(2)
    local K, E = rc.K, rc.E
    local W = store:get(self.router_name)
    if W:dim() ~= 2 or W:size(1) ~= E or W:size(2) ~= H then
        fail(('MoE %s: router weight %s has shape %s, expected (%d, %d)'):format(self.name, self.router_name,
            shape_str(W), E, H))
    end
    local dt, dev = x:dtype(), x:device()
    local ri = opts.row_invariant or nil

    -- router, in f32
    local x32 = x:to('f32')
    local logits = ops.gemm(x32, W:to('f32'), {trans_b = true, row_invariant = ri})     -- (N, E)
    local bias = store:has(self.bias_name) and store:get(self.bias_name) or nil
    local idx, w, sk = MoE.route(logits, bias, rc, {replay_idx = opts.replay_idx})
    logits:free()

    -- sort the (token, slot) pairs by expert
    local NK = N * K
    if NK >= 16777216 then fail(('MoE %s: %d (token, expert) pairs exceed 2^24'):format(self.name, NK)) end
    local flat = idx:view(NK)
    local order = ops.argsort(flat)                                   -- (NK) stable
    local tokrep = core.empty({N}, 'f32', dev):arange_(0, 1):view(N, 1):expand(N, K):contiguous():view(NK)
    local tok = ops.index_select(tokrep, 1, order):to('i64')          -- (NK) token of each sorted pair
    local wsorted = ops.index_select(w:view(NK), 1, order):view(NK, 1)
    -- inv (NK): the sorted row of each pair (the inverse of order); rows (N, K): each token's rows
    -- in ascending order, the order the combine sums them in (ascending expert id, as HF's loop;
    -- a replayed duplicate expert in slot order)
    local pos = core.empty({NK}, 'f32', dev):arange_(0, 1)
    local inv32 = ops.scatter_(core.empty({NK}, 'f32', dev), 1, order, pos)
    local rows32, slots = ops.topk(inv32:view(N, K), K, {largest = false})
    local inv, rows = inv32:to('i64'), rows32:to('i64')
    pos:free(); inv32:free(); rows32:free(); slots:free(); order:free()
    -- tokens per expert, read back to the host: the one deliberate sync of the layer (the
    -- per-expert row blocks of the grouped gemms are sized on the host); backward reuses them
    local counts = ops.bincount(flat, E):tolist_flat()
    tokrep:free()
    if self.load then   -- the expert load since the last reset (lunar.model's moe_load)
        for e = 1, E do self.load[e] = self.load[e] + counts[e] end
    end

    local out = core.empty({N, H}, dt, dev)
    local saved = {x = x, x32 = x32, idx = idx, sk = sk, inv = inv, rows = rows, tok = tok, wsorted = wsorted}
    if self.ep then
        -- expert parallel: every member takes part, with or without rows
        local send, recv, hits, got = ep_plan(self, counts)
        local xs = ops.index_select(x, 1, tok)                        -- (NK, H)
        local xr = dist.all_to_all(xs, send, recv, {group = self.ep}) -- (R, H) by sender, then expert
        xs:free()
        local wr = dist.all_to_all(wsorted, send, recv, {group = self.ep})
        local et
        if self.etp then   -- every etp member's rows, through this member's blocks of the experts
            if store.lora then
                fail(('MoE %s: LoRA adapters on experts split by expert tensor parallel (etp = %d) are not implemented')
                    :format(self.name, self.etp:size()))
            end
            hits, et = etp_plan(self, got)
            local xg, wg = etp_gather(self, xr, et), etp_gather(self, wr, et)
            xr:free(); wr:free()
            xr, wr = xg, wg
        end
        local Yr, se = experts_forward(self, xr, hits, ri, opts)
        if et then
            local Ym = etp_reduce(self, Yr, et)
            Yr:free()
            Yr = Ym
        end
        local Y = dist.all_to_all(Yr, recv, send, {group = self.ep})  -- (NK, H) back in sorted order
        Yr:free()
        ops.mul(Y, wsorted, {out = Y})
        ops.index_select_sum(Y, rows, {out = out})
        Y:free()
        saved.ep = {send = send, recv = recv, hits = hits, xr = xr, wr = wr, se = se, et = et}
    elseif NK > 0 then
        local hits, off = {}, 0
        for e = 0, E - 1 do
            local c = counts[e + 1]
            if c > 0 then hits[#hits + 1] = {e = e, off = off + 1, n = c} end
            off = off + c
        end
        local xs = ops.index_select(x, 1, tok)                        -- (NK, H)
        local Y, se = experts_forward(self, xs, hits, ri, opts)
        xs:free()
        ops.mul(Y, wsorted, {out = Y})
        ops.index_select_sum(Y, rows, {out = out})
        Y:free()
        saved.hits, saved.se = hits, se
    else
        out:fill_(0)
    end
    return out, saved, {idx = idx, weights = w}
end

-- The routed part's backward: dy (N, H) the output gradient of routed_forward's rows; adds (+=)
-- d loss / d x into dx (N, H) (nil: no input gradient) and accumulates the router's and the
-- experts' weight gradients.
local function routed_backward(self, dy, saved, dx)
    local rc, store = self.rc, self.store
    local want_dx = dx ~= nil
    local x = saved.x
    local N, H = x:size(1), x:size(2)
    local K, E = rc.K, rc.E
    local NK = N * K
    local dt, dev = x:dtype(), x:device()

    -- routed experts; a (NK) = d loss / d routing weight of each sorted pair
    local a, dXs
    if saved.ep then
        local p = saved.ep
        local dys = ops.index_select(dy, 1, saved.tok)                -- (NK, H), unscaled
        local dyr = dist.all_to_all(dys, p.send, p.recv, {group = self.ep})
        dys:free()
        if p.et then
            local dg = etp_gather(self, dyr, p.et)
            dyr:free()
            dyr = dg
        end
        local ar, dXr = experts_backward(self, p.xr, dyr, p.wr, p.hits, p.se, want_dx)
        dyr:free()
        if p.et then   -- both are sums over the intermediate width: each member's is partial
            local am = etp_reduce(self, ar:view(ar:numel(), 1), p.et)
            ar:free()
            ar = am
            if dXr then
                local dm = etp_reduce(self, dXr, p.et)
                dXr:free()
                dXr = dm
            end
        end
        a = dist.all_to_all(ar:view(ar:numel(), 1), p.recv, p.send, {group = self.ep}):view(NK)
        if dXr then
            dXs = dist.all_to_all(dXr, p.recv, p.send, {group = self.ep})
            dXr:free()
        end
    elseif NK > 0 then
        local xs = ops.index_select(x, 1, saved.tok)                  -- (NK, H)
        local dys = ops.index_select(dy, 1, saved.tok)                -- (NK, H), unscaled
        a, dXs = experts_backward(self, xs, dys, saved.wsorted, saved.hits, saved.se, want_dx)
        dys:free()
        xs:free()
    else
        a = core.empty({NK}, 'f32', dev)
    end
    if dXs then
        ops.index_select_sum(dXs, saved.rows, {out = dx, accumulate = true})
        dXs:free()
    end
    -- experts without tokens: zero gradients exist all the same
    for e = self.first, self.first + self.count - 1 do
        store:grad(self.gate_names[e]); store:grad(self.up_names[e]); store:grad(self.down_names[e])
    end
    if store.lora then   -- and so do their adapters (PEFT's fused expert adapters always get one)
        for e = self.first, self.first + self.count - 1 do
            for _, m in ipairs({self.gate_mods[e], self.up_mods[e], self.down_mods[e]}) do
                local ad = store:adapter(m)
                if ad then ad.set.params:grad(ad.a_name); ad.set.params:grad(ad.b_name) end
            end
        end
    end

    -- router: back to the (token, slot) layout, through the normalisation and the sigmoid
    local aK = ops.index_select(a, 1, saved.inv):view(N, K)
    local sk = saved.sk
    local ds
    if rc.norm then
        local Z = ops.add(ops.sum(sk, 2, {keepdim = true}), 1e-20)                      -- (N, 1)
        local mean = ops.div(ops.sum(ops.mul(aK, sk), 2, {keepdim = true}), Z)           -- (N, 1)
        ds = ops.mul(ops.sub(aK, mean), ops.div(rc.scale, Z))
    else
        ds = ops.mul(aK, rc.scale)
    end
    local dl = ops.mul(ops.mul(ds, sk), ops.sub(1, sk))                               -- (N, K)
    local dL = core.empty({N, E}, 'f32', dev):fill_(0)
    ops.scatter_(dL, 2, saved.idx, dl)
    local gW = store:grad(self.router_name)
    if gW then ops.gemm(dL, saved.x32, {trans_a = true, out = gW, beta = 1}) end
    if want_dx then
        local W32 = store:get(self.router_name):to('f32')
        if dx:dtype() == 'f32' then
            ops.gemm(dL, W32, {out = dx, beta = 1})
        else
            ops.add_(dx, ops.gemm(dL, W32))
        end
    end
    dL:free()
end

-- Tensor parallel with expert parallel: the tp members hold the same tokens, and each sends only
-- its share to the experts: rows [first, first + n) of N, balanced (the first N % tp members one
-- more). Also returns the largest share.
-- (member: another member's share instead of this one's; the count first then)
local function tp_share(self, N, member)
    local g = self.tp_rows or self.sp
    local T = g:size()
    local base, rem = math.floor(N / T), N % T
    if member then return base + (member < rem and 1 or 0) end
    local r = g:rank()
    return r * base + math.min(r, rem), base + (r < rem and 1 or 0), base + (rem > 0 and 1 or 0)
end

-- every tp member's routes, whole: idx (N, K) i64 and weights (N, K) f32 from this member's rows
-- (one all_gather of both, exact in f64, each member's rows padded to the largest share)
local function gather_routes(self, routes, N)
    local K = self.rc.K
    local _, n, most = tp_share(self, N)
    local dev = routes.weights:device()
    local pack = core.empty({most, 2 * K}, 'f64', dev):fill_(0)
    if n > 0 then
        pack:narrow(1, 1, n):narrow(2, 1, K):copy_(routes.idx)
        pack:narrow(1, 1, n):narrow(2, K + 1, K):copy_(routes.weights)
    end
    local all = dist.all_gather(pack, {group = self.tp_rows})             -- (T * most, 2K)
    local pick = {}
    for m = 0, self.tp_rows:size() - 1 do
        for i = 0, tp_share(self, N, m) - 1 do pick[#pick + 1] = m * most + i end
    end
    local whole = ops.index_select(all, 1, core.from_flat(pick, {N}, 'i64', dev))
    return {idx = whole:narrow(2, 1, K):to('i64'), weights = whole:narrow(2, K + 1, K):to('f32')}
end

-- forward(x (N, H)[, {replay_idx = (N, K), row_invariant =}]) -> y (N, H), saved,
-- {idx = (N, K) i64, weights = (N, K) f32}
function MoE:forward(x, opts)
    opts = opts or {}
    if not tensor.is_tensor(x) or x:dim() ~= 2 then
        fail(('MoE %s: x must be a 2-dim (tokens, hidden) tensor, got %s'):format(self.name,
            tensor.is_tensor(x) and shape_str(x) or type(x)))
    end
    local ri = opts.row_invariant and opts or nil
    if not self.tp_rows and not self.sp then
        local out, saved, routes = routed_forward(self, x, opts)
        if self.shared then
            local ys, ss = self.shared:forward(x, ri)
            ops.add_(out, ys)
            ys:free()
            saved.shared = ss
        end
        return out, saved, routes
    end
    -- tensor x expert parallel: this member's rows through the experts, written into the shared
    -- experts' partial sums (zeros elsewhere), and one all-reduce over tp makes the whole output.
    -- Sequence parallel without ep: every tp member routes every row (the experts are whole), and
    -- only its share's rows join the partial sums; the caller reduce-scatters them.
    local N = x:size(1)
    local first, n = tp_share(self, N)
    local out
    local ss
    if self.shared then out, ss = self.shared:forward(x, ri) else out = core.empty(x:size(), x:dtype(), x:device()):fill_(0) end
    local part = out:narrow(1, first + 1, n)
    local yr, saved, routes
    if self.tp_rows then
        yr, saved, routes = routed_forward(self, x:narrow(1, first + 1, n), {replay_idx = opts.replay_idx and
            opts.replay_idx:narrow(1, first + 1, n), row_invariant = opts.row_invariant})
        ops.add_(part, yr)
        routes = gather_routes(self, routes, N)
    else
        yr, saved, routes = routed_forward(self, x, opts)
        ops.add_(part, yr:narrow(1, first + 1, n))
    end
    yr:free()
    if not self.sp then dist.all_reduce(out, {group = self.tp_rows}) end
    saved.shared, saved.share = ss, {first = first, n = n, N = N, all_rows = not self.tp_rows}
    return out, saved, routes
end

-- backward(dy (N, H), saved[, need_dx]) -> dx (N, H) (nil when need_dx == false). Accumulates
-- (+=) into the gradients of the router weight, of every trainable expert weight held here
-- (experts that got no token get a zero gradient tensor, as HF's fused expert tensors do) and of
-- the shared experts. e_score_correction_bias gets none.
function MoE:backward(dy, saved, need_dx)
    local want_dx = need_dx ~= false
    local N = saved.share and saved.share.N or saved.x:size(1)
    local H = saved.x:size(2)
    if not tensor.is_tensor(dy) or dy:dim() ~= 2 or dy:size(1) ~= N or dy:size(2) ~= H then
        fail(('MoE %s: dy has shape %s, expected (%d, %d)'):format(self.name,
            tensor.is_tensor(dy) and shape_str(dy) or type(dy), N, H))
    end
    local dx
    if self.shared then dx = self.shared:backward(dy, saved.shared, need_dx) end
    if want_dx and not dx then dx = core.empty({N, H}, saved.x:dtype(), saved.x:device()):fill_(0) end
    if not saved.share then
        routed_backward(self, dy, saved, dx)
        return dx
    end
    -- tensor x expert parallel: this member's rows; the input gradient, like the output, is the
    -- sum over tp of the shared experts' partial and each member's rows (sequence parallel: left
    -- partial for the caller, and without ep every row's routed gradient is computed, its share's
    -- rows kept)
    local sh = saved.share
    if sh.all_rows then
        local dxr = want_dx and core.empty({N, H}, saved.x:dtype(), saved.x:device()):fill_(0) or nil
        routed_backward(self, dy, saved, dxr)
        if not want_dx then return nil end
        ops.add_(dx:narrow(1, sh.first + 1, sh.n), dxr:narrow(1, sh.first + 1, sh.n))
        dxr:free()
    else
        routed_backward(self, dy:narrow(1, sh.first + 1, sh.n), saved, dx and dx:narrow(1, sh.first + 1, sh.n))
        if not want_dx then return nil end
    end
    if not self.sp then dist.all_reduce(dx, {group = self.tp_rows}) end
    return dx
end

-- tensor x expert parallel: the router's gradient is this member's rows' share (all-reduced over
-- tp by the caller, lunar.model's tp_partial_grads)
function MoE:tp_partial()
    if not self.tp_rows then return {} end
    return {self.router_name}
end

MoE.routing_cfg = routing_cfg
return MoE
