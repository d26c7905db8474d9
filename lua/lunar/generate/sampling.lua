-- lunar.generate.sampling: the next token of every row of a batch of logits, each row drawn with
-- its own settings from its own random stream, and the token's log-probabilities.
--
--   local sampling = require 'lunar.generate.sampling'
--   local p = sampling.params{temperature = 0.7, top_k = 50, top_p = 0.9, min_p = 0, seed = 1234}
--   local g = sampling.params{temperature = 0}                  -- greedy: no seed needed
--   local out = sampling.sample(logits, {p, g}, {0, 0}, {processed_logprobs = true})
--   out.tokens              (B) i64   the sampled ids (0-based), on logits' device
--   out.logprobs            (B) f32   log_softmax(logits / T) at the token (T = 1 for greedy rows)
--   out.processed_logprobs  (B) f32   the token's log-probability under the distribution it was
--                                     drawn from (after top-k, top-p, min-p; 0 for greedy rows);
--                                     only with opts.processed_logprobs
--
-- sampling.params(settings[, sample]) validates one request's settings and returns them with the
-- request's random stream; every bad value is an error naming the setting:
--   temperature  number, 0 (greedy) or >= 1e-5, default 1. Smaller positive values are refused:
--                vLLM decodes greedily below 1e-5 where lunar would divide by them (logits / T
--                overflows f32 as T nears 0); say 0 for greedy decoding.
--   top_k        integer >= 0, default 0 (off). Keeps every token whose scaled logit is >= the
--                k-th largest (ties with the k-th all stay, as HF and vLLM do); k >= V keeps all.
--                vLLM's "off" is -1; here it is 0, and -1 is an error.
--   top_p        number in (0, 1], default 1 (off). Of the tokens left by top-k, keeps the most
--                probable ones up to and including the one whose cumulative probability reaches
--                top_p: a token goes when the tokens ranked at and below it hold <= 1 - top_p
--                (HF's and vLLM's arithmetic). The most probable token always stays.
--   min_p        number in [0, 1], default 0 (off). Of the tokens left, keeps those with
--                probability >= min_p * the largest probability.
--   seed         required when temperature > 0: an integer in [0, 2^53], or a decimal string for
--                any 64-bit seed. A greedy request may give one; it is not used.
--   sample       (the second argument) the 0-based index of this sample among a request's n
--                samples, default 0: each sample draws from its own stream.
-- Other keys are not read: sampling.keys lists the ones that are, for a caller's own check of
-- unknown keys.
--
-- The order of the steps is HF's (TemperatureLogitsWarper, TopK, TopP, MinP) and vLLM V0's:
--   s = logits / T (f32) -> top-k on s -> top-p on softmax of what top-k left -> min-p on softmax
--   of what top-p left -> draw from what is left.
-- vLLM V1 applies min-p before top-k and top-p; the two orders differ only when a request sets
-- both min_p > 0 and top_p < 1. Ties are broken by token id: the sort that ranks tokens for
-- top-p puts equal values lower id first, and greedy decoding takes the lowest id among equal
-- maxima (torch.argmax).
--
-- The draw. Row b uses one number u in [0, 1): element positions[b] of its request's stream
-- (lunar.rng(seed):split('sampling'):split(sample), rng:uniform_at), cut to 24 bits. The token is
-- the first id, in vocabulary order, whose cumulative processed probability exceeds u times the
-- total (inverse CDF; the cumulative sum is in f64, rounded to f32 per entry). A row's token and
-- logprobs are a function of its logits, its settings and u alone: every op on the way works row
-- by row with the same arithmetic whatever the batch holds (a batch with one top-p row sorts every
-- row, and a row without top-p then drops nothing, bit for bit as without the sort), so a request
-- gives the same tokens alone, in any batch and at any place in it, on a given device. The caller
-- chooses positions; generation passes the index of the token within the sample's completion
-- (0 for the first new token), so a (stream, position) pair is never used twice.
--
-- Cost: a few passes over (B, V) in f32, on the logits' device; one host-to-device copy of a
-- (B, 7) table of per-row values and no read back. A top-k row adds a top-k of the largest k in
-- the batch; a top-p row adds a full sort of every row and a scatter back to vocabulary order;
-- a batch of greedy rows only is one argmax (the same tokens and logprobs as the full steps).
-- Logits with NaN give unspecified tokens (nothing reads the logits back to check them).
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local ops = require 'lunar.ops'

local fail = tensor.fail

local M = {}

-- the settings sampling.params reads
M.keys = {'temperature', 'top_k', 'top_p', 'min_p', 'seed'}

-- the smallest positive temperature: below it vLLM decodes greedily, so a smaller value means
-- greedy to a user coming from vLLM and a division that can overflow to lunar
M.MIN_TEMPERATURE = 1e-5

local TWO_53 = 2 ^ 53
local U24 = 2 ^ 24
local INF = math.huge

-- validated settings carry this metatable, so sample() knows they went through params()
local Params = {}
Params.__index = Params

local function number_setting(opts, key, default)
    local v = opts[key]
    if v == nil then return default end
    if type(v) ~= 'number' then
        fail(('sampling: %s must be a number, got the %s %s'):format(key, type(v), tostring(v)))
    end
    if v ~= v then fail(('sampling: %s is NaN'):format(key)) end
    return v
end

-- a seed as lunar.rng takes it: a number exact in a double, or a decimal string up to 2^64 - 1
local function check_seed(seed)
    if type(seed) == 'number' then
        if seed < 0 or seed ~= math.floor(seed) or seed > TWO_53 then
            fail(('sampling: seed = %s is not an integer in [0, 2^53] (pass a larger seed as a decimal string)')
                :format(tostring(seed)))
        end
        return seed
    end
    if type(seed) == 'string' then
        local digits = seed:match('^0*(%d+)$')
        if digits and (#digits < 20 or (#digits == 20 and digits <= '18446744073709551615')) then return seed end
        fail(('sampling: seed = %q is not a decimal integer in [0, 2^64)'):format(seed))
    end
    fail(('sampling: seed must be a non-negative integer (or a decimal string), got the %s %s'):format(type(seed),
        tostring(seed)))
end

function M.params(opts, sample)
    if type(opts) ~= 'table' then
        fail(('sampling: expected a table of settings, got the %s %s'):format(type(opts), tostring(opts)))
    end
    local T = number_setting(opts, 'temperature', 1)
    if T < 0 then fail(('sampling: temperature = %s is negative (0 means greedy decoding)'):format(tostring(T))) end
    if T == INF then fail('sampling: temperature = inf is not finite') end
    if T > 0 and T < M.MIN_TEMPERATURE then
        fail(('sampling: temperature = %s is below %g, too small to divide logits by; use 0 for greedy decoding')
            :format(tostring(T), M.MIN_TEMPERATURE))
    end
    local k = number_setting(opts, 'top_k', 0)
    if k ~= math.floor(k) or k == INF then fail(('sampling: top_k = %s is not an integer'):format(tostring(k))) end
    if k < 0 then
        fail(('sampling: top_k = %s is negative; top_k = 0 turns top-k off (vLLM writes -1 for that)')
            :format(tostring(k)))
    end
    local top_p = number_setting(opts, 'top_p', 1)
    if not (top_p > 0 and top_p <= 1) then
        fail(('sampling: top_p = %s is outside (0, 1] (top_p = 1 turns top-p off)'):format(tostring(top_p)))
    end
    local min_p = number_setting(opts, 'min_p', 0)
    if not (min_p >= 0 and min_p <= 1) then
        fail(('sampling: min_p = %s is outside [0, 1] (min_p = 0 turns min-p off)'):format(tostring(min_p)))
    end
    sample = sample or 0
    if type(sample) ~= 'number' or sample < 0 or sample ~= math.floor(sample) or sample > TWO_53 then
        fail(('sampling: sample = %s is not a non-negative integer (the index of a sample of the request)')
            :format(tostring(sample)))
    end
    local seed = opts.seed
    if seed ~= nil then seed = check_seed(seed) end
    local p = setmetatable({temperature = T, top_k = k, top_p = top_p, min_p = min_p, seed = seed, sample = sample},
                           Params)
    if T > 0 then
        if seed == nil then
            fail('sampling: seed is required when temperature > 0 (each request draws from its own stream)')
        end
        p.stream = core.rng_new(seed):split('sampling'):split(sample)
    end
    return p
end

-- the per-row values as a (B, 7) f64 table, one copy to the device; columns:
local COL_T, COL_KIDX, COL_KOFF, COL_PTHR, COL_MINP, COL_U, COL_GREEDY = 1, 2, 3, 4, 5, 6, 7
local NCOL = 7

local function row_values(params, positions, B, V)
    local flat = {}
    local kmax, any_k, any_p, any_min_p, all_greedy = 0, false, false, false, true
    for b = 1, B do
        local p = params[b]
        if getmetatable(p) ~= Params then
            fail(('sampling.sample: params[%d] was not made by sampling.params'):format(b))
        end
        local pos = positions[b]
        if type(pos) ~= 'number' or pos < 0 or pos ~= math.floor(pos) or pos > TWO_53 then
            fail(('sampling.sample: positions[%d] = %s is not a non-negative integer'):format(b, tostring(pos)))
        end
        local o = (b - 1) * NCOL
        if p.temperature == 0 then
            -- greedy as a draw: the max value and its ties stay (top-k 1), and u = 0 takes the
            -- first of them in id order, torch.argmax's choice
            flat[o + COL_T], flat[o + COL_KIDX], flat[o + COL_KOFF] = 1, 0, 0
            flat[o + COL_PTHR], flat[o + COL_MINP], flat[o + COL_U], flat[o + COL_GREEDY] = -1, 0, 0, 1
            kmax, any_k = math.max(kmax, 1), true
        else
            local k = math.min(p.top_k, V)
            flat[o + COL_T] = p.temperature
            flat[o + COL_KIDX], flat[o + COL_KOFF] = math.max(k - 1, 0), k == 0 and 1 or 0
            if k > 0 then kmax, any_k = math.max(kmax, k), true end
            -- a token goes when the mass at and below it is <= 1 - top_p; -1 drops nothing
            flat[o + COL_PTHR] = p.top_p < 1 and 1 - p.top_p or -1
            any_p = any_p or p.top_p < 1
            flat[o + COL_MINP] = p.min_p
            any_min_p = any_min_p or p.min_p > 0
            flat[o + COL_U] = math.floor(p.stream:uniform_at(pos) * U24) / U24
            flat[o + COL_GREEDY] = 0
            all_greedy = false
        end
    end
    return flat, {kmax = kmax, any_k = any_k, any_p = any_p, any_min_p = any_min_p, all_greedy = all_greedy}
end

-- the column c of the (B, NCOL) table as a (B, 1) tensor of dtype dt
local function column(P, c, dt)
    return P:select(2, c):to(dt):view(P:size(1), 1)
end

-- z (B, V): the tokens of each row that top-p (COL_PTHR) drops set to -inf, in place. The ranking
-- is a full sort (ties lower id first); the verdicts go back to vocabulary order by a scatter.
local function apply_top_p(z, pthr)
    local B, V = z:size(1), z:size(2)
    local vals, idx = ops.topk(z, V)
    local q = ops.softmax(vals)
    vals:free()
    local tail = ops.cumsum_backward(q, 2)        -- tail[j] = sum of q[j..V-1], from the smallest up
    q:free()
    local drop = ops.le(tail, pthr, {dtype = 'f32'})
    tail:free()
    drop:narrow(2, 1, 1):fill_(0)                 -- the most probable token stays
    local dropped = ops.scatter_(core.empty({B, V}, 'f32', z:device()), 2, idx, drop)
    drop:free()
    idx:free()
    local mask = ops.ne(dropped, 0)
    dropped:free()
    ops.masked_fill_(z, mask, -INF)
    mask:free()
end

-- the first id of each row whose cumulative weight exceeds u * total: (B) i64
local function draw(weights, u)
    local V = weights:size(2)
    local cdf = ops.cumsum(weights, 2)
    -- u <= 1 - 2^-24, so u * total rounds below total and some entry exceeds it; that entry
    -- raised the sum, so its weight is positive
    local target = ops.mul(u, cdf:narrow(2, V, 1))
    local hit = ops.gt(cdf, target, {dtype = 'f32'})
    cdf:free()
    local token = ops.argmax(hit, 2)
    hit:free()
    return token
end

-- log_softmax(z)[token] of each row, (B) f32: the fused cross-entropy the trainer's log-probs
-- come from
local function token_logprobs(z, tokens)
    local loss, logprobs, lse = ops.cross_entropy(z, tokens)
    loss:free()
    lse:free()
    return logprobs
end

function M.sample(logits, params, positions, opts)
    opts = opts or {}
    tensor.check(logits, 'logits', 'sampling.sample')
    if logits:dim() ~= 2 or not tensor.FLOAT_DTYPES[logits:dtype()] then
        fail(('sampling.sample: logits must be a (B, V) float tensor, got %s (%s)'):format(logits:dtype(),
            table.concat(logits:size(), ', ')))
    end
    local B, V = logits:size(1), logits:size(2)
    if type(params) ~= 'table' or #params ~= B then
        fail(('sampling.sample: logits has %d rows but params is %s'):format(B,
            type(params) == 'table' and ('a list of ' .. #params) or ('a ' .. type(params))))
    end
    if type(positions) ~= 'table' or #positions ~= B then
        fail(('sampling.sample: logits has %d rows but positions is %s'):format(B,
            type(positions) == 'table' and ('a list of ' .. #positions) or ('a ' .. type(positions))))
    end
    if V == 0 then fail('sampling.sample: logits has no vocabulary (V = 0)') end
    local dev = logits:device()
    if B == 0 then
        local out = {tokens = core.empty({0}, 'i64', dev), logprobs = core.empty({0}, 'f32', dev)}
        if opts.processed_logprobs then out.processed_logprobs = core.empty({0}, 'f32', dev) end
        return out
    end
    local flat, any = row_values(params, positions, B, V)
    local P = core.from_flat(flat, {B, NCOL}, 'f64', dev)

    local x = logits:to('f32')
    local s = ops.div(x, column(P, COL_T, 'f32'))            -- the temperature-scaled logits
    if x ~= logits then x:free() end
    if any.all_greedy then
        -- argmax picks the token the draw below would (the lowest id among equal maxima) in one pass
        local tokens = ops.argmax(s, 2)
        local out = {tokens = tokens, logprobs = token_logprobs(s, tokens)}
        if opts.processed_logprobs then out.processed_logprobs = core.empty({B}, 'f32', dev):fill_(0) end
        s:free()
        P:free()
        return out
    end
    -- the processed logits: s itself when no row truncates
    local truncates = any.any_k or any.any_p or any.any_min_p
    if not truncates and dev:match('^cpu') then
        -- one pass per row on the CPU: max, total, then the running sum up to the draw
        local tokens, logprobs = ops.sample_rows(s, column(P, COL_U, 'f32'):view(B))
        local out = {tokens = tokens, logprobs = logprobs}
        if opts.processed_logprobs then out.processed_logprobs = logprobs:clone() end
        s:free()
        P:free()
        return out
    end
    local z = truncates and s:clone() or s
    if any.any_k then
        -- the k-th largest value of each row (a value, so the same whatever the batch's largest k)
        local vals = ops.topk(s, any.kmax)
        local kth = ops.gather(vals, 2, column(P, COL_KIDX, 'i64'))
        vals:free()
        ops.masked_fill_(kth, ops.ne(column(P, COL_KOFF, 'f32'), 0), -INF)
        local below = ops.lt(s, kth)
        ops.masked_fill_(z, below, -INF)
        below:free()
    end
    if any.any_p then apply_top_p(z, column(P, COL_PTHR, 'f32')) end
    local prob = ops.softmax(z)
    if any.any_min_p then
        local pmax = ops.max(prob, 2, {keepdim = true})
        local low = ops.lt(prob, ops.mul(pmax, column(P, COL_MINP, 'f32')))
        ops.masked_fill_(prob, low, 0)
        ops.masked_fill_(z, low, -INF)
        low:free()
    end
    local tokens = draw(prob, column(P, COL_U, 'f32'))
    prob:free()

    local out = {tokens = tokens, logprobs = token_logprobs(s, tokens)}
    if opts.processed_logprobs then
        local plp = token_logprobs(z, tokens)
        -- a greedy row's processed distribution is the point mass on its token
        out.processed_logprobs = ops.masked_fill_(plp, ops.ne(P:select(2, COL_GREEDY), 0), 0)
    end
    if z ~= s then z:free() end
    s:free()
    P:free()
    return out
end

return M
