-- test_nn_moe.lua: the MoE layer (lunar.nn.MoE) of GLM-5 / Glm4Moe.
--   - routing (MoE.route) against a plain-Lua reference in f64: group-limited selection,
--     correction bias (chooses, never weighs), norm_topk_prob on/off, scaling, group fill value;
--   - forward against a naive per-token Lua reference (f64 loops over every selected expert);
--   - backward against central finite differences (f32, eps 1e-2, rtol 2e-2 / atol 2e-3 on a
--     random projection of the output) for the input, the router weight, every expert weight and
--     the shared experts, with the routing replayed so that perturbations cannot flip a choice;
--   - routing replay (R3), experts without tokens, K = 1 and K = E, bf16, errors;
--   - parity with transformers' GlmMoeDsaMoE on a committed fp32 fixture
--     (tests/fixtures/modules/moe_glm_moe_dsa.json, made by tests/ref/make_moe_refs.py).
local lunar = require 'lunar'
local nn = require 'lunar.nn'
local ops = lunar.ops
local MoE = nn.MoE
local T = require('lunar.testing').suite('nn.moe')

lunar.manual_seed(5)

---------------------------------------------------------------------------------------------
-- plain-Lua reference

local function erf(x)
    -- Maclaurin series; |x| <= 5 keeps the cancellation below 1e-9, erf(5) = 1 - 1.5e-12
    if x > 5 then return 1 elseif x < -5 then return -1 end
    local term, sum, x2, n = x, x, x * x, 0
    repeat
        n = n + 1
        term = -term * x2 / n
        local add = term / (2 * n + 1)
        sum = sum + add
    until math.abs(add) < 1e-17 * math.abs(sum) + 1e-300 and n > 3
    return 2 / math.sqrt(math.pi) * sum
end

-- hidden_act -> transformers' formula
local function act_of(name)
    if name == 'gelu' then return function(v) return 0.5 * v * (1 + erf(v / math.sqrt(2))) end end
    if name == 'gelu_pytorch_tanh' or name == 'gelu_new' then
        return function(v) return 0.5 * v * (1 + math.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ^ 3))) end
    end
    if name == 'relu' then return function(v) return v > 0 and v or 0 end end
    assert(name == 'silu', name)
    return function(v) return v / (1 + math.exp(-v)) end
end

local function rows(t)
    local n, c = t:size(1), t:size(2)
    local f, out = t:contiguous():tolist_flat(), {}
    for i = 1, n do
        local r = {}
        for j = 1, c do r[j] = f[(i - 1) * c + j] end
        out[i] = r
    end
    return out
end

local function matvec(Wr, v)   -- Wr rows (out, in), v (in)
    local out = {}
    for i = 1, #Wr do
        local acc, r = 0, Wr[i]
        for j = 1, #v do acc = acc + r[j] * v[j] end
        out[i] = acc
    end
    return out
end

-- descending order of values (ties: lower index first), the first k positions (1-based)
local function top(values, k, allowed)
    local ids = {}
    for i = 1, #values do if not allowed or allowed[i] then ids[#ids + 1] = i end end
    table.sort(ids, function(a, b)
        if values[a] ~= values[b] then return values[a] > values[b] end
        return a < b
    end)
    local out = {}
    for i = 1, k do out[i] = ids[i] end
    return out
end

-- reference routing of one token: logit row l (E), bias list or nil, cfg -> ids (0-based), w
local function ref_route_row(l, bias, cfg, forced)
    local E, K = #l, cfg.num_experts_per_tok
    local G, TG = cfg.n_group or 1, cfg.topk_group or 1
    local s, c = {}, {}
    for e = 1, E do
        s[e] = 1 / (1 + math.exp(-l[e]))
        c[e] = s[e] + (bias and bias[e] or 0)
    end
    local ids
    if forced then
        ids = {}
        for k = 1, K do ids[k] = forced[k] + 1 end
    else
        if G > 1 then
            local per, gs = E / G, {}
            for g = 1, G do
                local grp = {}
                for j = 1, per do grp[j] = c[(g - 1) * per + j] end
                local t2 = top(grp, 2)
                gs[g] = grp[t2[1]] + grp[t2[2]]
            end
            local keep = {}
            for _, g in ipairs(top(gs, TG)) do keep[g] = true end
            local fill = cfg.group_fill or -math.huge
            for e = 1, E do
                if not keep[math.floor((e - 1) / per) + 1] then c[e] = fill end
            end
        end
        ids = top(c, K)
    end
    local w, sum = {}, 0
    for k = 1, K do w[k] = s[ids[k]]; sum = sum + w[k] end
    for k = 1, K do
        if cfg.norm_topk_prob ~= false then w[k] = w[k] / (sum + 1e-20) end
        w[k] = w[k] * (cfg.routed_scaling_factor or 1)
        ids[k] = ids[k] - 1
    end
    return ids, w
end

local function ref_route(logits, bias, cfg, forced)
    local L = rows(logits)
    local b = bias and bias:tolist_flat() or nil
    local F = forced and rows(forced) or nil
    local ids, ws = {}, {}
    for n = 1, #L do ids[n], ws[n] = ref_route_row(L[n], b, cfg, F and F[n]) end
    return ids, ws
end

local function flat2(t2)
    local out = {}
    for _, r in ipairs(t2) do for _, v in ipairs(r) do out[#out + 1] = v end end
    return out
end

-- reference MoE forward: x (N, H) -> y rows, ids, ws
local function ref_moe(store, name, cfg, x, forced)
    local act = act_of(cfg.hidden_act)
    local X = rows(x)
    local Wr = rows(store:get(name .. '.gate.weight'))
    local logits = {}
    for n = 1, #X do logits[n] = matvec(Wr, X[n]) end
    local bname = name .. '.gate.e_score_correction_bias'
    local bias = store:has(bname) and store:get(bname):tolist_flat() or nil
    local F = forced and rows(forced) or nil
    local function mlp(prefix, v)
        local g = matvec(rows(store:get(prefix .. '.gate_proj.weight')), v)
        local u = matvec(rows(store:get(prefix .. '.up_proj.weight')), v)
        for i = 1, #g do g[i] = act(g[i]) * u[i] end
        return matvec(rows(store:get(prefix .. '.down_proj.weight')), g)
    end
    local Y, IDS, WS = {}, {}, {}
    for n = 1, #X do
        local ids, w = ref_route_row(logits[n], bias, cfg, F and F[n])
        local y = {}
        for h = 1, #X[n] do y[h] = 0 end
        for k = 1, #ids do
            local ye = mlp(name .. '.experts.' .. ids[k], X[n])
            for h = 1, #y do y[h] = y[h] + w[k] * ye[h] end
        end
        if (cfg.n_shared_experts or 1) > 0 then
            local ys = mlp(name .. '.shared_experts', X[n])
            for h = 1, #y do y[h] = y[h] + ys[h] end
        end
        Y[n], IDS[n], WS[n] = y, ids, w
    end
    return Y, IDS, WS
end

---------------------------------------------------------------------------------------------
-- helpers

-- a store holding one MoE layer `name`; weights ~ N(0, scale^2)
local function make_store(cfg, H, Im, opts)
    opts = opts or {}
    local s = nn.params.new()
    local E = cfg.n_routed_experts
    local sc = opts.scale or 0.3
    local name = 'model.layers.1.mlp'
    s:add(name .. '.gate.weight', ops.mul(lunar.randn(E, H), opts.router_scale or 0.5))
    if opts.bias ~= false then
        s:add(name .. '.gate.e_score_correction_bias', ops.mul(lunar.randn(E), opts.bias_scale or 0.05), false)
    end
    for e = 0, E - 1 do
        local p = name .. '.experts.' .. e
        s:add(p .. '.gate_proj.weight', ops.mul(lunar.randn(Im, H), sc))
        s:add(p .. '.up_proj.weight', ops.mul(lunar.randn(Im, H), sc))
        s:add(p .. '.down_proj.weight', ops.mul(lunar.randn(H, Im), sc))
    end
    local ns = cfg.n_shared_experts or 1
    if ns > 0 then
        local p = name .. '.shared_experts'
        s:add(p .. '.gate_proj.weight', ops.mul(lunar.randn(Im * ns, H), sc))
        s:add(p .. '.up_proj.weight', ops.mul(lunar.randn(Im * ns, H), sc))
        s:add(p .. '.down_proj.weight', ops.mul(lunar.randn(H, Im * ns), sc))
    end
    return s, name
end

local function cfg_of(t)
    local c = {n_routed_experts = 6, num_experts_per_tok = 2, n_group = 1, topk_group = 1, norm_topk_prob = true,
               routed_scaling_factor = 2.5, n_shared_experts = 1, hidden_act = 'silu'}
    for k, v in pairs(t or {}) do c[k] = v end
    return c
end

local function check_forward(cfg, N, H, Im, msg, opts)
    local s, name = make_store(cfg, H, Im, opts)
    local m = MoE.new(s, name, cfg)
    local x = lunar.randn(N, H)
    local y, _, routing = m:forward(x)
    local Y, IDS, WS = ref_moe(s, name, cfg, x)
    T.equal(routing.idx, flat2(IDS), msg .. ': idx')
    T.close(routing.weights, flat2(WS), {rtol = 1e-5, atol = 1e-6, msg = msg .. ': weights'})
    T.close(y, flat2(Y), {rtol = 1e-4, atol = 2e-5, msg = msg .. ': y'})
    return s, name, m, x
end

local function projection_loss(y, r) return ops.sum(ops.mul(y, r)):item() end

-- gradcheck of dx and every trainable parameter, with the routing replayed (fixed)
local function check_backward(s, name, m, x, label)
    local y0, _, routing = m:forward(x)
    local replay = routing.idx
    local r = lunar.randn(y0:size())
    s:zero_grad()
    local y, saved = m:forward(x, {replay_idx = replay})
    T.equal(y, y0, label .. ': replaying the recorded ids reproduces y')
    local dx = m:backward(r, saved)
    local inputs, grads = {x}, {dx}
    for pname in s:names() do
        if s:is_trainable(pname) then
            inputs[#inputs + 1] = s:get(pname)
            grads[#grads + 1] = s:grad(pname):clone()
        end
    end
    T.gradcheck{name = label, eps = 1e-2, rtol = 2e-2, atol = 2e-3, max_checks = 24,
        f = function() return projection_loss((m:forward(x, {replay_idx = replay})), r) end,
        inputs = inputs, grads = grads}
    -- without replay the backward is the same (the choice did not change)
    local g_replay = {}
    for pname in s:names() do if s:is_trainable(pname) then g_replay[pname] = s:grad(pname):clone() end end
    s:zero_grad()
    local _, saved2 = m:forward(x)
    T.equal(m:backward(r, saved2), dx, label .. ': dx without replay')
    for pname, g in pairs(g_replay) do T.equal(s:grad(pname), g, label .. ': grad without replay ' .. pname) end
    assert(s.grads[name .. '.gate.e_score_correction_bias'] == nil, 'bias has no gradient')
    return r, dx
end

---------------------------------------------------------------------------------------------
-- routing

T:test('route matches the reference: groups, bias, norm on/off, scaling, fill value', function()
    local cases = {
        {n_routed_experts = 8, num_experts_per_tok = 2},
        {n_routed_experts = 8, num_experts_per_tok = 2, n_group = 2, topk_group = 1},
        {n_routed_experts = 8, num_experts_per_tok = 3, n_group = 4, topk_group = 2, norm_topk_prob = false},
        {n_routed_experts = 12, num_experts_per_tok = 4, n_group = 3, topk_group = 2, routed_scaling_factor = 2.5},
        {n_routed_experts = 8, num_experts_per_tok = 2, n_group = 2, topk_group = 1, group_fill = 0.0},
        {n_routed_experts = 5, num_experts_per_tok = 1, routed_scaling_factor = 1.7, norm_topk_prob = false},
        {n_routed_experts = 4, num_experts_per_tok = 4, routed_scaling_factor = 2.5},
    }
    for ci, cfg in ipairs(cases) do
        for _, N in ipairs({1, 3, 17, 1000}) do
            local E = cfg.n_routed_experts
            local logits = ops.mul(lunar.randn(N, E), 2)
            local bias = ci % 2 == 0 and ops.mul(lunar.randn(E), 0.1) or nil
            local idx, w = MoE.route(logits, bias, cfg)
            local ids, ws = ref_route(logits, bias, cfg)
            local msg = ('case %d N %d'):format(ci, N)
            T.equal(idx, flat2(ids), msg .. ' idx')
            T.close(w, flat2(ws), {rtol = 2e-6, atol = 1e-7, msg = msg .. ' weights'})
            assert(idx:dtype() == 'i64')
            assert(w:dtype() == 'f32')
        end
    end
end)

T:test('the correction bias changes the choice but not the weights', function()
    -- s = sigmoid(l): expert 0 scores highest, but the bias makes experts 2 and 3 win
    local logits = lunar.tensor({{2.0, 1.0, 0.5, 0.0}})
    local bias = lunar.tensor({0.0, 0.0, 0.3, 0.5})
    local s = {}
    for e, v in ipairs({2.0, 1.0, 0.5, 0.0}) do s[e] = 1 / (1 + math.exp(-v)) end
    local cfg = {n_routed_experts = 4, num_experts_per_tok = 2, norm_topk_prob = false, routed_scaling_factor = 2}
    local idx, w = MoE.route(logits, nil, cfg)
    T.equal(idx, {0, 1}, 'without bias')
    idx, w = MoE.route(logits, bias, cfg)
    T.equal(idx, {3, 2}, 'with bias (c = 0.5 + 0.5 > 0.62 + 0.3)')
    T.close(w, {2 * s[4], 2 * s[3]}, {rtol = 1e-6, msg = 'weights are the unbiased sigmoid'})
    cfg.norm_topk_prob = true
    idx, w = MoE.route(logits, bias, cfg)
    T.close(w, {2 * s[4] / (s[4] + s[3]), 2 * s[3] / (s[4] + s[3])}, {rtol = 1e-6, msg = 'normalised'})
    -- group-limited: groups {0,1} and {2,3}; the bias lifts group 1 above group 0
    cfg = {n_routed_experts = 4, num_experts_per_tok = 1, n_group = 2, topk_group = 1, norm_topk_prob = false}
    idx = MoE.route(logits, nil, cfg)
    T.equal(idx, {0}, 'group 0 without bias')
    idx, w = MoE.route(logits, lunar.tensor({0.0, 0.0, 0.1, 0.4}), cfg)
    T.equal(idx, {3}, 'group 1 with bias (0.72 + 0.9 > 0.88 + 0.73)')
    T.close(w, {s[4]}, {rtol = 1e-6})
    -- the fill value of dropped groups: 0.0 (old HF) vs -inf; with a negative bias a dropped
    -- expert filled with 0.0 can win, with -inf it cannot
    cfg = {n_routed_experts = 4, num_experts_per_tok = 2, n_group = 2, topk_group = 1, norm_topk_prob = false}
    local nb = lunar.tensor({-0.4, -0.9, -0.95, -0.99})
    T.equal(MoE.route(logits, nb, cfg), {0, 1}, 'fill -inf')
    T.equal(MoE.route(logits, nb, cfg, {group_fill = 0.0}), {0, 2}, 'fill 0.0')
end)

---------------------------------------------------------------------------------------------
-- forward

T:test('forward matches a per-token reference (every hidden_act, groups, sizes 1, 3, 17)', function()
    for _, act in ipairs({'silu', 'gelu', 'gelu_pytorch_tanh', 'gelu_new', 'relu'}) do
        for _, N in ipairs({1, 3, 17}) do
            check_forward(cfg_of{hidden_act = act}, N, 7, 5, act .. ' N ' .. N)
        end
    end
    check_forward(cfg_of{n_routed_experts = 8, num_experts_per_tok = 3, n_group = 4, topk_group = 2}, 17, 6, 4,
        'groups 4/2')
    check_forward(cfg_of{norm_topk_prob = false, routed_scaling_factor = 1.0, n_shared_experts = 0}, 9, 5, 3,
        'no norm, no shared experts')
    check_forward(cfg_of{n_shared_experts = 2}, 5, 6, 3, 'shared experts twice as wide')
    check_forward(cfg_of{}, 11, 6, 4, 'no correction bias', {bias = false})
end)

T:test('K = 1 and K = E', function()
    check_forward(cfg_of{num_experts_per_tok = 1}, 13, 6, 4, 'K = 1')
    check_forward(cfg_of{n_routed_experts = 4, num_experts_per_tok = 4}, 13, 6, 4, 'K = E')
end)

T:test('experts without tokens cost nothing and get zero gradients', function()
    local cfg = cfg_of{n_routed_experts = 8, num_experts_per_tok = 1}
    local s, name, m, x = check_forward(cfg, 2, 6, 4, 'two tokens, eight experts')
    local _, saved, routing = m:forward(x)
    assert(#saved.hits <= 2, 'at most two experts hit')
    s:zero_grad()
    m:backward(lunar.randn(2, 6), saved)
    local used = {}
    for _, e in ipairs(routing.idx:tolist_flat()) do used[e] = true end
    for e = 0, 7 do
        local g = s:grad(name .. '.experts.' .. e .. '.down_proj.weight')
        local norm = ops.sum(ops.abs(g)):item()
        if used[e] then assert(norm > 0, 'hit expert ' .. e) else T.equal(norm, 0, 'idle expert ' .. e) end
    end
end)

T:test('bf16 activations and experts, f32 router', function()
    local cfg = cfg_of{}
    local s, name = make_store(cfg, 8, 6)
    local s16 = nn.params.new()
    for pname in s:names() do
        local t = s:get(pname)
        local keep32 = pname:match('%.gate%.') ~= nil
        s16:add(pname, keep32 and t or t:to('bf16'), s:is_trainable(pname))
        if not keep32 then s:get(pname):copy_(t:to('bf16')) end  -- same values in both stores
    end
    local x = lunar.randn(9, 8):to('bf16')
    local m16, m32 = MoE.new(s16, name, cfg), MoE.new(s, name, cfg)
    local y16, saved16, r16 = m16:forward(x)
    local y32, saved32, r32 = m32:forward(x:to('f32'))
    assert(y16:dtype() == 'bf16')
    T.equal(r16.idx, r32.idx, 'router runs in f32: same choice')
    T.close(r16.weights, r32.weights, {rtol = 1e-6, msg = 'same weights'})
    T.close(y16, y32, {rtol = 3e-2, atol = 3e-2, msg = 'y'})
    local dy = lunar.randn(9, 8)
    local dx16 = m16:backward(dy:to('bf16'), saved16)
    local dx32 = m32:backward(dy:to('bf16'):to('f32'), saved32)
    assert(dx16:dtype() == 'bf16')
    T.close(dx16, dx32, {rtol = 5e-2, atol = 5e-2, msg = 'dx'})
    T.close(s16:grad(name .. '.gate.weight'), s:grad(name .. '.gate.weight'), {rtol = 5e-2, atol = 5e-2,
        msg = 'router grad'})
end)

---------------------------------------------------------------------------------------------
-- backward

T:test('backward: finite differences for x, router, every expert and the shared experts', function()
    local cases = {
        {cfg_of{}, 5, 'silu norm'},
        {cfg_of{hidden_act = 'gelu', norm_topk_prob = false}, 5, 'gelu no norm'},
        {cfg_of{hidden_act = 'gelu_pytorch_tanh'}, 5, 'gelu_pytorch_tanh'},
        {cfg_of{hidden_act = 'gelu_new'}, 5, 'gelu_new'},
        {cfg_of{hidden_act = 'relu'}, 5, 'relu'},
        {cfg_of{n_routed_experts = 8, num_experts_per_tok = 2, n_group = 2, topk_group = 1}, 6, 'groups 2/1'},
        {cfg_of{num_experts_per_tok = 1, norm_topk_prob = false}, 4, 'K = 1'},
        {cfg_of{n_routed_experts = 3, num_experts_per_tok = 3}, 3, 'K = E'},
    }
    for _, c in ipairs(cases) do
        local cfg, N, label = c[1], c[2], c[3]
        local s, name = make_store(cfg, 5, 3)
        local m = MoE.new(s, name, cfg)
        local x = lunar.randn(N, 5)
        if cfg.hidden_act == 'relu' then
            -- the steps (1e-2 on x or a weight, |x| < 3, weights 0.3 randn: a gate moves by < 0.03)
            -- must not carry a gate pre-activation of a routed or shared expert across relu's kink:
            -- draw x until every one is at least 0.03 from 0
            local function margin(xx)
                local _, saved = m:forward(xx)
                return math.min(ops.min(ops.abs(saved.se.G)):item(), ops.min(ops.abs(saved.shared.g)):item())
            end
            for _ = 1, 100 do
                if margin(x) > 0.03 then break end
                x = lunar.randn(N, 5)
            end
            assert(margin(x) > 0.03, 'relu: no input kept the gates away from 0')
        end
        check_backward(s, name, m, x, label)
        local gW = s:grad(name .. '.gate.weight')
        assert(ops.sum(ops.abs(gW)):item() > 1e-2, label .. ': the router learns')
    end
end)

T:test('backward accumulates (+=) and need_dx = false skips dx', function()
    local cfg = cfg_of{}
    local s, name = make_store(cfg, 5, 3)
    local m = MoE.new(s, name, cfg)
    local x, dy = lunar.randn(7, 5), lunar.randn(7, 5)
    local _, saved = m:forward(x)
    s:zero_grad()
    m:backward(dy, saved)
    local once = {}
    for pname in s:names() do if s:is_trainable(pname) then once[pname] = s:grad(pname):clone() end end
    assert(m:backward(dy, saved, false) == nil, 'need_dx = false')
    for pname, g in pairs(once) do T.close(s:grad(pname), ops.mul(g, 2), {rtol = 1e-6, atol = 1e-7, msg = pname}) end
end)

T:test('the combine sums each token\'s experts in ascending expert order, whatever their slot order', function()
    -- without norm_topk_prob each slot's weight depends on its expert alone, so listing a token's
    -- experts in another slot order changes only the order a slot-order sum would take: the
    -- output, dx and every gradient stay bit-identical
    local cfg = cfg_of{n_routed_experts = 8, num_experts_per_tok = 4, norm_topk_prob = false}
    local s, name = make_store(cfg, 6, 3)
    local m = MoE.new(s, name, cfg)
    local x, dy = lunar.randn(13, 6), lunar.randn(13, 6)
    local _, _, routing = m:forward(x)
    local rev = {}
    for n, r in ipairs(rows(routing.idx)) do
        rev[n] = {}
        for k = 1, #r do rev[n][k] = r[#r + 1 - k] end
    end
    local function run(ids)
        local y, saved = m:forward(x, {replay_idx = ids})
        s:zero_grad()
        local dx = m:backward(dy, saved)
        local grads = {}
        for pname in s:names() do if s:is_trainable(pname) then grads[pname] = s:grad(pname):clone() end end
        return y, dx, grads
    end
    local y1, dx1, g1 = run(routing.idx)
    local y2, dx2, g2 = run(lunar.tensor(rev, 'i64'))
    T.equal(y2, y1, 'y')
    T.equal(dx2, dx1, 'dx')
    for pname, g in pairs(g1) do T.equal(g2[pname], g, pname) end
end)

---------------------------------------------------------------------------------------------
-- routing replay (R3)

T:test('R3: recorded ids reproduce the forward; other ids are used; the router still learns', function()
    local cfg = cfg_of{n_routed_experts = 6, num_experts_per_tok = 2}
    local s, name = make_store(cfg, 6, 4)
    local m = MoE.new(s, name, cfg)
    local x = lunar.randn(10, 6)
    local y, _, routing = m:forward(x)
    local y2, _, routing2 = m:forward(x, {replay_idx = routing.idx})
    T.equal(y2, y, 'replayed forward is bit-identical')
    T.equal(routing2.weights, routing.weights, 'same weights')
    -- forced ids (not what the router would choose): row n uses experts (n, n+3) mod 6
    local forced = {}
    for n = 0, 9 do forced[#forced + 1] = {n % 6, (n + 3) % 6} end
    local fidx = lunar.tensor(forced, 'i64')
    local y3, saved3, routing3 = m:forward(x, {replay_idx = fidx})
    T.equal(routing3.idx, fidx, 'the replayed ids are reported')
    local Y, _, WS = ref_moe(s, name, cfg, x, fidx)
    T.close(routing3.weights, flat2(WS), {rtol = 1e-5, atol = 1e-6, msg = 'weights from the current router'})
    T.close(y3, flat2(Y), {rtol = 1e-4, atol = 2e-5, msg = 'y with forced ids'})
    -- the router weight gets a gradient under replay, and it matches finite differences
    s:zero_grad()
    local r = lunar.randn(10, 6)
    m:backward(r, saved3)
    local W = s:get(name .. '.gate.weight')
    local gW = s:grad(name .. '.gate.weight'):clone()
    assert(ops.sum(ops.abs(gW)):item() > 1e-2, 'router gradient under replay')
    T.gradcheck{name = 'router under replay', eps = 1e-2, rtol = 2e-2, atol = 2e-3,
        f = function() return projection_loss((m:forward(x, {replay_idx = fidx})), r) end,
        inputs = {W}, grads = {gW}}
    -- the same through the pure function
    local logits = ops.matmul(x, W:t())
    local idx, w = MoE.route(logits, s:get(name .. '.gate.e_score_correction_bias'), cfg, {replay_idx = fidx})
    T.equal(idx, fidx)
    T.close(w, routing3.weights, {rtol = 1e-6})
end)

---------------------------------------------------------------------------------------------
-- errors

T:test('bad inputs and configs name the problem', function()
    local cfg = cfg_of{}
    local s, name = make_store(cfg, 5, 3)
    local m = MoE.new(s, name, cfg)
    T.raises(function() m:forward(lunar.randn(2, 3, 5)) end, 'must be a 2-dim')
    T.raises(function() m:forward(lunar.randn(4, 6)) end, 'expected (6, 6)')
    T.raises(function() m:forward(lunar.randn(4, 5), {replay_idx = lunar.zeros(4, 3, 'i64')}) end,
        'replay_idx has shape (4, 3), expected (4, 2)')
    T.raises(function() m:forward(lunar.randn(4, 5), {replay_idx = lunar.zeros(4, 2)}) end, 'integer tensor')
    T.raises(function() m:forward(lunar.randn(4, 5), {replay_idx = lunar.full({4, 2}, 6, 'i64')}) end, 'out of range')
    local _, saved = m:forward(lunar.randn(4, 5))
    T.raises(function() m:backward(lunar.randn(3, 5), saved) end, 'dy has shape (3, 5), expected (4, 5)')
    T.raises(function() MoE.new(s, name, cfg_of{n_group = 4}) end, 'n_group 4 must be a positive divisor')
    T.raises(function() MoE.new(s, name, cfg_of{num_experts_per_tok = 7}) end, 'num_experts_per_tok must be')
    T.raises(function() MoE.new(s, name, cfg_of{n_group = 3, topk_group = 1, num_experts_per_tok = 3}) end,
        'hold fewer than num_experts_per_tok')
    T.raises(function() MoE.new(s, name, cfg_of{n_group = 2, topk_group = 3}) end, 'topk_group must be')
    T.raises(function() MoE.new(s, name, cfg_of{hidden_act = 'relu2'}) end, 'not supported')
    T.raises(function() MoE.new(s, 'model.layers.9.mlp', cfg):forward(lunar.randn(2, 5)) end,
        'model.layers.9.mlp.gate.weight does not exist')
end)

---------------------------------------------------------------------------------------------
-- parity with transformers (fixture)

local function read_json(name)
    local dir = debug.getinfo(1, 'S').source:match('^@(.*)/[^/]*$') or '.'
    local f = io.open(dir .. '/../fixtures/' .. name, 'r')
    if not f then return nil end
    local s = f:read('*a')
    f:close()
    -- the fixture holds only objects with plain keys, arrays, numbers and strings
    s = s:gsub('%[', '{'):gsub('%]', '}'):gsub('"([%w_]+)"%s*:', '["%1"]=')
    return assert(loadstring('return ' .. s))()
end

T:test('parity with transformers GlmMoeDsaMoE (fp32 fixture)', function()
    local fx = assert(read_json('modules/moe_glm_moe_dsa.json'), 'fixture missing')
    for _, case in ipairs(fx.cases) do
        local s = nn.params.new()
        local function t(entry) return lunar.tensor(entry.data):view(entry.shape) end
        for _, p in ipairs(case.params) do s:add(p.name, t(p), p.trainable) end
        local m = MoE.new(s, case.prefix, case.config)
        local x = t(case.x)
        local y, saved, routing = m:forward(x)
        local label = case.label
        -- transformers' topk is unsorted: compare the sets
        T.equal(ops.sort(routing.idx:to('f32')), ops.sort(t(case.topk_idx)), label .. ': selected experts')
        T.close(y, t(case.y), {rtol = 1e-5, atol = 1e-6, msg = label .. ': y'})
        s:zero_grad()
        local dx = m:backward(t(case.dy), saved)
        T.close(dx, t(case.dx), {rtol = 1e-4, atol = 1e-6, msg = label .. ': dx'})
        for _, g in ipairs(case.grads) do
            T.close(s:grad(g.name), t(g), {rtol = 1e-4, atol = 1e-6, msg = label .. ': grad ' .. g.name})
        end
    end
end)

os.exit(T:run())
