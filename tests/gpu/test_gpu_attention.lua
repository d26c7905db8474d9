-- test_gpu_attention.lua: the CUDA fused attention (forward, backward) and DSA index score
-- against the CPU backend on the same values. Skipped (exit 77) without a CUDA device.
--
-- Cases: T = 1, 3, 17, 300 (several key chunks), S ~= T, GQA groups and per-head keys, causal and
-- padded masks (uniform rows), no mask, DSA key lists with repeated, negative and masked entries.
-- Tolerances: f32 o, lse rtol/atol 1e-4 (online softmax vs two passes), gradients rtol 1e-3,
-- atol 1e-4 (different summation orders); bf16/f16 inputs rtol/atol 3e-2 against the CPU on the
-- same rounded inputs. The backward is run twice on the GPU and must agree bit for bit. The
-- index score is within rtol/atol 1e-4 of the CPU; the GPU top-k equals the top-k of the GPU's
-- own scores (ids in increasing order). Shared memory: head dims whose buffers pass the default
-- 48 KiB run (the kernels opt in to more) and match the CPU; past the device's limit the error is
-- lunar's, naming the size, the bytes and the largest size the device takes.
local lunar = require 'lunar'
require('lunar.testing').require_cuda()
local T = require('lunar.testing').suite('gpu.attention')
local ops = lunar.ops
local masks = require 'lunar.nn.masks'
local core = require 'lunar.core'

lunar.manual_seed(31)
local FMIN = masks.FMIN

local function padded_mask(B, Tn)
    local am = {}
    for b = 1, B do
        am[b] = {}
        for t = 1, Tn do am[b][t] = (b == 1 and t <= 2) and 0 or 1 end
    end
    return masks.build{B = B, T = Tn, attention_mask = lunar.tensor(am, 'i64')}
end

local function random_keys(B, S, Tn, K)
    local flat = {}
    for _ = 1, B * S do
        for j = 1, K do
            local t = math.random(0, Tn - 1)
            if j % 7 == 0 then t = -1 end
            flat[#flat + 1] = t
        end
    end
    return core.from_flat(flat, {B, S, K}, 'i64')
end

local CASES = {
    {B = 1, S = 1, T = 1, NH = 2, Hk = 1, Dq = 4, Dv = 3, K = 1},
    {B = 2, S = 3, T = 3, NH = 2, Hk = 2, Dq = 8, Dv = 5, K = 2},
    {B = 2, S = 17, T = 17, NH = 4, Hk = 2, Dq = 40, Dv = 33, K = 6},
    {B = 1, S = 300, T = 300, NH = 2, Hk = 2, Dq = 96, Dv = 64, K = 40},
    {B = 2, S = 5, T = 9, NH = 3, Hk = 1, Dq = 6, Dv = 4, K = 4},
}

T:test('forward and backward match the CPU (f32, bf16, f16; masks, key lists, GQA)', function()
    for _, c in ipairs(CASES) do
        local q, k, v = lunar.randn(c.B, c.S, c.NH, c.Dq), lunar.randn(c.B, c.T, c.Hk, c.Dq), lunar.randn(c.B, c.T, c.Hk, c.Dv)
        local dout = lunar.randn(c.B, c.S, c.NH, c.Dv)
        local ms = {none = false}
        if c.S == c.T then
            ms.causal = masks.causal(c.B, c.T)
            if c.B >= 2 and c.T >= 3 then ms.padded = padded_mask(c.B, c.T) end
        else
            local m = lunar.zeros(c.B, c.S, c.T)
            ops.masked_fill_(m, ops.gt(lunar.rand(c.B, c.S, c.T), 0.6), FMIN)
            ms.random = m
        end
        for mname, m in pairs(ms) do
            for _, use_keys in ipairs({false, true}) do
                local keys = use_keys and random_keys(c.B, c.S, c.T, c.K) or nil
                for _, dt in ipairs({'f32', 'bf16', 'f16'}) do
                    local msg = ('B %d S %d T %d NH %d Hk %d, mask %s, keys %s, %s'):format(c.B, c.S, c.T, c.NH, c.Hk,
                        mname, tostring(use_keys), dt)
                    local qc, kc, vc, dc = q:to(dt), k:to(dt), v:to(dt), dout:to(dt)
                    local opts = {keys = keys, mask = m or nil, scale = 0.3}
                    local oc, lc = ops.attention(qc, kc, vc, opts)
                    local gopts = {keys = keys and keys:to('cuda'), mask = m and m:to('cuda') or nil, scale = 0.3}
                    local qg, kg, vg, dg = qc:to('cuda'), kc:to('cuda'), vc:to('cuda'), dc:to('cuda')
                    local og, lg = ops.attention(qg, kg, vg, gopts)
                    local tol = dt == 'f32' and {rtol = 1e-4, atol = 1e-4} or {rtol = 3e-2, atol = 3e-2}
                    T.close(og:cpu():to('f32'), oc:to('f32'), {rtol = tol.rtol, atol = tol.atol, msg = msg .. ' o'})
                    T.close(lg:cpu(), lc, {rtol = 1e-4, atol = 1e-4, msg = msg .. ' lse'})
                    local dqc, dkc, dvc = ops.attention_backward(dc, oc, lc, qc, kc, vc, opts)
                    local dqg, dkg, dvg = ops.attention_backward(dg, og, lg, qg, kg, vg, gopts)
                    local gtol = dt == 'f32' and {rtol = 1e-3, atol = 1e-4} or {rtol = 3e-2, atol = 3e-2}
                    T.close(dqg:cpu():to('f32'), dqc:to('f32'), {rtol = gtol.rtol, atol = gtol.atol, msg = msg .. ' dq'})
                    T.close(dkg:cpu():to('f32'), dkc:to('f32'), {rtol = gtol.rtol, atol = gtol.atol, msg = msg .. ' dk'})
                    T.close(dvg:cpu():to('f32'), dvc:to('f32'), {rtol = gtol.rtol, atol = gtol.atol, msg = msg .. ' dv'})
                    local dq2, dk2, dv2 = ops.attention_backward(dg, og, lg, qg, kg, vg, gopts)
                    T.equal(dq2:cpu(), dqg:cpu(), msg .. ' dq deterministic')
                    T.equal(dk2:cpu(), dkg:cpu(), msg .. ' dk deterministic')
                    T.equal(dv2:cpu(), dvg:cpu(), msg .. ' dv deterministic')
                end
            end
        end
    end
end)

T:test('shared memory: head dims past 48 KiB run (opt-in), past the device limit lunar says so', function()
    -- forward Dq + Dv = 12000: 51072 dynamic bytes (+ the kernel's own), over the default 48 KiB;
    -- backward Dq + Dv = 6000: the per-key kernel asks for 192000 bytes (a row per warp)
    for _, c in ipairs({{D = 6000, backward = false}, {D = 3000, backward = true}}) do
        local q, k, v = lunar.randn(1, 2, 1, c.D), lunar.randn(1, 3, 1, c.D), lunar.randn(1, 3, 1, c.D)
        local opts = {scale = 0.01}
        local oc, lc = ops.attention(q, k, v, opts)
        local qg, kg, vg = q:to('cuda'), k:to('cuda'), v:to('cuda')
        local og, lg = ops.attention(qg, kg, vg, opts)
        local msg = ('Dq = Dv = %d'):format(c.D)
        T.close(og:cpu(), oc, {rtol = 1e-4, atol = 1e-4, msg = msg .. ' o'})
        T.close(lg:cpu(), lc, {rtol = 1e-4, atol = 1e-4, msg = msg .. ' lse'})
        local dout = lunar.randn(1, 2, 1, c.D)
        if c.backward then
            local dqc, dkc, dvc = ops.attention_backward(dout, oc, lc, q, k, v, opts)
            local dqg, dkg, dvg = ops.attention_backward(dout:to('cuda'), og, lg, qg, kg, vg, opts)
            T.close(dqg:cpu(), dqc, {rtol = 1e-3, atol = 1e-4, msg = msg .. ' dq'})
            T.close(dkg:cpu(), dkc, {rtol = 1e-3, atol = 1e-4, msg = msg .. ' dk'})
            T.close(dvg:cpu(), dvc, {rtol = 1e-3, atol = 1e-4, msg = msg .. ' dv'})
        else
            -- 8 warps x 12000 floats = 384000 bytes: more than any device allows (227 KiB on sm_90)
            local err = T.raises(function() ops.attention_backward(dout:to('cuda'), og, lg, qg, kg, vg, opts) end,
                'attention_backward (cuda:0): Dq + Dv = 12000 needs ')
            assert(err:find('bytes of shared memory per block %(%d+ for the sizes %+ %d+ of the kernel\'s own%), '
                .. 'more than the %d+ the device allows: at most Dq %+ Dv = %d+'), err)
        end
    end
end)

T:test('index_scores and its top-k match the CPU', function()
    for _, c in ipairs({{B = 1, S = 1, T = 1, Hi = 2, Di = 3, k = 1}, {B = 2, S = 17, T = 17, Hi = 4, Di = 16, k = 5},
                        {B = 1, S = 64, T = 700, Hi = 8, Di = 64, k = 256}}) do
        local qi, ki, w = lunar.randn(c.B, c.S, c.Hi, c.Di), lunar.randn(c.B, c.T, c.Di), lunar.randn(c.B, c.S, c.Hi)
        local m = c.S == c.T and masks.causal(c.B, c.T) or nil
        for _, dt in ipairs({'f32', 'bf16'}) do
            local msg = ('B %d S %d T %d %s'):format(c.B, c.S, c.T, dt)
            local sc = ops.index_scores(qi:to(dt), ki:to(dt), w, {mask = m, scale = 0.25})
            local sg, tg = ops.index_scores(qi:to(dt):to('cuda'), ki:to(dt):to('cuda'), w:to('cuda'),
                {mask = m and m:to('cuda'), scale = 0.25, topk = c.k})
            T.close(sg:cpu(), sc, {rtol = 1e-4, atol = 1e-4, msg = msg .. ' scores'})
            local _, want = ops.topk(sg:cpu(), c.k)
            local wf, K, rows = want:tolist_flat(), c.k, {}
            for r = 0, #wf / K - 1 do
                local row = {}
                for j = 1, K do row[j] = wf[r * K + j] end
                table.sort(row)
                for j = 1, K do rows[#rows + 1] = row[j] end
            end
            T.equal(tg:cpu(), rows, msg .. ' topk')
            local none, only = ops.index_scores(qi:to(dt):to('cuda'), ki:to(dt):to('cuda'), w:to('cuda'),
                {mask = m and m:to('cuda'), scale = 0.25, topk = c.k, scores = false})
            assert(none == nil)
            T.equal(only:cpu(), tg:cpu(), msg .. ' topk without scores')
        end
    end
end)

os.exit(T:run())
