-- test_rl_device.lua: the RL loss and the model's RL outputs with every tensor on the debug device
-- cpu:1 (LUNAR_FAKE_CPU_DEVICES=1, set by tests/CMakeLists.txt for this test; skipped, 77,
-- without it), as test_device_plumbing.lua does for the rest: nothing is made on the default
-- device (that would be a device-mismatch error), the results equal the cpu run bit for bit, and
-- the host reads stay at their budget: loss.policy reads its numbers in one transfer, the
-- normaliser one per mask, the RL backward none.
local lunar = require 'lunar'
if lunar.device_count('cpu') < 2 then
    print('needs the debug device cpu:1 (LUNAR_FAKE_CPU_DEVICES=1): skipped')
    os.exit(77)
end
local io_ = require 'lunar.io'
local loss = require 'lunar.rl.loss'
local ops = lunar.ops
local T = require('lunar.testing').suite('rl.device')

local DEV = 'cpu:1'

local function reads(fn)
    local s0 = lunar.transfer_stats()
    local r = {fn()}
    local s1 = lunar.transfer_stats()
    return s1.to_host - s0.to_host, unpack(r)
end

local CFG = {eps_high = 0.28, dual_clip = 10, reduction = 'seq-mean-token-mean', kl = {coef = 0.01, estimator = 'k3'},
             tis_cap = 2, entropy_coef = 0.003}

-- one RL micro-step on `device`: forward at temperature 0.7, the loss, backward
local function run(device)
    local dir = 'tests/fixtures/models/glm4moe'
    local model = lunar.model.load(dir, {device = device})
    local ref = io_.load_checkpoint(dir .. '/reference.safetensors')
    local batch = {input_ids = ref.input_ids, labels = ref.labels}
    local B, S = ref.input_ids:size(1), ref.input_ids:size(2)
    local out = model:forward(batch, {logprobs = true, entropy = true, temperature = 0.7})
    local rng = lunar.core.rng_new(2)
    local function noise(scale) return rng:normal_(lunar.empty(B, S), 0, scale):to(device) end
    local mask = lunar.ones(B, S)
    mask:narrow(2, 1, 3):fill_(0)
    mask = mask:to(device)
    local inputs = {logprobs = out.logprobs, old_logprobs = ops.add(out.logprobs, noise(0.3)),
        ref_logprobs = ops.add(out.logprobs, noise(0.5)), rollout_logprobs = ops.add(out.logprobs, noise(0.5)),
        advantages = lunar.tensor({1.5, -0.7}):to(device), mask = mask, entropy = out.entropy}
    local norm_reads, norm = reads(function() return loss.normaliser({mask}, CFG) end)
    local policy_reads, value, grads, metrics = reads(function() return loss.policy(inputs, CFG, norm) end)
    local backward_reads = reads(function() model:backward{dlogprobs = grads.dlogprobs, dentropy = grads.dentropy} end)
    return {value = value, grads = grads, metrics = metrics, model = model, out = out,
            reads = {norm = norm_reads, policy = policy_reads, backward = backward_reads}}
end

T:test('glm4moe on cpu:1: forward, loss, backward equal the cpu run bit for bit, one read per loss', function()
    local a, b = run('cpu'), run(DEV)
    assert(b.grads.dlogprobs:device() == DEV and b.grads.dentropy:device() == DEV and b.out.entropy:device() == DEV)
    assert(a.value == b.value, ('loss %.9g vs %.9g'):format(a.value, b.value))
    T.equal(b.out.entropy:to('cpu'), a.out.entropy, 'entropy')
    T.equal(b.grads.dlogprobs:to('cpu'), a.grads.dlogprobs, 'dlogprobs')
    for k, v in pairs(a.metrics) do assert(b.metrics[k] == v, k) end
    local n = 0
    for name, g in pairs(a.model:gradients()) do
        T.equal(b.model:gradients()[name]:to('cpu'), g, name)
        n = n + 1
    end
    assert(n > 10, 'gradients compared: ' .. n)
    assert(b.reads.norm == 1, 'normaliser reads: ' .. b.reads.norm)
    assert(b.reads.policy == 1, 'policy reads: ' .. b.reads.policy)
    assert(b.reads.backward == 0, 'backward reads: ' .. b.reads.backward)
end)

os.exit(T:run())
