-- test_generate_sampling.lua: lunar.generate.sampling against the processed distribution
-- (temperature -> top-k -> top-p -> min-p) that transformers' warpers compute
-- (tests/fixtures/generate/sampling_hf.json, made by tests/ref/make_sampling_refs.py) and an f64
-- Lua reference of the same definition, checked against it:
--   * 200,000 draws at T 0.7, top_k 50, top_p 0.9 (both truncations cut: top-p alone would keep
--     more than 50 tokens, and top-p then drops part of the top 50) and at T 0.7, min_p 0.05
--     pass a chi-square test against HF's processed distribution (p > 0.001) and never give a
--     token it excludes; 50,000 draws each for the fixture's other cases (plain, top-k alone,
--     min-p after top-p in a case where vLLM V1's order would keep other tokens, mixed);
--   * temperature 0 is argmax, the lowest id among equal maxima (torch.argmax);
--   * ties: every token equal to the k-th value stays; at the top-p boundary the lower ids stay;
--     a tiny top_p or min_p 1 still keeps the most probable token;
--   * a request gives the same tokens and logprobs, bit for bit, alone and in batches of other
--     requests of any size and order;
--   * logprobs are log_softmax(logits / T) at the sampled ids within 1e-6, processed logprobs the
--     log of the reference processed probability within 1e-5;
--   * on the debug device cpu:1 (when LUNAR_FAKE_CPU_DEVICES gives one, as ctest does): the cpu's
--     results, one host-to-device copy and no read back per call;
--   * invalid settings and arguments give errors naming the setting.
local lunar = require 'lunar'
local sampling = require 'lunar.generate.sampling'
local T = require('lunar.testing').suite('generate.sampling')
local ops = lunar.ops

local FIXTURE = lunar.io.read_json('tests/fixtures/generate/sampling_hf.json')
local CASES = {}
for _, c in ipairs(FIXTURE.cases) do CASES[c.name] = c end

-- ---- reference ---------------------------------------------------------------------------

-- the processed distribution of one row of logits (a Lua list, 0-based ids at index id + 1) in
-- f64: probs[id + 1] (0 for excluded tokens); margins: how far the closest top-p and min-p
-- decisions were from their thresholds (the test's logits keep them clear of f32 rounding).
-- steps: the order of the truncations, default HF's {'top_k', 'top_p', 'min_p'}.
local function reference(row, s, steps)
    local V = #row
    local x = {}
    for i = 1, V do x[i] = row[i] / s.temperature end
    local keep = {}
    for i = 1, V do keep[i] = true end
    local order = {}
    for i = 1, V do order[i] = i end
    table.sort(order, function(a, b) if x[a] ~= x[b] then return x[a] > x[b] end return a < b end)
    local margins = {top_p = math.huge, min_p = math.huge}
    local function softmax()
        local m = -math.huge
        for i = 1, V do if keep[i] then m = math.max(m, x[i]) end end
        local p, z = {}, 0
        for i = 1, V do p[i] = keep[i] and math.exp(x[i] - m) or 0; z = z + p[i] end
        for i = 1, V do p[i] = p[i] / z end
        return p
    end
    local apply = {}
    function apply.top_k()
        if (s.top_k or 0) == 0 or s.top_k >= V then return end
        local kth = x[order[s.top_k]]
        for i = 1, V do if x[i] < kth then keep[i] = false end end
    end
    function apply.top_p()
        if (s.top_p or 1) == 1 then return end
        local p = softmax()
        -- the mass at and below each rank, from the least probable up
        local tail, drop = 0, {}
        for r = V, 1, -1 do
            tail = tail + p[order[r]]
            if keep[order[r]] then margins.top_p = math.min(margins.top_p, math.abs(tail - (1 - s.top_p))) end
            drop[r] = tail <= 1 - s.top_p
        end
        for r = 2, V do if drop[r] then keep[order[r]] = false end end
    end
    function apply.min_p()
        if (s.min_p or 0) == 0 then return end
        local p = softmax()
        local pmax = 0
        for i = 1, V do pmax = math.max(pmax, p[i]) end
        for i = 1, V do
            if keep[i] then
                margins.min_p = math.min(margins.min_p, math.abs(p[i] - s.min_p * pmax) / pmax)
                if p[i] < s.min_p * pmax then keep[i] = false end
            end
        end
    end
    for _, step in ipairs(steps or {'top_k', 'top_p', 'min_p'}) do apply[step]() end
    return softmax(), margins
end

local function log_softmax_at(row, temperature, id)
    local m, z = -math.huge, 0
    for i = 1, #row do m = math.max(m, row[i] / temperature) end
    for i = 1, #row do z = z + math.exp(row[i] / temperature - m) end
    return row[id + 1] / temperature - m - math.log(z)
end

-- ln Gamma(a) (Lanczos, g = 7) and the regularized upper incomplete gamma Q(a, x), for the
-- chi-square survival function P(X >= x) = Q(df / 2, x / 2)
local LANCZOS = {0.99999999999980993, 676.5203681218851, -1259.1392167224028, 771.32342877765313,
                 -176.61502916214059, 12.507343278686905, -0.13857109526572012, 9.9843695780195716e-6,
                 1.5056327351493116e-7}
local function log_gamma(a)
    if a < 0.5 then return math.log(math.pi / math.abs(math.sin(math.pi * a))) - log_gamma(1 - a) end
    a = a - 1
    local s = LANCZOS[1]
    for i = 1, 8 do s = s + LANCZOS[i + 1] / (a + i) end
    local t = a + 7.5
    return 0.5 * math.log(2 * math.pi) + (a + 0.5) * math.log(t) - t + math.log(s)
end
local function gamma_q(a, x)
    if x <= 0 then return 1 end
    local lead = -x + a * math.log(x) - log_gamma(a)
    if x < a + 1 then   -- series for P(a, x)
        local term, sum = 1 / a, 1 / a
        for n = 1, 10000 do
            term = term * x / (a + n)
            sum = sum + term
            if math.abs(term) < math.abs(sum) * 1e-15 then break end
        end
        return 1 - sum * math.exp(lead)
    end
    -- continued fraction for Q(a, x) (modified Lentz)
    local tiny = 1e-300
    local b = x + 1 - a
    local c, d = 1 / tiny, 1 / b
    local h = d
    for n = 1, 10000 do
        local an = -n * (n - a)
        b = b + 2
        d = an * d + b
        if math.abs(d) < tiny then d = tiny end
        c = b + an / c
        if math.abs(c) < tiny then c = tiny end
        d = 1 / d
        local delta = d * c
        h = h * delta
        if math.abs(delta - 1) < 1e-15 then break end
    end
    return math.exp(lead) * h
end

-- ---- helpers -------------------------------------------------------------------------------

-- n draws of one request from one row of logits (positions 0..n-1, in batches of rows that all
-- repeat the row): counts[id + 1]
local function draw_counts(row_tensor, params, n, batch)
    local V = row_tensor:size(2)
    local counts = {}
    for i = 1, V do counts[i] = 0 end
    local done = 0
    while done < n do
        local m = math.min(batch, n - done)
        local plist, pos = {}, {}
        for j = 1, m do plist[j], pos[j] = params, done + j - 1 end
        local out = sampling.sample(row_tensor:expand(m, V), plist, pos)
        for _, id in ipairs(out.tokens:tolist_flat()) do counts[id + 1] = counts[id + 1] + 1 end
        out.tokens:free()
        out.logprobs:free()
        done = done + m
    end
    return counts
end

-- chi-square of counts against probs over the tokens probs allows (tokens expected fewer than 5
-- times pooled into one bin); a draw of an excluded token fails at once. Returns the p-value, the
-- statistic and the degrees of freedom.
local function chi_square(counts, probs, n, what)
    local stat, bins, pool_e, pool_o = 0, 0, 0, 0
    for i = 1, #probs do
        if probs[i] == 0 then
            if counts[i] > 0 then error(('%s: token %d drawn %d times, but the processed distribution excludes it')
                :format(what, i - 1, counts[i])) end
        elseif n * probs[i] < 5 then
            pool_e, pool_o = pool_e + n * probs[i], pool_o + counts[i]
        else
            bins = bins + 1
            stat = stat + (counts[i] - n * probs[i]) ^ 2 / (n * probs[i])
        end
    end
    if pool_e > 0 then
        bins = bins + 1
        stat = stat + (pool_o - pool_e) ^ 2 / pool_e
    end
    local df = bins - 1
    return gamma_q(df / 2, stat / 2), stat, df
end

local function count_kept(probs)
    local n = 0
    for i = 1, #probs do if probs[i] > 0 then n = n + 1 end end
    return n
end

-- one fixture case as a (1, V) tensor, a copy of its settings and HF's probabilities
local function case(name)
    local c = assert(CASES[name], 'no fixture case ' .. name)
    local s = {}
    for k, v in pairs(c.settings) do s[k] = v end
    return lunar.tensor({c.logits}), s, c.probs
end

local BATCH = 25000

-- n draws of the case, tested against HF's probabilities
local function run_chi_square(name, n, seed)
    local x, s, probs = case(name)
    s.seed = seed
    local counts = draw_counts(x, sampling.params(s), n, BATCH)
    local p, stat, df = chi_square(counts, probs, n, name)
    print(('      %s: %d tokens kept, chi2 %.1f on %d dof, p = %.3f'):format(name, count_kept(probs), stat, df, p))
    assert(p > 0.001, ('%s: chi-square p = %.3g <= 0.001 (chi2 %.1f on %d dof)'):format(name, p, stat, df))
end

-- ---- the distribution ----------------------------------------------------------------------

T:test('the f64 reference is the distribution of HF\'s warpers', function()
    for _, c in ipairs(FIXTURE.cases) do
        local probs = reference(c.logits, c.settings)
        T.close(probs, c.probs, {rtol = 0, atol = 1e-6, msg = c.name})
        for i = 1, #probs do
            assert((probs[i] > 0) == (c.probs[i] > 0), ('%s: token %d kept by one and not the other'):format(c.name,
                i - 1))
        end
    end
end)

T:test('200,000 draws at temperature 0.7, top_k 50, top_p 0.9 match the processed distribution', function()
    local x, s = case('top_k 50, top_p 0.9')
    local row = x:tolist_flat()
    -- both truncations cut: top-p alone keeps more than 50 tokens, top-k then top-p fewer than 50
    local alone = count_kept(reference(row, {temperature = s.temperature, top_p = s.top_p}))
    local kept = count_kept(reference(row, s))
    assert(alone > 50 and kept < 50, ('top-p alone keeps %d tokens, after top-k %d'):format(alone, kept))
    run_chi_square('top_k 50, top_p 0.9', 200000, 7)
end)

T:test('200,000 draws at temperature 0.7, min_p 0.05 match the processed distribution', function()
    run_chi_square('min_p 0.05', 200000, 8)
end)

T:test('plain sampling, top-k alone, min-p after top-p and mixed settings match their distributions', function()
    -- min-p after top-p (HF's order) keeps other tokens here than min-p before top-p (vLLM V1's)
    local x, s = case('top_p 0.9, min_p 0.3')
    local row = x:tolist_flat()
    local hf = count_kept(reference(row, s))
    local v1 = count_kept(reference(row, s, {'min_p', 'top_k', 'top_p'}))
    local top_p_only = count_kept(reference(row, {temperature = s.temperature, top_p = s.top_p}))
    assert(hf < top_p_only and hf ~= v1, ('kept: %d (HF order), %d (vLLM V1 order), %d (top-p alone)'):format(hf,
        v1, top_p_only))
    for i, name in ipairs({'top_p 0.9, min_p 0.3', 'top_k 20', 'temperature 1',
                           'normal, top_k 100, top_p 0.95, min_p 0.02', 'normal, top_p 0.7',
                           'normal, top_k 300 of 300'}) do
        run_chi_square(name, 50000, 100 + i)
    end
end)

-- ---- greedy and ties -----------------------------------------------------------------------

T:test('temperature 0 is argmax, the lowest id among equal maxima', function()
    local x = lunar.tensor({{0.5, 2, -1, 2, 2},      -- three equal maxima: id 1
                            {3, 1, 3, 0, 0},          -- id 0
                            {-5, -4, -3, -2, -1}})    -- id 4
    local g = sampling.params{temperature = 0}
    local out = sampling.sample(x, {g, g, g}, {0, 5, 9}, {processed_logprobs = true})
    T.equal(out.tokens, {1, 0, 4}, 'greedy tokens')
    T.equal(out.tokens, ops.argmax(x, 2), 'torch.argmax')
    local rows = x:tolist()
    local want = {}
    for b, id in ipairs({1, 0, 4}) do want[b] = log_softmax_at(rows[b], 1, id) end
    T.close(out.logprobs, want, {rtol = 0, atol = 1e-6, msg = 'greedy logprob = log_softmax(logits)'})
    T.equal(out.processed_logprobs, {0, 0, 0}, 'the point mass')
    -- a greedy request needs no seed, and its settings besides temperature do not change argmax
    local g2 = sampling.params{temperature = 0, top_k = 3, top_p = 0.1, min_p = 0.9, seed = 4}
    T.equal(sampling.sample(x, {g2, g2, g2}, {0, 0, 0}).tokens, {1, 0, 4}, 'greedy ignores truncation')
end)

T:test('ties: every token equal to the k-th value stays; at the top-p boundary the lower ids stay', function()
    -- top_k 2 of {3, 2, 2, 1, 0}: the two tokens at 2 tie for second place and both stay
    local x = lunar.tensor({{2, 3, 0, 2, 1}})
    local counts = draw_counts(x, sampling.params{temperature = 1, top_k = 2, seed = 1}, 20000, 20000)
    assert(counts[1] > 0 and counts[2] > 0 and counts[4] > 0, 'a token tied with the k-th value was dropped')
    assert(counts[3] == 0 and counts[5] == 0, 'a token below the k-th value was drawn')
    local probs = reference(x:tolist_flat(), {temperature = 1, top_k = 2})
    local p = chi_square(counts, probs, 20000, 'top-k ties')
    assert(p > 0.001, 'top-k ties: p = ' .. p)
    -- five equal tokens (ids 1, 2, 4, 5, 7; the rest has probability 0) and top_p 0.5: a token
    -- goes when the mass at and below it is <= 0.5, so the two ranked last go, and among equals
    -- the lower ids rank first: 1, 2 and 4 stay
    local u = lunar.tensor({{-1e4, 0.5, 0.5, -1e4, 0.5, 0.5, -1e4, 0.5}})
    counts = draw_counts(u, sampling.params{temperature = 1, top_p = 0.5, seed = 2}, 30000, 30000)
    for _, id in ipairs({1, 2, 4}) do
        assert(counts[id + 1] > 9000, ('tied id %d got %d of 30000 draws'):format(id, counts[id + 1]))
    end
    for _, id in ipairs({0, 3, 5, 6, 7}) do
        assert(counts[id + 1] == 0, ('id %d past the top-p boundary was drawn %d times'):format(id, counts[id + 1]))
    end
end)

T:test('a tiny top_p or min_p 1 still keeps the most probable token', function()
    local x = case('top_k 20')
    local best = ops.argmax(x, 2):item()
    -- 1 - 1e-9 rounds to 1 in f32, so the top token's own tail (about 1) is <= the threshold
    for _, s in ipairs({{top_p = 1e-9}, {min_p = 1}, {top_p = 1e-9, min_p = 1, top_k = 1}}) do
        s.temperature, s.seed = 1, 3
        local counts = draw_counts(x, sampling.params(s), 100, 100)
        T.equal(counts[best + 1], 100, 'every draw is the most probable token')
    end
end)

-- ---- batch invariance ----------------------------------------------------------------------

local function requests(V)
    local rng = lunar.rng(42)
    local list = {
        {temperature = 0},
        {temperature = 1, seed = 11},
        {temperature = 0.7, top_k = 20, seed = 12},
        {temperature = 0.9, top_p = 0.8, seed = 13},
        {temperature = 1.3, min_p = 0.1, seed = 14},
        {temperature = 0.6, top_k = 40, top_p = 0.95, min_p = 0.02, seed = 15, sample = 2},
        {temperature = 1, top_k = 1000, seed = '18446744073709551615'},
    }
    for i, s in ipairs(list) do
        s.logits = rng:split(i):normal_(lunar.empty({1, V}), 0, 3)
        s.params = sampling.params(s, s.sample)
    end
    return list
end

T:test('a request draws the same alone and in batches of any size and order', function()
    local V = 300
    local reqs = requests(V)
    local POS = 12
    -- alone: one row per call
    local alone = {}
    for i, r in ipairs(reqs) do
        alone[i] = {}
        for pos = 0, POS - 1 do
            local out = sampling.sample(r.logits, {r.params}, {pos}, {processed_logprobs = true})
            alone[i][pos] = {out.tokens:item(), out.logprobs:item(), out.processed_logprobs:item()}
        end
    end
    -- the draws do change with the position
    local seen = {}
    for pos = 0, POS - 1 do seen[alone[2][pos][1]] = true end
    local distinct = 0
    for _ in pairs(seen) do distinct = distinct + 1 end
    assert(distinct > 3, 'plain sampling gave ' .. distinct .. ' distinct tokens over ' .. POS .. ' positions')
    -- batches: every request at several positions, among other requests' rows, shuffled
    local others = requests(V)
    for trial = 1, 4 do
        local rows = {}
        for i = 1, #reqs do
            for pos = 0, POS - 1, trial do rows[#rows + 1] = {req = i, pos = pos, r = reqs[i]} end
        end
        for j = 1, trial * 3 do
            local o = others[(j % #others) + 1]
            rows[#rows + 1] = {pos = 1000 + j, r = o}
        end
        require('lunar.data.pack').shuffle_in_place(rows, lunar.rng(trial):split('rows'))
        local logits = lunar.empty({#rows, V})
        local plist, pos = {}, {}
        for b, row in ipairs(rows) do
            logits:narrow(1, b, 1):copy_(row.r.logits)
            plist[b], pos[b] = row.r.params, row.pos
        end
        local out = sampling.sample(logits, plist, pos, {processed_logprobs = true})
        local tok, lp, plp = out.tokens:tolist_flat(), out.logprobs:tolist_flat(), out.processed_logprobs:tolist_flat()
        for b, row in ipairs(rows) do
            if row.req then
                local want = alone[row.req][row.pos]
                local got = {tok[b], lp[b], plp[b]}
                T.equal(got, want, ('trial %d: request %d at position %d in a batch of %d'):format(trial, row.req,
                    row.pos, #rows))
            end
        end
    end
end)

-- ---- logprobs ------------------------------------------------------------------------------

T:test('logprobs are log_softmax(logits / T) at the sampled ids; processed ones the processed distribution', function()
    local V = 1000
    local rng = lunar.rng(5)
    local settings = {
        {temperature = 0.7, seed = 1},
        {temperature = 1, seed = 2},
        {temperature = 1.8, top_k = 50, seed = 3},
        {temperature = 0.5, top_p = 0.7, seed = 4},
        {temperature = 1.2, min_p = 0.05, top_p = 0.95, top_k = 200, seed = 5},
        {temperature = 0},
    }
    local B = #settings * 8
    local logits = rng:normal_(lunar.empty({B, V}), 0, 4)
    local plist, pos = {}, {}
    for b = 1, B do
        plist[b] = sampling.params(settings[(b - 1) % #settings + 1])
        pos[b] = b
    end
    local out = sampling.sample(logits, plist, pos, {processed_logprobs = true})
    local rows, tok = logits:tolist(), out.tokens:tolist_flat()
    local want_lp, want_plp = {}, {}
    for b = 1, B do
        local s = settings[(b - 1) % #settings + 1]
        local t = s.temperature > 0 and s.temperature or 1
        want_lp[b] = log_softmax_at(rows[b], t, tok[b])
        if s.temperature > 0 then
            local probs = reference(rows[b], s)
            assert(probs[tok[b] + 1] > 0, ('row %d: token %d is outside the processed distribution'):format(b, tok[b]))
            want_plp[b] = math.log(probs[tok[b] + 1])
        else
            want_plp[b] = 0
        end
    end
    T.close(out.logprobs, want_lp, {rtol = 0, atol = 1e-6, msg = 'logprobs'})
    T.close(out.processed_logprobs, want_plp, {rtol = 0, atol = 1e-5, msg = 'processed logprobs'})
    -- bf16 logits are sampled in f32, as their f32 values
    local out16 = sampling.sample(logits:bf16(), plist, pos)
    local out32 = sampling.sample(logits:bf16():float(), plist, pos)
    T.equal(out16.tokens, out32.tokens, 'bf16 logits')
    T.equal(out16.logprobs, out32.logprobs, 'bf16 logprobs')
end)

T:test('rng:uniform_at(i) is element i of a uniform_ draw, without advancing the stream', function()
    local r = lunar.rng(3):split('sampling')
    local before = r:state()
    local at = {}
    for i = 0, 9 do at[i + 1] = r:uniform_at(i) end
    assert(r:state() == before, 'the stream advanced')
    T.equal(at, r:uniform_(lunar.empty({10}, 'f64')), 'uniform_at vs uniform_')
    T.equal(r:uniform_at(0), r:uniform_(lunar.empty({1}, 'f64')):item(), 'after the draw: the next element')
    T.raises(function() r:uniform_at(-1) end, 'is not a non-negative integer')
end)

-- ---- devices -------------------------------------------------------------------------------

T:test('on the debug device cpu:1: the cpu results, one copy to the device and no read back', function()
    if lunar.device_count('cpu') < 2 then
        print('      needs the debug device cpu:1 (LUNAR_FAKE_CPU_DEVICES=1): skipped')
        return
    end
    local V = 200
    local reqs = requests(V)
    local logits = lunar.empty({#reqs, V})
    local plist, pos = {}, {}
    for b, r in ipairs(reqs) do
        logits:narrow(1, b, 1):copy_(r.logits)
        plist[b], pos[b] = r.params, b
    end
    local want = sampling.sample(logits, plist, pos, {processed_logprobs = true})
    local dev_logits = logits:to('cpu:1')
    local t0 = lunar.transfer_stats()
    local got = sampling.sample(dev_logits, plist, pos, {processed_logprobs = true})
    local t1 = lunar.transfer_stats()
    assert(got.tokens:device() == 'cpu:1' and got.logprobs:device() == 'cpu:1', 'outputs on the logits device')
    T.equal(t1.to_host - t0.to_host, 0, 'reads of device memory')
    T.equal(t1.from_host - t0.from_host, 1, 'copies to the device')
    T.equal(got.tokens:cpu(), want.tokens, 'tokens')
    T.equal(got.logprobs:cpu(), want.logprobs, 'logprobs')
    T.equal(got.processed_logprobs:cpu(), want.processed_logprobs, 'processed logprobs')
end)

-- ---- errors --------------------------------------------------------------------------------

T:test('invalid settings and arguments give errors naming the setting', function()
    local P = sampling.params
    T.raises(function() P{temperature = -0.1, seed = 1} end, 'temperature = -0.1 is negative (0 means greedy decoding)')
    T.raises(function() P{temperature = 1e-7, seed = 1} end, 'temperature = 1e-07 is below 1e-05')
    T.raises(function() P{temperature = math.huge, seed = 1} end, 'temperature = inf is not finite')
    T.raises(function() P{temperature = 0 / 0, seed = 1} end, 'temperature is NaN')
    T.raises(function() P{temperature = '0.7', seed = 1} end, 'temperature must be a number, got the string 0.7')
    T.raises(function() P{top_p = 0, seed = 1} end, 'top_p = 0 is outside (0, 1]')
    T.raises(function() P{top_p = 1.01, seed = 1} end, 'top_p = 1.01 is outside (0, 1]')
    T.raises(function() P{top_p = -0.5, seed = 1} end, 'top_p = -0.5 is outside (0, 1]')
    T.raises(function() P{top_k = -1, seed = 1} end, 'top_k = -1 is negative; top_k = 0 turns top-k off')
    T.raises(function() P{top_k = 2.5, seed = 1} end, 'top_k = 2.5 is not an integer')
    T.raises(function() P{min_p = -0.01, seed = 1} end, 'min_p = -0.01 is outside [0, 1]')
    T.raises(function() P{min_p = 1.5, seed = 1} end, 'min_p = 1.5 is outside [0, 1]')
    T.raises(function() P{temperature = 0.7} end, 'seed is required when temperature > 0')
    T.raises(function() P{} end, 'seed is required when temperature > 0')
    T.raises(function() P{seed = -3} end, 'seed = -3 is not an integer in [0, 2^53]')
    T.raises(function() P{seed = 1.5} end, 'seed = 1.5 is not an integer in [0, 2^53]')
    T.raises(function() P{seed = 2 ^ 60} end, 'pass a larger seed as a decimal string')
    T.raises(function() P{seed = '18446744073709551616'} end, 'is not a decimal integer in [0, 2^64)')
    T.raises(function() P{seed = '12ab'} end, 'is not a decimal integer')
    T.raises(function() P{seed = true} end, 'seed must be a non-negative integer')
    T.raises(function() P({seed = 1}, -1) end, 'sample = -1 is not a non-negative integer')
    T.raises(function() P('greedy') end, 'expected a table of settings')
    -- the edges are fine
    P{temperature = 0}
    P{temperature = 1e-5, top_p = 1, min_p = 1, top_k = 0, seed = 0}
    P{seed = '18446744073709551615'}
    local x = lunar.randn(2, 5)
    local p = P{seed = 1}
    T.raises(function() sampling.sample(x, {p}, {0, 0}) end, 'logits has 2 rows but params is a list of 1')
    T.raises(function() sampling.sample(x, {p, p}, {0}) end, 'logits has 2 rows but positions is a list of 1')
    T.raises(function() sampling.sample(x, {p, {temperature = 1, seed = 1}}, {0, 0}) end,
        'params[2] was not made by sampling.params')
    T.raises(function() sampling.sample(x, {p, p}, {0, -1}) end, 'positions[2] = -1 is not a non-negative integer')
    T.raises(function() sampling.sample(x, {p, p}, {0, 0.5}) end, 'positions[2] = 0.5 is not a non-negative integer')
    T.raises(function() sampling.sample(lunar.randn(5), {p}, {0}) end, 'logits must be a (B, V) float tensor')
    T.raises(function() sampling.sample(lunar.zeros({2, 5}, 'i64'), {p, p}, {0, 0}) end, 'float tensor, got i64')
    T.raises(function() sampling.sample(nil, {p}, {0}) end, 'logits must be a tensor')
    local empty = sampling.sample(lunar.empty({0, 5}), {}, {})
    T.equal(empty.tokens:size(1), 0, 'no rows')
end)

os.exit(T:run())
