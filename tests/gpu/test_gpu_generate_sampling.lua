-- test_gpu_generate_sampling.lua: lunar.generate.sampling on CUDA against the same calls on the
-- CPU (tests/lua/test_generate_sampling.lua holds the CPU to transformers' distributions):
--   * a mixed batch (greedy, plain, top-k, top-p, min-p, all together; rows of 5,000 logits, past
--     the 4,096 where the CUDA sort leaves shared memory) gives the CPU's tokens, logprobs within
--     1e-5 and processed logprobs within 1e-5;
--   * 25,000 draws of the fixture's top_k 50, top_p 0.9 case give the CPU's tokens, but for at
--     most 1 in 1,000 (a draw that lands within rounding of a cumulative sum: the devices sum in
--     other orders), so the device draws the distribution the CPU's chi-square test accepted;
--   * a request draws the same bits alone and in shuffled batches of other requests on the device;
--   * the outputs stay on the device, and a call copies one table to it and reads nothing back.
-- Skipped (77) without a CUDA device. LUNAR_GPU_DRY_RUN=1 runs it with the CPU standing in (no
-- transfers to count there); LUNAR_FAKE_CPU_DEVICES=1 LUNAR_GPU_STAND_IN=cpu:1 puts the debug
-- device in the GPU's place, which counts its transfers as a GPU's.
local testing = require 'lunar.testing'
local DRY = os.getenv('LUNAR_GPU_DRY_RUN') == '1'
local STAND_IN = os.getenv('LUNAR_GPU_STAND_IN')
if not DRY and not STAND_IN then testing.require_cuda() end
local GPU = STAND_IN or (DRY and 'cpu' or 'cuda:0')
local lunar = require 'lunar'
local sampling = require 'lunar.generate.sampling'
local T = testing.suite('gpu.generate.sampling (on ' .. GPU .. ')')

local FIXTURE = lunar.io.read_json('tests/fixtures/generate/sampling_hf.json')

local SETTINGS = {
    {temperature = 0},
    {temperature = 1, seed = 1},
    {temperature = 0.7, top_k = 50, seed = 2},
    {temperature = 0.9, top_p = 0.8, seed = 3},
    {temperature = 1.3, min_p = 0.1, seed = 4},
    {temperature = 0.6, top_k = 400, top_p = 0.95, min_p = 0.02, seed = 5},
}

-- rows of logits, their params and positions: each setting at 4 positions, in a shuffled order
local function mixed_batch(V)
    local rows = {}
    for i, s in ipairs(SETTINGS) do
        local p = sampling.params(s)
        for pos = 0, 3 do rows[#rows + 1] = {p = p, pos = pos, id = i * 10 + pos} end
    end
    require('lunar.data.pack').shuffle_in_place(rows, lunar.rng(1):split('rows'))
    local logits = lunar.rng(2):normal_(lunar.empty({#rows, V}), 0, 3)
    local params, positions = {}, {}
    for b, r in ipairs(rows) do params[b], positions[b] = r.p, r.pos end
    return logits, params, positions
end

local function both(logits, params, positions)
    local c = sampling.sample(logits, params, positions, {processed_logprobs = true})
    local dev = logits:to(GPU)
    local s0 = lunar.transfer_stats()
    local g = sampling.sample(dev, params, positions, {processed_logprobs = true})
    local s1 = lunar.transfer_stats()
    for _, k in ipairs({'tokens', 'logprobs', 'processed_logprobs'}) do
        assert(g[k]:device() == dev:device(), k .. ' is not on the device')
    end
    return c, g, s1.to_host - s0.to_host, s1.from_host - s0.from_host
end

T:test('a mixed batch gives the cpu\'s tokens and logprobs; one copy to the device, no read back', function()
    local c, g, reads, copies = both(mixed_batch(5000))
    T.equal(g.tokens:to('cpu'), c.tokens, 'tokens')
    T.close(g.logprobs:to('cpu'), c.logprobs, {rtol = 0, atol = 1e-5, msg = 'logprobs'})
    T.close(g.processed_logprobs:to('cpu'), c.processed_logprobs, {rtol = 0, atol = 1e-5, msg = 'processed logprobs'})
    if GPU ~= 'cpu' then
        assert(reads == 0, ('sample read the device %d times'):format(reads))
        assert(copies == 1, ('sample copied %d times to the device'):format(copies))
    end
    print(('      %d rows x 5000: tokens equal, reads %d, copies %d'):format(c.tokens:size(1), reads, copies))
end)

T:test('25,000 draws of top_k 50, top_p 0.9 give the cpu\'s tokens', function()
    local case
    for _, c in ipairs(FIXTURE.cases) do if c.name == 'top_k 50, top_p 0.9' then case = c end end
    local s = {seed = 7}
    for k, v in pairs(case.settings) do s[k] = v end
    local p = sampling.params(s)
    local n, V = 25000, #case.logits
    local params, positions = {}, {}
    for b = 1, n do params[b], positions[b] = p, b - 1 end
    local c, g = both(lunar.tensor({case.logits}):expand(n, V):contiguous(), params, positions)
    local ct, gt = c.tokens:tolist_flat(), g.tokens:to('cpu'):tolist_flat()
    local differ = 0
    for b = 1, n do
        if ct[b] ~= gt[b] then
            differ = differ + 1
            assert(case.probs[gt[b] + 1] > 0, ('draw %d: token %d is outside the processed distribution'):format(b,
                gt[b]))
        end
    end
    print(('      %d of %d draws differ from the cpu'):format(differ, n))
    assert(differ <= n / 1000, ('%d of %d draws differ from the cpu'):format(differ, n))
end)

T:test('a request draws the same bits alone and in shuffled batches on the device', function()
    local logits, params, positions = mixed_batch(5000)
    local dev = logits:to(GPU)
    local batch = sampling.sample(dev, params, positions, {processed_logprobs = true})
    local bt, bl, bp = batch.tokens:to('cpu'):tolist_flat(), batch.logprobs:to('cpu'):tolist_flat(),
                       batch.processed_logprobs:to('cpu'):tolist_flat()
    for b = 1, #params, 5 do
        local one = sampling.sample(dev:narrow(1, b, 1), {params[b]}, {positions[b]}, {processed_logprobs = true})
        T.equal({one.tokens:to('cpu'):item(), one.logprobs:to('cpu'):item(), one.processed_logprobs:to('cpu'):item()},
                {bt[b], bl[b], bp[b]}, ('row %d alone'):format(b))
    end
end)

os.exit(T:run())
