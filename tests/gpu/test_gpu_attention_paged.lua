-- test_gpu_attention_paged.lua: the paged decode attention (ops.attention_paged,
-- kernels/cuda/attention_paged.cu) on CUDA against the CPU kernel on the same values:
--   * f32 within rtol/atol 1e-4 (an online softmax on the device, two passes on the CPU): GQA
--     groups, one shared head with v a narrowed view of k (MLA's latents, Dq 576, Dv 512: the
--     head groups split by the kernel's register and shared-memory bounds), more positions than
--     a chunk, lengths inside and at block edges, DSA key lists with repeats and entries past
--     the length; bf16 within 3e-2 on the same rounded values;
--   * a sequence gets the same bits on the device alone and in a batch;
--   * a block id outside the cache is an error at the next check point, naming the tensor.
-- Skipped (77) without a CUDA device; LUNAR_GPU_DRY_RUN=1 runs it with the CPU standing in.
local testing = require 'lunar.testing'
local DRY = os.getenv('LUNAR_GPU_DRY_RUN') == '1'
if not DRY then testing.require_cuda() end
local GPU = DRY and 'cpu' or 'cuda:0'
local lunar = require 'lunar'
local ops = lunar.ops
local T = testing.suite('gpu.attention_paged (on ' .. GPU .. ')')

lunar.manual_seed(41)
math.randomseed(7)

local function i64(list, shape) return lunar.tensor(list, {dtype = 'i64'}):view(shape) end

-- a random table of distinct blocks for the given lengths, NB columns (unused ones repeat)
local function layout(lens, bs, nblocks, NB)
    local perm = {}
    for i = 0, nblocks - 1 do perm[#perm + 1] = i end
    for i = #perm, 2, -1 do
        local j = math.random(i)
        perm[i], perm[j] = perm[j], perm[i]
    end
    local flat, used = {}, 0
    for _, len in ipairs(lens) do
        local first = perm[used + 1]
        for j = 1, NB do
            if j <= math.ceil(len / bs) then used = used + 1; flat[#flat + 1] = perm[used] else flat[#flat + 1] = first end
        end
    end
    return i64(flat, {#lens, NB}), i64(lens, {#lens})
end

local function on(t) return t:to(GPU) end

local function both(q, k, v, tbl, lengths, opts)
    local cpu = ops.attention_paged(q, k, v, tbl, lengths, opts)
    local o = {block_size = opts.block_size, scale = opts.scale, keys = opts.keys and on(opts.keys)}
    local dev = ops.attention_paged(on(q), on(k), v == k and on(k) or on(v), on(tbl), on(lengths), o)
    return dev:to('cpu'), cpu
end

local CASES = {
    {name = 'GQA', NH = 8, Hk = 2, Dq = 64, Dv = 64, bs = 16, lens = {1, 16, 17, 300, 45}, nblocks = 40},
    {name = 'per-head keys', NH = 4, Hk = 4, Dq = 40, Dv = 24, bs = 8, lens = {9, 64, 3}, nblocks = 20},
    {name = 'MLA latents', NH = 16, Hk = 1, Dq = 576, Dv = 512, bs = 16, lens = {5, 130, 64}, nblocks = 16,
     mla = true},
}

T:test('f32 and bf16 against the CPU kernel', function()
    for _, c in ipairs(CASES) do
        local NB = math.ceil(300 / c.bs)
        local tbl, lengths = layout(c.lens, c.bs, c.nblocks + NB, NB)
        local R = (c.nblocks + NB) * c.bs
        local q = lunar.randn(#c.lens, c.NH, c.Dq)
        local k = lunar.randn(R, c.Hk * c.Dq)
        local v = c.mla and k:narrow(2, 1, c.Dv) or lunar.randn(R, c.Hk * c.Dv)
        local dev, cpu = both(q, k, v, tbl, lengths, {block_size = c.bs, scale = c.Dq ^ -0.5})
        T.close(dev, cpu, {rtol = 1e-4, atol = 1e-4, msg = c.name .. ' f32'})
        -- DSA key lists: increasing with repeats, and entries past the length
        local K, flat = 24, {}
        for b, len in ipairs(c.lens) do
            local t = 0
            for j = 1, K do
                flat[#flat + 1] = (j % 5 == 0) and t or t + math.random(0, 3)
                t = flat[#flat]
            end
            flat[(b - 1) * K + K] = len + 7
        end
        local keys = i64(flat, {#c.lens, K})
        dev, cpu = both(q, k, v, tbl, lengths, {block_size = c.bs, keys = keys})
        T.close(dev, cpu, {rtol = 1e-4, atol = 1e-4, msg = c.name .. ' keys'})
        -- bf16: the device takes q in the cache's dtype; the CPU reads the same rounded values
        local qb, kb = q:to('bf16'), k:to('bf16')
        local vb = c.mla and kb:narrow(2, 1, c.Dv) or v:to('bf16')
        local cpu16 = ops.attention_paged(qb:to('f32'), kb, vb, tbl, lengths, {block_size = c.bs})
        local dev16 = ops.attention_paged(on(qb), on(kb), c.mla and on(kb):narrow(2, 1, c.Dv) or on(vb), on(tbl),
            on(lengths), {block_size = c.bs})
        T.close(dev16:to('cpu'):to('f32'), cpu16, {rtol = 3e-2, atol = 3e-2, msg = c.name .. ' bf16'})
    end
end)

T:test('a sequence gets the same bits alone and in a batch on the device', function()
    local c = CASES[1]
    local NB = 19
    local tbl, lengths = layout(c.lens, c.bs, 60, NB)
    local q = on(lunar.randn(#c.lens, c.NH, c.Dq))
    local k, v = on(lunar.randn(60 * c.bs, c.Hk * c.Dq)), on(lunar.randn(60 * c.bs, c.Hk * c.Dv))
    local dt, dl = on(tbl), on(lengths)
    local all = ops.attention_paged(q, k, v, dt, dl, {block_size = c.bs}):to('cpu')
    for b = 1, #c.lens do
        local alone = ops.attention_paged(q:narrow(1, b, 1), k, v, dt:narrow(1, b, 1), dl:narrow(1, b, 1),
            {block_size = c.bs})
        T.equal(alone:to('cpu'), all:narrow(1, b, 1), 'sequence ' .. b)
    end
end)

T:test('a block id outside the cache is an error naming it', function()
    local q, k = on(lunar.randn(1, 2, 8)), on(lunar.randn(16, 8))
    T.raises(function()
        ops.attention_paged(q, k, k, on(i64({0, 9}, {1, 2})), on(i64({6}, {1})), {block_size = 4})
        lunar.synchronize(GPU)
    end, 'blocks of the cache')
end)

os.exit(T:run())
