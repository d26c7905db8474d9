-- examples/train_mlp.lua: the embedded default main job (for now): a two-layer MLP learns to
-- imitate a random "teacher" network on synthetic data, on the CPU, with explicit forward and
-- backward ops and AdamW. Prints the falling loss and exits non-zero if it did not fall.
--
--   ./build/lunar examples/train_mlp.lua [train.steps=300] [train.lr=0.01] [model.hidden=64]
local lunar = require 'lunar'
local ops = lunar.ops

local cfg = lunar.config.merge({
    data = {n = 1024, dim = 16, classes = 4, seed = 1},
    model = {hidden = 64, seed = 2},
    train = {steps = 300, lr = 1e-2, weight_decay = 0.01, log_every = 25},
}, lunar.config.overrides())

local N, D, K, H = cfg.data.n, cfg.data.dim, cfg.data.classes, cfg.model.hidden

-- data: x ~ N(0, 1); labels = argmax of a random two-layer teacher
local data_rng = lunar.rng(cfg.data.seed)
local x = lunar.randn(N, D, {rng = data_rng:split('x'), name = 'x'})
local t1 = lunar.randn(D, 32, {rng = data_rng:split('teacher1')})
local t2 = lunar.randn(32, K, {rng = data_rng:split('teacher2')})
local _, labels = ops.max(ops.matmul(ops.tanh(ops.matmul(x, t1)), t2), 2)

-- model: logits = gelu(x W1 + b1) W2 + b2
local init = lunar.rng(cfg.model.seed)
local params = {
    W1 = lunar.randn(D, H, {rng = init:split('W1'), name = 'W1'}):mul_(1 / math.sqrt(D)),
    b1 = lunar.zeros(H, {name = 'b1'}),
    W2 = lunar.randn(H, K, {rng = init:split('W2'), name = 'W2'}):mul_(1 / math.sqrt(H)),
    b2 = lunar.zeros(K, {name = 'b2'}),
}
local names = {'W1', 'b1', 'W2', 'b2'}
local state = {}
for _, n in ipairs(names) do
    state[n] = {m = lunar.zeros(params[n]:size()), v = lunar.zeros(params[n]:size()),
                g = lunar.zeros(params[n]:size())}
end

local function step(it)
    return lunar.scope(function()
        local p = params
        -- forward
        local pre = ops.add(ops.matmul(x, p.W1), p.b1)          -- (N, H)
        local h = ops.gelu(pre)
        local logits = ops.add(ops.matmul(h, p.W2), p.b2)       -- (N, K)
        local loss, _, lse = ops.cross_entropy(logits, labels)  -- per row
        local mean_loss = ops.sum(loss):item() / N
        -- backward (mean over rows)
        local dloss = lunar.full({N}, 1 / N)
        local dlogits = ops.cross_entropy_backward(dloss, logits, lse, labels)
        ops.gemm(h, dlogits, {trans_a = true, out = state.W2.g})             -- dW2 = h^T dlogits
        state.b2.g:copy_(ops.sum(dlogits, 1))
        local dh = ops.gemm(dlogits, p.W2, {trans_b = true})                 -- (N, H)
        local dpre = ops.gelu_backward(dh, pre)
        ops.gemm(x, dpre, {trans_a = true, out = state.W1.g})
        state.b1.g:copy_(ops.sum(dpre, 1))
        -- AdamW (no decay on biases)
        for _, n in ipairs(names) do
            local s = state[n]
            ops.adamw_step(p[n], s.g, s.m, s.v, {lr = cfg.train.lr, step = it,
                weight_decay = n:sub(1, 1) == 'W' and cfg.train.weight_decay or 0})
        end
        return mean_loss
    end)
end

print(('train_mlp: %d samples, %d -> %d -> %d, %d steps, %d threads'):format(N, D, H, K, cfg.train.steps,
    lunar.threads()))
local first, last
local t0 = os.clock()
for it = 1, cfg.train.steps do
    local loss = step(it)
    first = first or loss
    last = loss
    if it == 1 or it % cfg.train.log_every == 0 or it == cfg.train.steps then
        print(('step %4d  loss %.4f'):format(it, loss))
    end
end
print(('loss %.4f -> %.4f (%.0f%% lower), %.2fs cpu time'):format(first, last, 100 * (1 - last / first), os.clock() - t0))
if not (last < 0.5 * first) then
    io.stderr:write('train_mlp: the loss did not fall by half\n')
    os.exit(1)
end
