-- test_gpu_flash.lua: GLM-5.3-Flash's CUDA kernels (kernels/cuda/kda.cu, hyper.cu) against the
-- CPU backend on the same inputs, and the Flash model on CUDA:
--   * lunar.ops.kda forward (several segments, a start state) and backward, kda_step: within
--     1e-5 of the largest value (the GPU runs the recurrence token by token, the CPU chunk-wise);
--   * conv1d_causal forward and backward, conv1d_step, hc_weights (+ backward), hc_mix (+ backward),
--     hc_collapse (+ backward): within 1e-6 (the same sums in the same order, FMA aside);
--   * flash_a on CUDA: logits within 1e-5 of the largest of the CPU's, every gradient within 1e-4
--     relative L2 (floored as the CPU tests floor them), greedy ids of transformers' generate.
-- Skipped (77) without a CUDA device. LUNAR_GPU_DRY_RUN=1 runs it with the CPU standing in.
local testing = require 'lunar.testing'
local DRY = os.getenv('LUNAR_GPU_DRY_RUN') == '1'
if not DRY then testing.require_cuda() end
local GPU = DRY and 'cpu' or 'cuda:0'
local lunar = require 'lunar'
local ops = lunar.ops
local T = testing.suite('gpu.flash (on ' .. GPU .. ')')

local function randn(seed, shape) return lunar.rng(seed):normal_(lunar.empty(shape), 0, 1) end
local function dev(t) return t:to(GPU) end

-- |a - b| / max |b| over all elements (a on any device)
local function rel(a, b)
    local d = ops.max(ops.abs(ops.sub(a:to('cpu'), b))):item()
    return d / math.max(ops.max(ops.abs(b)):item(), 1e-30)
end

local function close(a, b, tol, what)
    local e = rel(a, b)
    assert(e <= tol, ('%s: %.3g of the largest value (tolerance %g)'):format(what, e, tol))
    return e
end

local function kda_inputs(N, H, Dk, Dv, seed)
    local q = ops.rmsnorm(randn(seed, {N * H, Dk}), nil, 1e-6):view(N, H, Dk)
    local k = ops.div(ops.rmsnorm(randn(seed + 1, {N * H, Dk}), nil, 1e-6), math.sqrt(Dk)):view(N, H, Dk)
    local v = randn(seed + 2, {N, H, Dv})
    local g = ops.mul(ops.sigmoid(ops.sub(randn(seed + 3, {N, H, Dk}), 2)), -5)
    local beta = ops.sigmoid(randn(seed + 4, {N, H}))
    return q, k, v, g, beta
end

T:test('kda forward, backward and step equal the CPU', function()
    local lens = {1, 63, 130, 64}
    local cu, N = {0}, 0
    for _, n in ipairs(lens) do N = N + n; cu[#cu + 1] = N end
    local seg = lunar.tensor(cu, 'i64')
    for _, dims in ipairs({{2, 8, 8}, {3, 64, 32}}) do
        local H, Dk, Dv = dims[1], dims[2], dims[3]
        local q, k, v, g, beta = kda_inputs(N, H, Dk, Dv, 11)
        local s0 = ops.mul(randn(20, {#lens, H, Dk, Dv}), 0.3)
        local o, st = ops.kda(q, k, v, g, beta, seg, {state0 = s0, state = true})
        local og, stg = ops.kda(dev(q), dev(k), dev(v), dev(g), dev(beta), dev(seg), {state0 = dev(s0), state = true})
        local what = ('H %d Dk %d Dv %d'):format(H, Dk, Dv)
        close(og, o, 1e-5, what .. ': o')
        close(stg, st, 1e-5, what .. ': final states')
        local dout, dst = randn(30, {N, H, Dv}), ops.mul(randn(31, {#lens, H, Dk, Dv}), 0.1)
        local c = {ops.kda_backward(dout, q, k, v, g, beta, seg, {state0 = s0, dstate = dst, dstate0 = true})}
        local gg = {ops.kda_backward(dev(dout), dev(q), dev(k), dev(v), dev(g), dev(beta), dev(seg),
                                     {state0 = dev(s0), dstate = dev(dst), dstate0 = true})}
        for i, name in ipairs({'dq', 'dk', 'dv', 'dg', 'dbeta', 'dstate0'}) do close(gg[i], c[i], 1e-5, what .. ': ' .. name) end
        -- a decode step from the final states, in slots 2, 0, 3, 1
        local slots = lunar.tensor({2, 0, 3, 1}, 'i64')
        local q1, k1, v1, g1, b1 = kda_inputs(4, H, Dk, Dv, 40)
        local sc, sgpu = st:clone(), dev(st)
        local oc = ops.kda_step(q1, k1, v1, g1, b1, sc, slots)
        local ogpu = ops.kda_step(dev(q1), dev(k1), dev(v1), dev(g1), dev(b1), sgpu, dev(slots))
        close(ogpu, oc, 1e-5, what .. ': kda_step o')
        close(sgpu, sc, 1e-5, what .. ': kda_step states')
    end
end)

T:test('conv1d forward, backward and step equal the CPU', function()
    local seg = lunar.tensor({0, 1, 9, 40}, 'i64')
    local N, C, K = 40, 48, 4
    local x, w = randn(1, {N, C}), randn(2, {C, K})
    local hist = randn(3, {3, K - 1, C})
    local y = ops.conv1d_causal(x, w, seg, {hist = hist})
    close(ops.conv1d_causal(dev(x), dev(w), dev(seg), {hist = dev(hist)}), y, 1e-6, 'conv forward')
    local dy = randn(4, {N, C})
    local dw, dwg = lunar.zeros(C, K), dev(lunar.zeros(C, K))
    local dx = ops.conv1d_causal_backward(dy, x, w, seg, {hist = hist, dw = dw})
    local dxg = ops.conv1d_causal_backward(dev(dy), dev(x), dev(w), dev(seg), {hist = dev(hist), dw = dwg})
    close(dxg, dx, 1e-6, 'conv dx')
    close(dwg, dw, 1e-6, 'conv dw')
    local slots = lunar.tensor({1, 2, 0}, 'i64')
    local xs = randn(5, {3, C})
    local hc, hg = hist:clone(), dev(hist)
    close(ops.conv1d_step(dev(xs), dev(w), hg, dev(slots)), ops.conv1d_step(xs, w, hc, slots), 1e-6, 'conv1d_step y')
    close(hg, hc, 0, 'conv1d_step history')
end)

T:test('mHC weights, mix and collapse, forward and backward, equal the CPU', function()
    for _, n in ipairs({2, 4}) do
        local N, H = 37, 24
        local z = randn(6, {N, (2 + n) * n})
        local pre, post, comb = ops.hc_weights(z, n, {iters = 20, eps = 1e-6})
        local pg, qg, cg = ops.hc_weights(dev(z), n, {iters = 20, eps = 1e-6})
        close(pg, pre, 1e-6, 'pre')
        close(qg, post, 1e-6, 'post')
        close(cg, comb, 1e-6, 'comb')
        local dpre, dpost, dcomb = randn(7, {N, n}), randn(8, {N, n}), randn(9, {N, n, n})
        local dz = ops.hc_weights_backward(dpre, dpost, dcomb, z, n, {iters = 20, eps = 1e-6})
        close(ops.hc_weights_backward(dev(dpre), dev(dpost), dev(dcomb), dev(z), n, {iters = 20, eps = 1e-6}), dz, 1e-6,
            'hc_weights_backward')
        local X, a = randn(10, {N, n, H}), randn(11, {N, H})
        local y = ops.hc_mix(X, a, post, comb)
        close(ops.hc_mix(dev(X), dev(a), dev(post), dev(comb)), y, 1e-6, 'hc_mix')
        local dY = randn(12, {N, n, H})
        local c = {ops.hc_mix_backward(dY, X, a, post, comb)}
        local gpu = {ops.hc_mix_backward(dev(dY), dev(X), dev(a), dev(post), dev(comb))}
        for i, name in ipairs({'dx', 'da', 'dpost', 'dcomb'}) do close(gpu[i], c[i], 1e-6, 'hc_mix_backward ' .. name) end
        local u = ops.hc_collapse(X, pre)
        close(ops.hc_collapse(dev(X), dev(pre)), u, 1e-6, 'hc_collapse')
        local du = randn(13, {N, H})
        local cx, cp = ops.hc_collapse_backward(du, X, pre)
        local gx, gp = ops.hc_collapse_backward(dev(du), dev(X), dev(pre))
        close(gx, cx, 1e-6, 'hc_collapse_backward dx')
        close(gp, cp, 1e-6, 'hc_collapse_backward dpre')
    end
end)

T:test('flash_a on the GPU: logits and gradients of the CPU, greedy ids of transformers', function()
    local dir = 'tests/fixtures/models/flash_a'
    local cpu, gpu = lunar.model.load(dir), lunar.model.load(dir, {device = GPU})
    local ids = lunar.tensor({{5, 9, 2, 7, 11, 3, 8, 1, 4, 6, 10, 12, 13, 2, 9, 7, 5, 3, 1, 8}}, 'i64')
    local batch = {input_ids = ids, labels = ids}
    local a = cpu:forward(batch, {loss = true})
    cpu:backward()
    local b = gpu:forward({input_ids = dev(ids), labels = dev(ids)}, {loss = true})
    gpu:backward()
    local e = close(b.logits, a.logits, 1e-5, 'logits')
    assert(math.abs(b.loss - a.loss) <= 1e-6 * math.abs(a.loss), ('loss %.9g, cpu %.9g'):format(b.loss, a.loss))
    local largest = 0
    for _, g in pairs(cpu:gradients()) do largest = math.max(largest, ops.global_norm({g})) end
    local worst = 0
    for name, g in pairs(cpu:gradients()) do
        local gg = gpu:gradients()[name]
        assert(gg, name .. ': no gradient on the GPU')
        local r = ops.global_norm({ops.sub(gg:to('cpu'), g)}) / math.max(ops.global_norm({g}), 1e-5 * largest, 1e-30)
        worst = math.max(worst, r)
        assert(r <= 1e-4, ('%s: gradient relative L2 %.3g'):format(name, r))
    end
    -- greedy ids on the GPU: transformers' generate (tests/fixtures/generate/hf_greedy.json)
    local REF = require('lunar.io').read_json('tests/fixtures/generate/hf_greedy.json').cases.flash_a
    local prompts = {}
    for i, row in ipairs(REF.prompts) do prompts[i] = row.prompt end
    local res = lunar.generate(gpu, prompts, {max_new_tokens = #REF.prompts[1].generated, stop_token_ids = {}})
    for i, row in ipairs(REF.prompts) do
        for s, t in ipairs(row.generated) do
            assert(res[i].ids[s] == t, ('prompt %d token %d is %d, transformers %d'):format(i, s, res[i].ids[s], t))
        end
    end
    print(('      flash_a: logits %.2g, worst gradient %.2g, %d prompts of greedy ids equal'):format(e, worst, #prompts))
end)

os.exit(T:run())
