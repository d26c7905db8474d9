-- test_nn_basic.lua: Linear, RMSNorm, Embedding and MLP (every hidden_act lunar implements)
-- forward against direct op compositions or the formulas,
-- and their backward against central finite differences (f32, eps 1e-2, tolerance rtol 2e-2 /
-- atol 2e-3 on a random projection of the output), including parameter gradients and the
-- accumulation (+=) rule.
local lunar = require 'lunar'
local nn = require 'lunar.nn'
local ops = lunar.ops
local T = require('lunar.testing').suite('nn.basic')

lunar.manual_seed(11)

local function projection_loss(y, r) return ops.sum(ops.mul(y, r)):item() end

-- checks dx and every parameter gradient of module m (store s) at input x
local function check_module(name, s, m, x, opts)
    opts = opts or {}
    local y = m:forward(x)
    local r = lunar.randn(y:size())
    s:zero_grad()
    local _, saved = m:forward(x)
    local dx = m:backward(r, saved)
    local inputs, grads = {}, {}
    if dx and x:dtype() == 'f32' then inputs[#inputs + 1] = x; grads[#grads + 1] = dx end
    for pname in s:names() do
        if s:is_trainable(pname) then
            inputs[#inputs + 1] = s:get(pname)
            grads[#grads + 1] = s:grad(pname):clone()
        end
    end
    T.gradcheck{name = name, eps = opts.eps or 1e-2, rtol = 2e-2, atol = 2e-3,
        f = function() return projection_loss((m:forward(x)), r) end, inputs = inputs, grads = grads}
end

T:test('Linear forward, bias, backward and accumulation', function()
    local s = nn.params.new()
    s:add('fc.weight', lunar.randn(5, 7))
    s:add('fc.bias', lunar.randn(5))
    local fc = nn.Linear.new(s, 'fc', {bias = true})
    local x = lunar.randn(3, 7)
    local y = fc:forward(x)
    T.close(y, ops.add(ops.matmul(x, s:get('fc.weight'):t()), s:get('fc.bias')), {rtol = 1e-6})
    check_module('linear', s, fc, x)
    -- two backward passes accumulate
    s:zero_grad()
    local _, saved = fc:forward(x)
    local dy = lunar.randn(3, 5)
    fc:backward(dy, saved)
    local once = s:grad('fc.weight'):clone()
    fc:backward(dy, saved)
    T.close(s:grad('fc.weight'), ops.mul(once, 2), {rtol = 1e-6})
end)

T:test('frozen parameters get no gradient', function()
    local s = nn.params.new()
    s:add('fc.weight', lunar.randn(4, 4), false)
    local fc = nn.Linear.new(s, 'fc')
    local _, saved = fc:forward(lunar.randn(2, 4))
    local dx = fc:backward(lunar.randn(2, 4), saved)
    assert(dx and s.grads['fc.weight'] == nil)
end)

T:test('RMSNorm forward and backward', function()
    local s = nn.params.new()
    s:add('n.weight', lunar.randn(6))
    local n = nn.RMSNorm.new(s, 'n', 1e-6)
    local x = lunar.randn(4, 6)
    local y = n:forward(x)
    local rms = ops.sqrt(ops.add(ops.mean(ops.square(x), 2, {keepdim = true}), 1e-6))
    T.close(y, ops.mul(ops.div(x, rms), s:get('n.weight')), {rtol = 1e-5, atol = 1e-6})
    check_module('rmsnorm', s, n, x)
end)

T:test('Embedding with padding_idx: the pad row gets no gradient', function()
    local s = nn.params.new()
    s:add('emb.weight', lunar.randn(10, 4))
    local e = nn.Embedding.new(s, 'emb', 0)
    local ids = lunar.tensor({3, 0, 3, 9}, 'i64')
    local y, saved = e:forward(ids)
    T.equal(y[1], s:get('emb.weight')[4], 'row lookup (ids are 0-based)')
    e:backward(lunar.ones(4, 4), saved)
    local g = s:grad('emb.weight')
    T.equal(g[1], {0, 0, 0, 0}, 'pad row')
    T.equal(g[4], {2, 2, 2, 2}, 'id 3 twice')
    T.equal(g[10], {1, 1, 1, 1}, 'id 9 once')
end)

-- hidden_act -> the scalar formula of transformers' ACT2FN entry (gelu's erf through ops.gelu,
-- which test_ops_elementwise checks)
local ACT_REF = {
    silu = function(v) return v / (1 + math.exp(-v)) end,
    gelu_pytorch_tanh = function(v)
        return 0.5 * v * (1 + math.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ^ 3)))
    end,
    relu = function(v) return v > 0 and v or 0 end,
}
ACT_REF.gelu_new = ACT_REF.gelu_pytorch_tanh

T:test('MLP with every hidden_act: forward against the formula, finite-difference gradients', function()
    for _, act in ipairs({'silu', 'gelu', 'gelu_pytorch_tanh', 'gelu_new', 'relu'}) do
        local s = nn.params.new()
        s:add('mlp.gate_proj.weight', lunar.randn(8, 5))
        s:add('mlp.up_proj.weight', lunar.randn(8, 5))
        s:add('mlp.down_proj.weight', lunar.randn(5, 8))
        local m = nn.MLP.new(s, 'mlp', act)
        local x, g
        for _ = 1, 100 do
            x = lunar.randn(3, 5)
            g = ops.matmul(x, s:get('mlp.gate_proj.weight'):t())
            -- relu: the finite-difference steps (5e-3 on x or a weight, |g| moves by < 0.02) must
            -- not carry a gate pre-activation across the kink
            if act ~= 'relu' or ops.min(ops.abs(g)):item() > 0.05 then break end
        end
        assert(act ~= 'relu' or ops.min(ops.abs(g)):item() > 0.05, 'relu: no input kept the gate away from 0')
        local u = ops.matmul(x, s:get('mlp.up_proj.weight'):t())
        local a
        if act == 'gelu' then
            a = ops.mul(ops.gelu(g), u)
        else
            local gf, uf, af = g:tolist_flat(), u:tolist_flat(), {}
            for i = 1, #gf do af[i] = ACT_REF[act](gf[i]) * uf[i] end
            a = lunar.tensor(af):view(3, 8)
        end
        T.close(m:forward(x), ops.matmul(a, s:get('mlp.down_proj.weight'):t()), {rtol = 1e-5, atol = 1e-5, msg = act})
        check_module('mlp ' .. act, s, m, x, {eps = 5e-3})
    end
    T.raises(function() nn.MLP.new(nn.params.new(), 'm', 'relu2') end, 'not supported')
end)

os.exit(T:run())
