-- lunar.nn.MoE: one mixture-of-experts layer of GLM-5 (GlmMoeDsaMoE) and GLM-4.5/4.6/4.7
-- (Glm4MoeMoE): a sigmoid top-k router, routed experts (gated MLPs) and shared experts.
-- x (N, H) -> y (N, H). Spec: glm5-architecture.md sections 7, 9.2 and 14.3; docs/model.md.
--
--   local moe = MoE.new(store, 'model.layers.3.mlp', cfg[, {group_fill = -math.huge, par = ctx}])
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
-- the shared experts alike), swiglu_limit (nil: no clamp; GLM-5.3-Flash: both clamp their gate
-- and up inputs, lunar.nn.MLP); defaults in brackets.
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
-- Split over ranks (MoE.new's opts.par, a lunar.parallel.context; lunar.parallel.moe): the
-- context's dispatcher says where the routed experts are. Under expert parallel this rank holds
-- a range of them; after the sort, the rows bound for each member are consecutive, so one
-- all_to_all (counts first) sends them, the members run their experts on the blocks they
-- received (by sender, then expert) and a reverse all_to_all brings the unscaled outputs back to
-- be scaled and combined as above; backward sends the output gradients the same way and brings
-- back the input gradients and each row's routing-weight gradient. The context's token strategy
-- says which rows this rank routes: with tensor parallel too, the tp members hold the same
-- tokens, each routes and dispatches only its share of the rows, adds the routed outputs into the
-- shared experts' partial sums, and the layer's output mapping (one all-reduce over tp) makes the
-- output whole (the input gradient likewise); the router's gradient is then the member's share
-- (MoE:tp_partial). docs/parallel.md.
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
local tensor = require 'lunar.tensor'
local context = require 'lunar.parallel.context'
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
-- opts.par (a lunar.parallel.context; not split by default): the dispatcher (under expert
-- parallel member r of the ep group holds the routed experts [r * E / ep, (r + 1) * E / ep),
-- lunar.model.params.expert_range, and runs them for the tokens of every member), the token
-- strategy (which rows this tp member routes) and the mappings around the layer and its shared
-- experts (split over tp like a dense MLP); the router is replicated.
function MoE.new(store, name, cfg, opts)
    opts = opts or {}
    local rc = routing_cfg(cfg, 'MoE ' .. name)
    if opts.group_fill ~= nil then rc.fill = opts.group_fill end
    local act = cfg.hidden_act or 'silu'
    MLP.check_act(act, 'MoE ' .. name)
    local par = opts.par or context.NONE
    local parts = par:moe(name, rc)
    local io = par:block('moe')
    local self = setmetatable({
        store = store, name = name, rc = rc, act = act, limit = cfg.swiglu_limit,
        router_name = name .. '.gate.weight',
        bias_name = name .. '.gate.e_score_correction_bias',
        gate_names = {}, up_names = {}, down_names = {},
        gate_mods = {}, up_mods = {}, down_mods = {},     -- module names (LoRA adapters)
        dispatcher = parts.dispatcher, tokens = parts.tokens, par = par, input = io.input, output = io.output,
        -- the experts held here: [first, first + count)
        first = parts.dispatcher.first, count = parts.dispatcher.count,
    }, MoE)
    for e = self.first, self.first + self.count - 1 do
        local p = name .. '.experts.' .. e
        self.gate_mods[e], self.up_mods[e], self.down_mods[e] = p .. '.gate_proj', p .. '.up_proj', p .. '.down_proj'
        self.gate_names[e] = p .. '.gate_proj.weight'
        self.up_names[e] = p .. '.up_proj.weight'
        self.down_names[e] = p .. '.down_proj.weight'
    end
    local ns = cfg.n_shared_experts
    if ns == nil then ns = 1 end
    if ns > 0 then
        local sio = par:block('shared_experts')
        self.shared = MLP.new(store, name .. '.shared_experts', act,
            {input = sio.input, output = sio.output, limit = cfg.swiglu_limit})
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
    local A = activate(self.act, G, U, self.limit)
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
    local A = activate(self.act, se.G, se.U, self.limit)                          -- (R, Im)
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
    local dG, dU = MLP.activate_backward(self.act, dA, se.G, se.U, self.limit)
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
    -- the sorted rows to the experts' ranks (under expert parallel every member takes part, with
    -- or without rows), the experts, their unscaled outputs back in sorted order
    local d = self.dispatcher
    local plan = d:plan(counts)
    local xs = ops.index_select(x, 1, tok)                            -- (NK, H)
    local xr, wr = d:dispatch(self, xs, wsorted, plan)
    local Yr, se = experts_forward(self, xr, plan.hits, ri, opts)
    local kept = d:kept_rows(xr)
    if not kept then xr:free() end
    local Y = d:combine(Yr, plan)
    ops.mul(Y, wsorted, {out = Y})
    ops.index_select_sum(Y, rows, {out = out})
    Y:free()
    saved.plan, saved.hits, saved.xr, saved.wr, saved.se = plan, plan.hits, kept, wr, se
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

    -- routed experts; a (NK) = d loss / d routing weight of each sorted pair (the rows are those
    -- the dispatcher kept, or the input's taken again)
    local d, plan = self.dispatcher, saved.plan
    local dys = ops.index_select(dy, 1, saved.tok)                    -- (NK, H), unscaled
    local dyr = d:dispatch_grad(dys, plan)
    local xr = saved.xr or ops.index_select(x, 1, saved.tok)          -- (R, H)
    local ar, dXr = experts_backward(self, xr, dyr, saved.wr, plan.hits, saved.se, want_dx)
    dyr:free()
    if not saved.xr then xr:free() end
    local a, dXs = d:combine_grad(ar, dXr, plan)
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

local function routed(self)
    return function(rows, opts) return routed_forward(self, rows, opts) end
end

-- forward(x (N, H)[, {replay_idx = (N, K), row_invariant =}]) -> y (N, H), saved,
-- {idx = (N, K) i64, weights = (N, K) f32}. The token strategy runs the router and the routed
-- experts on the rows this rank routes, and the shared experts; the output mapping reduces what
-- the tp members' partial sums leave to the layer.
function MoE:forward(x, opts)
    opts = opts or {}
    if not tensor.is_tensor(x) or x:dim() ~= 2 then
        fail(('MoE %s: x must be a 2-dim (tokens, hidden) tensor, got %s'):format(self.name,
            tensor.is_tensor(x) and shape_str(x) or type(x)))
    end
    x = self.input:forward(x)
    local ri = opts.row_invariant and opts or nil
    local shared = self.shared and function() return self.shared:forward(x, ri) end or nil
    local y, saved, routes = self.tokens:forward(routed(self), shared, x, opts)
    return self.output:forward(y), saved, routes
end

local function routed_grad(self)
    return function(dy, saved, dx) return routed_backward(self, dy, saved, dx) end
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
    dy = self.output:backward(dy)
    local dx
    if self.shared then dx = self.shared:backward(dy, saved.shared, need_dx) end
    dx = self.tokens:backward(routed_grad(self), dy, saved, dx, want_dx,
        {shape = {N, H}, dtype = saved.x:dtype(), device = saved.x:device()})
    if not want_dx then return nil end
    return self.input:backward(dx)
end

-- tensor x expert parallel: the router's gradient is this member's rows' share (all-reduced over
-- tp by the caller, lunar.model's tp_partial_grads)
function MoE:tp_partial()
    return self.tokens:partial({self.router_name})
end

MoE.routing_cfg = routing_cfg
return MoE
