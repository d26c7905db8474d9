-- test_optim.lua: lunar.optim (AdamW over a parameter store, LR schedules).
--
-- The torch oracle: tests/fixtures/optim/adamw_fixture.json (tests/fixtures/optim/
-- make_adamw_fixture.py): torch.optim.AdamW with three parameter groups, LambdaLR warmup+cosine
-- to a min_lr ratio, clip_grad_norm_, two micro-batches per step and two skipped calls (NaN
-- loss, inf gradient); the parameters after every update must match to rtol 1e-6 (atol 1e-7
-- for entries near 0), the moments after the last one likewise.
-- The rest against plain-Lua expectations: schedule values, no-decay rules and groups,
-- accumulation equal to one pre-averaged batch, bf16 parameters with f32 masters equal to an f32
-- run, skipped steps, state_dict round trips (bit-identical continuation) and error messages.
local lunar = require 'lunar'
local ops = lunar.ops
local nn = require 'lunar.nn'
local optim = require 'lunar.optim'
local T = require('lunar.testing').suite('optim')

local here = debug.getinfo(1, 'S').source:match('^@(.*)/[^/]*$') or '.'
local fixture = here .. '/../fixtures/optim/adamw_fixture.json'

local function from_list(list, shape)
    return lunar.tensor(list):view(shape)
end

local function copy_store(store)
    local s = nn.params.new()
    for name in store:names() do s:add(name, store:get(name):clone(), store:is_trainable(name)) end
    return s
end

T:test('matches torch.optim.AdamW + LambdaLR + clip_grad_norm_ + accumulation (fixture)', function()
    local fx = lunar.io.read_json(fixture)
    local hp = fx.hparams
    local store = nn.params.new()
    for _, name in ipairs(fx.order) do store:add(name, from_list(fx.init[name], fx.shapes[name])) end
    local opt = optim.AdamW.new(store, {
        lr = hp.lr, betas = {hp.beta1, hp.beta2}, eps = hp.eps, weight_decay = hp.weight_decay,
        groups = {{match = '^lm_head%.', lr = hp.head_lr, weight_decay = hp.head_weight_decay}},
        schedule = {warmup = hp.warmup, total = hp.total, decay = 'cosine', min_lr = hp.min_lr},
        clip = hp.clip, accum = hp.accum,
    })
    local updates = 0
    for k, call in ipairs(fx.calls) do
        opt:zero_grad()
        for mi, micro in ipairs(call.grads) do
            for _, name in ipairs(fx.order) do
                local g = from_list(micro[name], fx.shapes[name])
                if call.inf and call.inf.micro + 1 == mi and call.inf.name == name then
                    g:view(g:numel()):set(call.inf.index + 1, math.huge)
                end
                ops.add_(store:grad(name), g)      -- what a module's backward does (+=)
            end
        end
        local loss = call.loss
        if loss == lunar.io.null then loss = 0 / 0 end
        local before = {}
        for _, name in ipairs(fx.order) do before[name] = store:get(name):clone() end
        local info = opt:step{loss = loss}
        T.equal(info.skipped and 1 or 0, call.skipped and 1 or 0, 'call ' .. k .. ' skipped')
        if call.skipped then
            for _, name in ipairs(fx.order) do T.equal(store:get(name), before[name], 'skipped call changed ' .. name) end
        else
            updates = updates + 1
            T.close(info.lr, call.lr, {rtol = 1e-15, atol = 0, msg = 'lr of call ' .. k})
            T.close(info.grad_norm, call.grad_norm, {rtol = 1e-6, atol = 0, msg = 'grad norm of call ' .. k})
            T.close(info.clip_coef, call.clip_coef, {rtol = 1e-6, atol = 0, msg = 'clip coef of call ' .. k})
            for _, name in ipairs(fx.order) do
                T.close(store:get(name), call.params[name], {rtol = 1e-6, atol = 1e-7,
                    msg = ('call %d %s'):format(k, name)})
            end
        end
    end
    T.equal(updates, 10, 'updates')
    T.equal(opt.step_count, 10, 'step count')
    T.equal(opt.skipped, 2, 'skipped')
    T.equal(opt.nonfinite_loss, 1, 'non-finite losses')
    T.equal(opt.nonfinite_grad, 1, 'non-finite grad norms')
    for _, name in ipairs(fx.order) do
        local st = opt.state[name]
        T.equal(st.step, 10, 'per-parameter step')
        T.close(st.exp_avg, fx.final.exp_avg[name], {rtol = 1e-6, atol = 1e-9, msg = 'exp_avg ' .. name})
        T.close(st.exp_avg_sq, fx.final.exp_avg_sq[name], {rtol = 1e-6, atol = 1e-12, msg = 'exp_avg_sq ' .. name})
    end
end)

T:test('schedules: warmup then cosine / linear / constant to min_lr', function()
    local s = optim.schedule.new{lr = 1.0, warmup = 4, total = 14, decay = 'cosine', min_lr = 0.1}
    for step = 0, 20 do
        local want
        if step < 4 then want = step / 4
        elseif step >= 14 then want = 0.1
        else want = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - 4) / 10)) end
        T.close(s:lr(step), want, {rtol = 1e-14, atol = 1e-15, msg = 'cosine ' .. step})
    end
    local l = optim.schedule.new{lr = 2.0, warmup = 0, total = 10, decay = 'linear', min_lr = 0.0}
    for step = 0, 12 do T.close(l:lr(step), step >= 10 and 0 or 2 * (1 - step / 10), {atol = 1e-15, msg = 'linear ' .. step}) end
    local c = optim.schedule.new{lr = 0.5, warmup = 2, decay = 'constant'}
    T.close({c:lr(0), c:lr(1), c:lr(2), c:lr(1000)}, {0, 0.25, 0.5, 0.5})
    T.raises(function() optim.schedule.new{lr = 1, warmup = 10, total = 10} end, 'total 10 must exceed warmup 10')
    T.raises(function() optim.schedule.new{lr = 1, total = 10, decay = 'step'} end, 'decay must be cosine, linear or constant')
    T.raises(function() optim.schedule.new{lr = 1, total = 10, min_lr = 2} end, 'min_lr 2 exceeds lr 1')
end)

T:test('no-decay rules and parameter groups', function()
    local store = nn.params.new()
    local names = {'model.embed_tokens.weight', 'model.layers.0.input_layernorm.weight',
        'model.layers.0.self_attn.q_a_layernorm.weight', 'model.layers.0.self_attn.indexer.k_norm.bias',
        'model.layers.0.self_attn.q_a_proj.bias', 'model.layers.0.self_attn.q_a_proj.weight', 'model.norm.weight',
        'model.layers.1.mlp.gate.weight', 'lm_head.weight'}
    for _, n in ipairs(names) do store:add(n, lunar.zeros(2)) end
    local opt = optim.AdamW.new(store, {lr = 1e-3, weight_decay = 0.1})
    local want = {0.1, 0, 0, 0, 0, 0.1, 0, 0.1, 0.1}
    for i, n in ipairs(names) do T.equal(opt:setting(n).weight_decay, want[i], n) end
    local opt2 = optim.AdamW.new(store, {lr = 1e-3, weight_decay = 0.1,
        no_decay = {norms = false, biases = true, embeddings = true, patterns = {'mlp%.gate%.weight$'}},
        groups = {{match = {'^lm_head'}, lr = 5e-4}, {match = 'q_a_proj', weight_decay = 0.3, name = 'qa'}}})
    local want2 = {0, 0.1, 0.1, 0, 0.3, 0.3, 0.1, 0, 0.1}
    for i, n in ipairs(names) do T.equal(opt2:setting(n).weight_decay, want2[i], 'opt2 ' .. n) end
    T.equal(opt2:setting('lm_head.weight').lr, 5e-4, 'lm_head lr')
    T.equal(opt2:setting('model.norm.weight').lr, 1e-3, 'default lr')
    assert(opt2:setting('model.layers.0.self_attn.q_a_proj.bias').group == 'qa', 'group name')
end)

T:test('accumulation over micro-batches equals one averaged batch; frozen and grad-less params untouched', function()
    lunar.manual_seed(3)
    local a = nn.params.new()
    a:add('w', lunar.randn(17, 3))
    a:add('b', lunar.randn(1))
    a:add('frozen', lunar.randn(5), false)
    a:add('nograd', lunar.randn(4))
    local b = copy_store(a)
    local frozen0, nograd0 = a:get('frozen'):clone(), a:get('nograd'):clone()
    local oa = optim.AdamW.new(a, {lr = 1e-2, clip = 0.5, accum = 4})
    local ob = optim.AdamW.new(b, {lr = 1e-2, clip = 0.5})
    for _ = 1, 3 do
        oa:zero_grad(); ob:zero_grad()
        for _, n in ipairs({'w', 'b'}) do
            local sum = lunar.zeros(a:get(n):size())
            for _ = 1, 4 do
                local g = lunar.randn(a:get(n):size())
                ops.add_(a:grad(n), g)
                ops.add_(sum, g)
            end
            b:grad(n):copy_(ops.mul(sum, 0.25))
        end
        local ia, ib = oa:step(), ob:step()
        T.close(ia.grad_norm, ib.grad_norm, {rtol = 1e-6, atol = 0, msg = 'grad norm'})
    end
    T.close(a:get('w'), b:get('w'), {rtol = 1e-6, atol = 1e-7})
    T.close(a:get('b'), b:get('b'), {rtol = 1e-6, atol = 1e-7})
    T.equal(a:get('frozen'), frozen0, 'frozen')
    T.equal(a:get('nograd'), nograd0, 'no gradient')
    assert(oa.state.frozen == nil and oa.state.nograd == nil, 'no state for frozen / grad-less parameters')
    -- micro_batches per call overrides accum
    local c = copy_store(b)
    local oc = optim.AdamW.new(c, {lr = 1e-2, accum = 7})
    c:grad('w'):copy_(ops.mul(b:get('w'), 2)); c:grad('b'):fill_(0.5)
    local d = copy_store(b)
    local od = optim.AdamW.new(d, {lr = 1e-2})
    d:grad('w'):copy_(b:get('w')); d:grad('b'):fill_(0.25)
    oc:step{micro_batches = 2}; od:step()
    T.equal(c:get('w'), d:get('w'), 'micro_batches = 2')
end)

T:test('bf16 parameters: f32 master weights follow an f32 run exactly', function()
    lunar.manual_seed(5)
    local w0 = lunar.randn(33, 7):to('bf16'):to('f32')      -- representable in bf16
    local s32, s16 = nn.params.new(), nn.params.new()
    s32:add('w', w0:clone())
    s16:add('w', w0:to('bf16'))
    local o32 = optim.AdamW.new(s32, {lr = 3e-3, weight_decay = 0.1, clip = 1})
    local o16 = optim.AdamW.new(s16, {lr = 3e-3, weight_decay = 0.1, clip = 1})
    for _ = 1, 5 do
        local g = lunar.randn(33, 7)
        o32:zero_grad(); o16:zero_grad()
        s32:grad('w'):copy_(g); s16:grad('w'):copy_(g)
        o32:step(); o16:step()
    end
    assert(s16:get('w'):dtype() == 'bf16', 'param dtype')
    T.equal(o16.state.w.master, s32:get('w'), 'master == f32 run')
    T.equal(s16:get('w'), o16.state.w.master:to('bf16'), 'param == bf16(master)')
    assert(o32.state.w.master == nil, 'no master for f32')
end)

T:test('state_dict / load_state_dict: the continuation is bit-identical', function()
    lunar.manual_seed(7)
    local s1 = nn.params.new()
    s1:add('a.weight', lunar.randn(8, 3))
    s1:add('a.norm.weight', lunar.randn(3))
    s1:add('h.weight', lunar.randn(4, 4):to('bf16'))
    local o = {lr = 1e-2, weight_decay = 0.1, clip = 1.0, schedule = {warmup = 2, total = 9, min_lr = 1e-3}}
    local o1 = optim.AdamW.new(s1, o)
    local grads = {}
    for k = 1, 6 do
        grads[k] = {}
        for n in s1:names() do grads[k][n] = lunar.randn(s1:get(n):size()) end
    end
    local function run(opt, store, k)
        opt:zero_grad()
        for n in store:names() do store:grad(n):copy_(grads[k][n]) end
        return opt:step{loss = k == 2 and 0 / 0 or 1.0}
    end
    for k = 1, 3 do run(o1, s1, k) end
    -- save: clone the state tensors (a checkpoint writes them out), and the weights
    local sd = o1:state_dict()
    local saved = {}
    for name, t in pairs(sd.tensors) do saved[name] = t:clone() end
    local s2 = copy_store(s1)
    -- the bf16 param's master must come from the state, not from the rounded weight
    local o2 = optim.AdamW.new(s2, o)
    o2:load_state_dict({tensors = saved, scalars = lunar.io.decode_json(lunar.io.encode_json(sd.scalars))})
    T.equal(o2.step_count, 2, 'step count (one skipped)')
    T.equal(o2.skipped, 1, 'skipped count')
    for k = 4, 6 do
        local i1, i2 = run(o1, s1, k), run(o2, s2, k)
        T.equal(i1.lr, i2.lr, 'lr after resume')
    end
    for n in s1:names() do T.equal(s2:get(n), s1:get(n), 'resumed ' .. n) end
    assert(sd.tensors['master.h.weight'] and not sd.tensors['master.a.weight'], 'masters only for bf16')
    -- errors
    local s3 = nn.params.new()
    s3:add('a.weight', lunar.randn(8, 3))
    s3:add('h.weight', lunar.randn(4, 4))
    T.raises(function() optim.AdamW.new(s3, o):load_state_dict({tensors = saved, scalars = sd.scalars}) end,
        'optimizer state for a.norm.weight, which the parameter store does not have')
    s3 = nn.params.new()
    s3:add('a.weight', lunar.randn(3, 8))
    T.raises(function() optim.AdamW.new(s3, o):load_state_dict({tensors = {['exp_avg.a.weight'] = saved['exp_avg.a.weight'],
        ['exp_avg_sq.a.weight'] = saved['exp_avg_sq.a.weight']}, scalars = {}}) end,
        'exp_avg.a.weight has shape (8, 3), parameter a.weight has (3, 8)')
    T.raises(function() o2:load_state_dict({tensors = {['moment.a.weight'] = saved['exp_avg.a.weight']}, scalars = {}}) end,
        'unknown optimizer tensor moment.a.weight')
end)

T:test('bad options are errors that name the option', function()
    local s = nn.params.new()
    s:add('w', lunar.zeros(2))
    T.raises(function() optim.AdamW.new(s, {}) end, 'lr must be a number')
    T.raises(function() optim.AdamW.new(s, {lr = 1, betas = {0.9, 1.5}}) end, 'must be a number in [0, 1]')
    T.raises(function() optim.AdamW.new(s, {lr = 1, clip = -1}) end, 'clip must be a number >= 0')
    T.raises(function() optim.AdamW.new(s, {lr = 1, groups = {{lr = 2}}}) end, 'group 1 has no match patterns')
    T.raises(function() optim.AdamW.new({}, {lr = 1}) end, 'expected a parameter store')
end)

os.exit(T:run())
