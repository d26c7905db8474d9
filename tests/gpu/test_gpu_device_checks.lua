-- test_gpu_device_checks.lua: what the CUDA backend checks and says without stalling the stream.
--   * index range errors: embedding (forward, backward), index_select, index_add, gather,
--     scatter and scatter_add skip a bad value on the device and read nothing back; the next
--     check point (lunar.sync_check, lunar.synchronize) reads the device's range record once and
--     raises the first op's error, with its value, position and range; the record is then clear;
--     lunar.check_each_op(true) raises at the op; gathers write 0 for the bad entries and the
--     right values elsewhere;
--   * the forward and backward of the transformers fixtures read the device no more often than
--     test_device_plumbing's budget for the debug device cpu:1 allows (none in the backward);
--   * no query heads (NH = 0) is lunar's error, not a launch of no blocks;
--   * lunar.cuda_status() counts the devices, and a missing index is "not available" without
--     a reason about CUDA itself.
-- Skipped (77) without a CUDA device. To check this file without one, run it with
-- LUNAR_FAKE_CPU_DEVICES=1 LUNAR_GPU_STAND_IN=cpu:1: the debug device stands in for cuda:0
-- (the CUDA-only checks are left out).
local lunar = require 'lunar'
local STAND_IN = os.getenv('LUNAR_GPU_STAND_IN')
if not STAND_IN then require('lunar.testing').require_cuda() end
local GPU = STAND_IN or 'cuda:0'
local io_ = require 'lunar.io'
local ops = lunar.ops
local T = require('lunar.testing').suite('gpu.device_checks' .. (STAND_IN and ' (on ' .. STAND_IN .. ')' or ''))

local function dev(t) return t:to(GPU) end

-- reads of the device (to_host transfers) while fn runs, then fn's results
local function reads(fn)
    local s0 = lunar.transfer_stats()
    local r = {fn()}
    return lunar.transfer_stats().to_host - s0.to_host, unpack(r)
end

T:test('index range errors wait for the check point: no read per op, one read at the check', function()
    local src = dev(lunar.randn(5, 3, {rng = lunar.rng(4)}):set_name('table'))
    local idx = dev(lunar.tensor({1, 7, 0}, 'i64'))
    local want = "index_select: index 7 (at flat position 1 of the index) out of range: src 'table' has 5 entries"
    local n, out = reads(function() return ops.index_select(src, 1, idx) end)
    assert(n == 0, 'the op read the device ' .. n .. ' times')
    -- on CUDA the bad entry reads as 0s and the others are the rows asked for (the debug device
    -- leaves the whole output at 0)
    local want_rows = ops.index_select(src:to('cpu'), 1, lunar.tensor({1, 0}, 'i64'))
    if not STAND_IN then
        T.equal(out:to('cpu'):select(1, 1), want_rows:select(1, 1), 'row 1')
        T.equal(out:to('cpu'):select(1, 3), want_rows:select(1, 2), 'row 3')
    end
    T.equal(out:to('cpu'):select(1, 2), lunar.zeros(3), 'the skipped row')
    -- a later bad op does not replace the first one's error
    lunar.zeros(2):to(GPU):scatter_add_(1, dev(lunar.tensor({9}, 'i64')), dev(lunar.ones(1)))
    local err
    n = reads(function() err = T.raises(function() lunar.sync_check(GPU) end, want) end)
    assert(n == 1, 'the check point read the device ' .. n .. ' times')
    assert(err:find('(found on ' .. (STAND_IN or 'cuda:0') .. ', which reports bad indices at its next check point',
        1, true), err)
    n = reads(function() lunar.sync_check(GPU) end)
    assert(n == 1, 'a clean check reads once too: ' .. n)
    -- every index op of the family, and large values reported exactly
    local ids = dev(lunar.tensor({0, -2 ^ 40}, 'i64'))
    for _, case in ipairs({
        {'embedding_forward', function() ops.embedding(ids, src) end},
        {'embedding_backward', function() ops.embedding_backward(lunar.zeros(5, 3):to(GPU), lunar.ones(2, 3):to(GPU), ids) end},
        {'index_add', function() lunar.zeros(5, 3):to(GPU):index_add_(1, ids, lunar.ones(2, 3):to(GPU)) end},
        {'gather', function() ops.gather(src, 1, dev(lunar.tensor({{0, -2 ^ 40, 0}}, 'i64'))) end},
        {'scatter', function() lunar.zeros(5, 3):to(GPU):scatter_(1, dev(lunar.tensor({{0, -2 ^ 40, 0}}, 'i64')),
            lunar.ones(1, 3):to(GPU)) end},
        {'scatter_add', function() lunar.zeros(5, 3):to(GPU):scatter_add_(1, dev(lunar.tensor({{0, -2 ^ 40, 0}}, 'i64')),
            lunar.ones(1, 3):to(GPU)) end},
    }) do
        n = reads(case[2])
        assert(n == 0, case[1] .. ' read the device ' .. n .. ' times')
        T.raises(function() lunar.sync_check(GPU) end, case[1] .. ': index -1099511627776')
    end
    -- lunar.synchronize is a check point; check_each_op raises at the op
    ops.index_select(src, 1, idx)
    T.raises(function() lunar.synchronize(GPU) end, want)
    lunar.check_each_op(true)
    local ok, e2 = pcall(ops.index_select, src, 1, idx)
    lunar.check_each_op(false)
    assert(not ok and tostring(e2):find(want, 1, true), tostring(e2))
    lunar.sync_check(GPU)
end)

-- test_device_plumbing's read budget of a forward with the batch given on the host: the loss and
-- the count of valid targets, the MTP loss's two, the expert counts per MoE layer, the block mask's
-- cu_seqlens and the forward's check point
local function read_budget(model, ref)
    local n = 2 + 1
    for _, L in ipairs(model.layers) do if L.mlp_type ~= 'dense' then n = n + 1 end end
    if #model.mtp > 0 then n = n + #model.mtp + 2 end
    if ref.cu_seqlens then n = n + 1 end
    return n
end

T:test('a forward and backward of each fixture stay within the read budget', function()
    for _, case in ipairs({'glm5_dsa', 'glm5_mtp', 'glm5_packed', 'glm5_padded', 'glm5_gelu_tied', 'glm4moe'}) do
        local dir = 'tests/fixtures/models/' .. case
        local ref = io_.load_checkpoint(dir .. '/reference.safetensors')
        local model = lunar.model.load(dir, {device = GPU})
        local batch = {input_ids = ref.input_ids, labels = ref.labels, position_ids = ref.position_ids,
                       attention_mask = ref.attention_mask, cu_seqlens = ref.cu_seqlens}
        local mtp = #model.mtp > 0
        local nf = reads(function() model:forward(batch, {loss = true, mtp = mtp}) end)
        local nb = reads(function() model:backward({mtp_scale = mtp and 0.3 or 0}) end)
        local budget = read_budget(model, ref)
        assert(nf <= budget, ('%s: the forward read the device %d times, the budget is %d'):format(case, nf, budget))
        assert(nb == 0, ('%s: the backward read the device %d times'):format(case, nb))
    end
end)

T:test('no query heads (NH = 0) is refused before any launch', function()
    local q = lunar.randn(1, 3, 0, 5):to(GPU)
    local k, v = lunar.randn(1, 3, 2, 5):to(GPU), lunar.randn(1, 3, 2, 2):to(GPU)
    local want = 'has shape (1, 3, 0, 5), expected (B, S, NH, Dq) with NH >= 1 query heads'
    T.raises(function() ops.attention(q, k, v) end, 'attention_forward: q')
    T.raises(function() ops.attention(q, k, v) end, want)
    local o, lse = lunar.empty({1, 3, 0, 2}, {device = GPU}), lunar.empty({1, 0, 3}, {device = GPU})
    T.raises(function() ops.attention_backward(lunar.empty({1, 3, 0, 2}, {device = GPU}), o, lse, q, k, v) end, want)
    lunar.synchronize(GPU)   -- nothing failed on the device
end)

T:test('cuda_status: the devices found; a missing index says so without blaming CUDA', function()
    if STAND_IN then return end
    local ok, msg = lunar.cuda_status()
    local n = lunar.device_count('cuda')
    assert(ok and n > 0, msg)
    assert(msg == ('%d CUDA device%s'):format(n, n == 1 and '' or 's'), msg)
    local err = T.raises(function() lunar.zeros(2, {device = 'cuda:' .. n}) end, 'not available')
    assert(not err:find('CUDA is not available', 1, true), err)
end)

os.exit(T:run())
