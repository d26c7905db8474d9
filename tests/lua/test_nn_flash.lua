-- test_nn_flash.lua: GLM-5.3-Flash's new pieces against transformers 5.25.0 (fp32, CPU), from the
-- committed fixture tests/fixtures/modules/flash_hf.json (tests/ref/make_flash_module_refs.py),
-- and the properties HF cannot show (packed segments, decode steps, a cache's conv history):
--   * lunar.ops.kda against HF's chunk_kimi_delta_attention (3 chunks, an initial state, the
--     final state's gradient), and against a token-by-token loop written here;
--   * lunar.ops.conv1d_causal against a loop written here, with segments and a history;
--   * nn.KDA against Glm5NextTextLinearAttention (lower-bound gate and softplus gate, a
--     left-padded row): output, dx and every parameter gradient;
--   * nn.HyperConnection against Glm5NextTextHyperConnection (hc_mult 4 and 2) and the decoder
--     layer's write: post, comb, u, the written streams and every gradient.
-- Tolerances: outputs within 1e-5 of the largest |value|; gradients relative L2 below 1e-5, the
-- linear layer's parameter gradients below 1e-4 (HF's f32 gate gradients are 1e-5 from its f64).
local lunar = require 'lunar'
local nn = require 'lunar.nn'
local ops = lunar.ops
local T = require('lunar.testing').suite('nn.flash')

local function read_json(rel)
    local dir = debug.getinfo(1, 'S').source:match('^@(.*)/[^/]*$') or '.'
    local f = assert(io.open(dir .. '/../fixtures/' .. rel, 'r'))
    local s = f:read('*a')
    f:close()
    s = s:gsub('%[', '{'):gsub('%]', '}'):gsub('"([%w_]+)"%s*:', '["%1"]='):gsub('=null', '=nil')
    return assert(loadstring('return ' .. s))()
end

local FX = read_json('modules/flash_hf.json')

local function tensor_of(e) return lunar.tensor(e.data, 'f32'):view(e.shape) end

local function rel_l2(a, b)
    local af, bf = a:contiguous():tolist_flat(), b
    if type(b) ~= 'table' then bf = b:contiguous():tolist_flat() end
    assert(#af == #bf, ('sizes differ: %d and %d'):format(#af, #bf))
    local num, den = 0, 0
    for i = 1, #bf do num = num + (af[i] - bf[i]) ^ 2; den = den + bf[i] ^ 2 end
    return math.sqrt(num / math.max(den, 1e-30))
end

-- max |a - b| / max |b|
local function rel_max(a, b)
    local af, bf = a:contiguous():tolist_flat(), b
    if type(b) ~= 'table' then bf = b:contiguous():tolist_flat() end
    assert(#af == #bf, ('sizes differ: %d and %d'):format(#af, #bf))
    local m, s = 0, 0
    for i = 1, #bf do m = math.max(m, math.abs(af[i] - bf[i])); s = math.max(s, math.abs(bf[i])) end
    return m / math.max(s, 1e-30)
end

local function close(a, b, tol, what, metric)
    local e = (metric or rel_l2)(a, b)
    if not (e < tol) then error(('%s: error %.3g (tolerance %.0e)'):format(what, e, tol), 2) end
    return e
end

local function seg_of(list) return lunar.tensor(list, 'i64') end

local function randn(rng, shape) return rng:normal_(lunar.empty(shape), 0, 1) end

-- ---- the KDA kernel ------------------------------------------------------------------------------

T:test('ops.kda equals HF chunk_kimi_delta_attention, forward and backward', function()
    local c = FX.kda
    local B, S, H, D = c.B, c.S, c.H, c.D
    local N = B * S
    local function rows(e) return tensor_of(e):view(N, H, -1) end
    local q = ops.mul(rows(c.q), c.scale)   -- HF scales q inside; ops.kda takes it scaled
    local k, v, g = rows(c.k), rows(c.v), rows(c.g)
    local beta = tensor_of(c.beta):view(N, H)
    local seg = seg_of({0, S, 2 * S})
    local s0 = tensor_of(c.state0)
    local o, st = ops.kda(q, k, v, g, beta, seg, {state0 = s0, state = true})
    close(o:view(B, S, H, D), c.o.data, 1e-5, 'o', rel_max)
    close(st, c.state.data, 1e-5, 'final state', rel_max)
    local dq, dk, dv, dg, dbeta, ds0 = ops.kda_backward(tensor_of(c.r):view(N, H, D), q, k, v, g, beta, seg,
        {state0 = s0, dstate = tensor_of(c.rs), dstate0 = true})
    close(ops.mul(dq, c.scale), c.dq.data, 1e-5, 'dq')
    close(dk, c.dk.data, 1e-5, 'dk')
    close(dv, c.dv.data, 1e-5, 'dv')
    close(dg, c.dg.data, 1e-5, 'dg')
    close(dbeta, c.dbeta.data, 1e-5, 'dbeta')
    close(ds0, c.dstate0.data, 1e-5, 'dstate0')
end)

-- the recurrence token by token, in Lua doubles: o (N, H, Dv) and the states after each segment
local function kda_loop(q, k, v, g, beta, seg, s0)
    local N, H, Dk, Dv = q:size(1), q:size(2), q:size(3), v:size(3)
    local Q, K, V, G, Bt = q:tolist_flat(), k:tolist_flat(), v:tolist_flat(), g:tolist_flat(), beta:tolist_flat()
    local S0 = s0 and s0:tolist_flat()
    local sg = seg:tolist_flat()
    local o, states = {}, {}
    for s = 1, #sg - 1 do
        for h = 0, H - 1 do
            local St = {}
            for i = 1, Dk * Dv do St[i] = S0 and S0[((s - 1) * H + h) * Dk * Dv + i] or 0 end
            for t = sg[s], sg[s + 1] - 1 do
                local base, bv = (t * H + h) * Dk, (t * H + h) * Dv
                for d = 0, Dk - 1 do
                    local dec = math.exp(G[base + d + 1])
                    for e = 0, Dv - 1 do St[d * Dv + e + 1] = St[d * Dv + e + 1] * dec end
                end
                local b = Bt[t * H + h + 1]
                for e = 0, Dv - 1 do
                    local sk = 0
                    for d = 0, Dk - 1 do sk = sk + St[d * Dv + e + 1] * K[base + d + 1] end
                    local u = b * (V[bv + e + 1] - sk)
                    for d = 0, Dk - 1 do St[d * Dv + e + 1] = St[d * Dv + e + 1] + K[base + d + 1] * u end
                end
                for e = 0, Dv - 1 do
                    local acc = 0
                    for d = 0, Dk - 1 do acc = acc + St[d * Dv + e + 1] * Q[base + d + 1] end
                    o[bv + e + 1] = acc
                end
            end
            for i = 1, Dk * Dv do states[((s - 1) * H + h) * Dk * Dv + i] = St[i] end
        end
    end
    return o, states
end

local function random_kda(N, H, Dk, Dv, seed)
    local rng = lunar.rng(seed)
    local q = ops.rmsnorm(randn(rng, {N * H, Dk}), nil, 1e-6):view(N, H, Dk)
    local k = ops.div(ops.rmsnorm(randn(rng, {N * H, Dk}), nil, 1e-6), math.sqrt(Dk)):view(N, H, Dk)
    local v = randn(rng, {N, H, Dv})
    local g = ops.mul(ops.sigmoid(ops.sub(randn(rng, {N, H, Dk}), 2)), -5)
    local beta = ops.sigmoid(randn(rng, {N, H}))
    return q, k, v, g, beta
end

T:test('ops.kda: packed segments, uneven chunks and a start state equal the token loop', function()
    -- segments of 0, 1, 63, 64, 65 and 150 rows: empty, shorter than a chunk, exactly one, one
    -- row over, several chunks
    local lens = {0, 1, 63, 64, 65, 150}
    local seg, N = {0}, 0
    for _, n in ipairs(lens) do N = N + n; seg[#seg + 1] = N end
    local H, Dk, Dv = 2, 6, 5
    local q, k, v, g, beta = random_kda(N, H, Dk, Dv, 7)
    local s0 = ops.mul(randn(lunar.rng(8), {#lens, H, Dk, Dv}), 0.3)
    local o, st = ops.kda(q, k, v, g, beta, seg_of(seg), {state0 = s0, state = true})
    local ro, rs = kda_loop(q, k, v, g, beta, seg_of(seg), s0)
    close(o, ro, 1e-5, 'o against the loop', rel_max)
    close(st, rs, 1e-5, 'states against the loop', rel_max)
    -- the empty segment keeps its start state
    close(st:select(1, 1), s0:select(1, 1), 0.5e-7, 'empty segment state')
end)

T:test('ops.kda: decode steps from the state equal the whole sequence (outputs and state)', function()
    local N, H, D = 80, 2, 8
    local q, k, v, g, beta = random_kda(N, H, D, D, 11)
    local full, fs = ops.kda(q, k, v, g, beta, seg_of({0, N}), {state = true})
    local P = 70
    local pre, state = ops.kda(q:narrow(1, 1, P), k:narrow(1, 1, P), v:narrow(1, 1, P), g:narrow(1, 1, P),
                               beta:narrow(1, 1, P), seg_of({0, P}), {state = true})
    close(pre, full:narrow(1, 1, P), 1e-6, 'prefill rows', rel_max)
    for t = P + 1, N do
        local o
        o, state = ops.kda(q:narrow(1, t, 1), k:narrow(1, t, 1), v:narrow(1, t, 1), g:narrow(1, t, 1),
                           beta:narrow(1, t, 1), seg_of({0, 1}), {state0 = state, state = true})
        close(o, full:narrow(1, t, 1), 1e-5, 'decode row ' .. t, rel_max)
    end
    close(state, fs, 1e-5, 'state after the steps', rel_max)
end)

T:test('ops.kda_step and conv1d_step: slots of a state updated in place, as one-row segments give', function()
    -- 5 sequences in slots 4, 0, 2, 6, 1 of a state of 7 slots; 3 steps
    local S, B, H, Dk, Dv, C, K = 7, 5, 2, 6, 5, 12, 4
    local slots = lunar.tensor({4, 0, 2, 6, 1}, 'i64')
    local state = ops.mul(randn(lunar.rng(21), {S, H, Dk, Dv}), 0.3)
    local hist = randn(lunar.rng(22), {S, K - 1, C})
    local w = randn(lunar.rng(23), {C, K})
    local ref_state, ref_hist = ops.index_select(state, 1, slots), ops.index_select(hist, 1, slots)
    local untouched = ops.index_select(state, 1, lunar.tensor({3, 5}, 'i64'))
    local seg = seg_of({0, 1, 2, 3, 4, 5})
    for step = 1, 3 do
        local q, k, v, g, beta = random_kda(B, H, Dk, Dv, 30 + step)
        local x = randn(lunar.rng(40 + step), {B, C})
        local o = ops.kda_step(q, k, v, g, beta, state, slots)
        local ro, rs = ops.kda(q, k, v, g, beta, seg, {state0 = ref_state, state = true})
        close(o, ro, 1e-5, 'kda_step output, step ' .. step, rel_max)
        close(ops.index_select(state, 1, slots), rs, 1e-5, 'kda_step state, step ' .. step, rel_max)
        ref_state = rs
        -- the conv: the same bits as conv1d_causal with the history, and the shifted history
        local y = ops.conv1d_step(x, w, hist, slots)
        local ry = ops.conv1d_causal(x, w, seg, {hist = ref_hist})
        T.equal(y, ry, 'conv1d_step output, step ' .. step)
        local shifted = lunar.empty({B, K - 1, C})
        shifted:narrow(2, 1, K - 2):copy_(ref_hist:narrow(2, 2, K - 2))
        shifted:select(2, K - 1):copy_(x)
        T.equal(ops.index_select(hist, 1, slots), shifted, 'conv1d_step history, step ' .. step)
        ref_hist = shifted
    end
    T.equal(ops.index_select(state, 1, lunar.tensor({3, 5}, 'i64')), untouched, 'other slots untouched')
    -- a sequence's bits do not depend on the others of the step
    local q, k, v, g, beta = random_kda(B, H, Dk, Dv, 50)
    local s1, s2 = state:clone(), state:clone()
    local all = ops.kda_step(q, k, v, g, beta, s1, slots)
    local one = ops.kda_step(q:narrow(1, 3, 1), k:narrow(1, 3, 1), v:narrow(1, 3, 1), g:narrow(1, 3, 1),
                             beta:narrow(1, 3, 1), s2, lunar.tensor({2}, 'i64'))
    T.equal(one, all:narrow(1, 3, 1), 'one sequence alone, the same bits')
    -- bad slots: named, nothing written
    T.raises(function() ops.kda_step(q, k, v, g, beta, state, lunar.tensor({4, 0, 2, 6, 7}, 'i64')) end,
        "slots 'tensor'[4] = 7 is not a slot of the 7")
    T.raises(function() ops.kda_step(q, k, v, g, beta, state, lunar.tensor({4, 0, 2, 4, 1}, 'i64')) end,
        'names slot 4 twice')
    T.raises(function() ops.conv1d_step(randn(lunar.rng(1), {B, C}), w, lunar.empty({S, K - 2, C}), slots) end,
        'expected (slots, 3, 12)')
end)

T:test('ops.kda_backward equals finite differences of the loss on a packed batch', function()
    local seg = {0, 3, 70, 75}
    local N, H, Dk, Dv = 75, 1, 4, 3
    local q, k, v, g, beta = random_kda(N, H, Dk, Dv, 21)
    local r = randn(lunar.rng(22), {N, H, Dv})
    local sg = seg_of(seg)
    local dq, dk, dv, dg, dbeta = ops.kda_backward(r, q, k, v, g, beta, sg)
    local function loss()
        local o = ops.kda(q, k, v, g, beta, sg)
        return ops.sum(ops.mul(o:to('f64'), r:to('f64'))):item()
    end
    local inputs = {{q, dq, 'q'}, {k, dk, 'k'}, {v, dv, 'v'}, {g, dg, 'g'}, {beta, dbeta, 'beta'}}
    local rng = lunar.rng(23)
    for _, it in ipairs(inputs) do
        local x, dx, name = it[1], it[2], it[3]
        local flatx = x:view(-1)
        for _ = 1, 6 do
            local i = math.floor(rng:uniform_(lunar.empty({1}), 0, 1):item() * flatx:numel()) + 1
            local x0 = flatx:narrow(1, i, 1):item()
            local h = 1e-3
            flatx:narrow(1, i, 1):fill_(x0 + h)
            local lp = loss()
            flatx:narrow(1, i, 1):fill_(x0 - h)
            local lm = loss()
            flatx:narrow(1, i, 1):fill_(x0)
            local fd, an = (lp - lm) / (2 * h), dx:view(-1):narrow(1, i, 1):item()
            if math.abs(fd - an) > 2e-3 * math.max(1, math.abs(fd)) then
                error(('d%s[%d]: finite difference %.6g, backward %.6g'):format(name, i, fd, an))
            end
        end
    end
end)

-- ---- the short conv -----------------------------------------------------------------------------

T:test('ops.conv1d_causal: segments and a history, forward and backward, equal a loop', function()
    local seg = {0, 2, 9, 9, 20}
    local N, C, K = 20, 5, 4
    local rng = lunar.rng(31)
    local x, w, hist = randn(rng, {N, C}), randn(rng, {C, K}), randn(rng, {4, K - 1, C})
    local dy = randn(rng, {N, C})
    local X, W, Hh, DY = x:tolist_flat(), w:tolist_flat(), hist:tolist_flat(), dy:tolist_flat()
    local function input(s, first, t, c)   -- t from the segment's first row, may be < 0
        if t >= 0 then return X[(first + t) * C + c + 1] end
        return Hh[((s - 1) * (K - 1) + (K - 1) + t) * C + c + 1]
    end
    local y_ref, dx_ref, dw_ref = {}, {}, {}
    for i = 1, C * K do dw_ref[i] = 0 end
    for i = 1, N * C do dx_ref[i] = 0 end
    for s = 1, #seg - 1 do
        local first, n = seg[s], seg[s + 1] - seg[s]
        for t = 0, n - 1 do
            for c = 0, C - 1 do
                local acc = 0
                for j = 0, K - 1 do
                    local src = t - K + 1 + j
                    acc = acc + W[c * K + j + 1] * input(s, first, src, c)
                    dw_ref[c * K + j + 1] = dw_ref[c * K + j + 1] + DY[(first + t) * C + c + 1] * input(s, first, src, c)
                    if src >= 0 then
                        local i = (first + src) * C + c + 1
                        dx_ref[i] = dx_ref[i] + W[c * K + j + 1] * DY[(first + t) * C + c + 1]
                    end
                end
                y_ref[(first + t) * C + c + 1] = acc
            end
        end
    end
    local sg = seg_of(seg)
    close(ops.conv1d_causal(x, w, sg, {hist = hist}), y_ref, 1e-6, 'y', rel_max)
    local dw = lunar.zeros(C, K)
    local dx = ops.conv1d_causal_backward(dy, x, w, sg, {hist = hist, dw = dw})
    close(dx, dx_ref, 1e-6, 'dx', rel_max)
    close(dw, dw_ref, 1e-6, 'dw', rel_max)
    -- dw accumulates
    ops.conv1d_causal_backward(dy, x, w, sg, {hist = hist, dw = dw})
    close(ops.mul(dw, 0.5), dw_ref, 1e-6, 'dw accumulated twice', rel_max)
    -- without a history the rows before each segment are zeros: a segment equals itself alone
    local y = ops.conv1d_causal(x, w, sg)
    local alone = ops.conv1d_causal(x:narrow(1, 3, 7):contiguous(), w, seg_of({0, 7}))
    T.equal(y:narrow(1, 3, 7), alone, 'a segment equals itself run alone')
end)

T:test('bad inputs name the op and the tensor', function()
    local q, k, v, g, beta = random_kda(6, 1, 4, 4, 41)
    local ok, err = pcall(ops.kda, q, k, v, g, beta, seg_of({0, 3, 5}))
    assert(not ok and err:find('kda_forward', 1, true) and err:find('0 to 5', 1, true) and err:find('N = 6', 1, true), err)
    ok, err = pcall(ops.kda, q, k, v, g, beta, seg_of({0, 4, 3, 6}))
    assert(not ok and err:find('falls', 1, true), err)
    ok, err = pcall(ops.kda, q, k:narrow(3, 1, 3):contiguous(), v, g, beta, seg_of({0, 6}))
    assert(not ok and err:find("k '", 1, true) and err:find('(6, 1, 4)', 1, true), err)
    ok, err = pcall(ops.conv1d_causal, lunar.randn(6, 3), lunar.randn(4, 2), seg_of({0, 6}))
    assert(not ok and err:find('conv1d_causal_forward', 1, true) and err:find('do not fit', 1, true), err)
    ok, err = pcall(ops.hc_weights, lunar.randn(3, 10), 2, {iters = 20, eps = 1e-6})
    assert(not ok and err:find('hc_weights', 1, true) and err:find('(3, 8)', 1, true), err)
    ok, err = pcall(ops.hc_weights, lunar.randn(3, 0), 0, {iters = 20, eps = 1e-6})
    assert(not ok and err:find('n = 0 streams', 1, true), err)
end)

-- ---- the linear attention layer ----------------------------------------------------------------

-- the fixture's in-memory HF names -> lunar's (checkpoint) names and tensors: conv1d (3Q, 1, Kc)
-- splits into q_conv1d, k_conv1d, v_conv1d; the forget gate's tensors sit under self_attn
local function kda_store(c)
    local s = nn.params.new()
    local grads = {}
    local Q = c.config.linear_num_heads * c.config.linear_head_dim
    for _, p in ipairs(c.params) do
        local t, gt = tensor_of(p), p.grad and lunar.tensor(p.grad, 'f32'):view(p.shape)
        if p.name == 'self_attn.conv1d.weight' then
            for i, w in ipairs({'q', 'k', 'v'}) do
                local n = 'self_attn.' .. w .. '_conv1d.weight'
                s:add(n, t:narrow(1, (i - 1) * Q + 1, Q):contiguous())
                grads[n] = gt:narrow(1, (i - 1) * Q + 1, Q):contiguous()
            end
        else
            local n = p.name:gsub('forget_gate%.', '')
            s:add(n, t)
            grads[n] = gt
        end
    end
    return s, grads
end

local function check_linear(c, what)
    local s, grads = kda_store(c)
    local cfg = c.config
    local layer = nn.KDA.new(s, 'self_attn', cfg)
    local B, S, H = c.B, c.S, cfg.hidden_size
    local N = B * S
    local x = tensor_of(c.x):view(N, H)
    local valid = lunar.tensor(c.attention_mask, 'f32'):view(N, 1)
    local ctx = {seg = seg_of({0, S, N}), valid = valid}
    local y, saved = layer:forward(x, ctx)
    -- rows at pad positions are never read (HF's are garbage of the same kind): compare the valid
    local yv, rv = ops.mul(y, valid), ops.mul(tensor_of(c.out):view(N, H), valid)
    close(yv, rv, 1e-5, what .. ' output', rel_max)
    local dx = layer:backward(tensor_of(c.r):view(N, H), saved)
    close(dx, c.dx.data, 1e-5, what .. ' dx')
    local n = 0
    for name, g in pairs(grads) do
        -- 1e-4: HF's own f32 gradients of the gate are 1e-5 away from its f64 ones
        close(s.grads[name], g, 1e-4, what .. ' gradient of ' .. name)
        n = n + 1
    end
    assert(n == 15, what .. ': ' .. n .. ' parameters compared, expected 15')
end

T:test('nn.KDA equals Glm5NextTextLinearAttention (lower-bound gate, a left-padded row)', function()
    check_linear(FX.linear, 'lb -5')
end)

T:test('nn.KDA equals Glm5NextTextLinearAttention (the softplus gate)', function()
    local c = FX.linear_softplus
    assert(c.config.linear_lower_bound == nil)
    check_linear(c, 'softplus')
end)

T:test('nn.KDA: packed documents equal each document alone', function()
    local c = FX.linear
    local s = kda_store(c)
    local layer = nn.KDA.new(s, 'self_attn', c.config)
    local H = c.config.hidden_size
    local x = tensor_of(c.x):view(-1, H):narrow(1, 1, 70)
    local packed = layer:forward(x, {seg = seg_of({0, 30, 70})})
    local a = layer:forward(x:narrow(1, 1, 30):contiguous(), {seg = seg_of({0, 30})})
    local b = layer:forward(x:narrow(1, 31, 40):contiguous(), {seg = seg_of({0, 40})})
    close(packed:narrow(1, 1, 30), a, 1e-6, 'document 1', rel_max)
    close(packed:narrow(1, 31, 40), b, 1e-6, 'document 2', rel_max)
end)

T:test('nn.KDA: prefill then cached steps (recurrent and conv states) equal the whole sequence', function()
    local c = FX.linear
    local s = kda_store(c)
    local layer = nn.KDA.new(s, 'self_attn', c.config)
    local H = c.config.hidden_size
    local x = tensor_of(c.x):view(-1, H):narrow(1, 1, 70)
    local full = layer:forward(x, {seg = seg_of({0, 70})})
    local P = 62
    local y, sv = layer:forward(x:narrow(1, 1, P):contiguous(), {seg = seg_of({0, P}), want_state = true})
    close(y, full:narrow(1, 1, P), 1e-6, 'prefill', rel_max)
    local state, hist = sv.state, sv.hist_out
    for t = P + 1, 70 do
        y, sv = layer:forward(x:narrow(1, t, 1):contiguous(),
                              {seg = seg_of({0, 1}), state0 = state, hist = hist, want_state = true})
        close(y, full:narrow(1, t, 1), 1e-5, 'step ' .. t, rel_max)
        state, hist = sv.state, sv.hist_out
    end
end)

-- ---- mHC ------------------------------------------------------------------------------------------

local function check_hyper(c)
    local s = nn.params.new()
    local grads = {}
    for _, p in ipairs(c.params) do
        local n = p.name:gsub('^attn_hc%.', 'hc_attn_')
        s:add(n, tensor_of(p))
        grads[n] = p.grad
    end
    local cfg = {hc_mult = c.n, hidden_size = c.H, hc_sinkhorn_iters = c.iters, hc_eps = c.hc_eps,
                 rms_norm_eps = c.rms_norm_eps}
    local site = nn.HyperConnection.new(s, 'hc_attn', cfg)
    local N = c.B * c.S
    local X = tensor_of(c.X):view(N, c.n, c.H)
    local u, sv = site:read(X)
    close(sv.post, c.post.data, 1e-6, 'post', rel_max)
    close(sv.comb, c.comb.data, 1e-6, 'comb', rel_max)
    close(u, c.u.data, 1e-6, 'u', rel_max)
    local a = ops.tanh(u)
    local Y = site:write(X, a, sv)
    close(Y, c.Y.data, 1e-6, 'Y', rel_max)
    local dX, da = site:write_backward(tensor_of(c.r):view(N, c.n, c.H), a, sv)
    local du = ops.tanh_backward(da, u)
    dX = site:read_backward(du, sv, dX)
    close(dX, c.dX.data, 1e-5, 'dX')
    for n, g in pairs(grads) do close(s.grads[n], g, 1e-5, 'gradient of ' .. n) end
end

T:test('nn.HyperConnection (hc_mult 4) equals Glm5NextTextHyperConnection and the layer write', function()
    check_hyper(FX.hyper4)
end)

T:test('nn.HyperConnection (hc_mult 2) equals Glm5NextTextHyperConnection and the layer write', function()
    check_hyper(FX.hyper2)
end)

os.exit(T:run())
