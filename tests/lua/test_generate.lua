-- test_generate.lua: lunar.generate, the engine (continuous batching over the KV cache, sampling,
-- stops, outputs), f32 on CPU unless said:
--   * a prompt's n samples above max_batch are admitted together and the cache holds them;
--   * requests that join and leave mid-run (a small max_batch, prompts of other lengths, stops at
--     other steps) give each request ids and logprobs bit-identical to that request generated
--     alone with the same seed, greedy and sampled, n samples sharing a prefill included; so
--     does a full batch of 32 prompts (64 samples), in which an expert gets many rows;
--   * the logprobs equal the training forward's per-token logprobs of the same sequences within
--     1e-5 (f32); on the bf16 fixture the mean absolute gap is below 0.004;
--   * routing recorded during generation, replayed in the training forward, selects the same
--     experts, even after the router's weights changed;
--   * stop strings cut the text before them (also one that spans tokens), stop ids end a sample,
--     max_new_tokens ends it with 'length'; chat prompts render with the generation prompt;
--   * bad input: an empty prompt, a prompt as long as the context, top_p 0, a negative
--     temperature, a budget too small for one sequence, an unknown option.
local lunar = require 'lunar'
local ops = lunar.ops
local T = require('lunar.testing').suite('generate')

local ROOT = 'tests/fixtures/models/'

local function prompt(n, V, salt)
    local p = {}
    for j = 1, n do p[j] = (j * 7 + salt * 13 + j * j * salt) % V end
    return p
end

local function same_list(a, b, what)
    if #a ~= #b then error(('%s: %d entries vs %d'):format(what, #a, #b), 2) end
    for i = 1, #a do
        if a[i] ~= b[i] then error(('%s: entry %d is %.17g vs %.17g'):format(what, i, a[i], b[i]), 2) end
    end
end

local function refuses(fn, want)
    local ok, err = pcall(fn)
    assert(not ok, 'expected an error mentioning ' .. want)
    assert(tostring(err):find(want, 1, true), ('error %q does not mention %q'):format(tostring(err), want))
end

-- per-token logprobs of the training forward for prompt + completion: the completion's entries
local function forward_logprobs(model, prompt_ids, ids, routing)
    local all = {}
    for _, t in ipairs(prompt_ids) do all[#all + 1] = t end
    for _, t in ipairs(ids) do all[#all + 1] = t end
    local n = #all
    local x = lunar.tensor(all, {dtype = 'i64'}):view(1, n)
    local batch = {input_ids = x, labels = x, routing = routing}
    return lunar.scope(function()
        local out = model:forward(batch, {logprobs = true, keep = false})
        local lp = out.logprobs:view(n):to('f32'):tolist_flat()
        local r = {}
        -- logprobs[s] is the log-probability of token s + 1 given 1..s
        for k = 1, #ids do r[k] = lp[#prompt_ids + k - 1] end
        return r, out.routing
    end)
end

T:test('continuous batching: each request as if alone, greedy and sampled, bit for bit', function()
    local model = lunar.model.load(ROOT .. 'glm5_dsa')
    local V = model.cfg.vocab_size
    local prompts = {}
    for i = 1, 7 do prompts[i] = {ids = prompt(3 + 5 * i, V, i), seed = 100 + i} end
    -- stop ids that end some samples early, so others join as they leave (max_batch 3)
    for _, cfg in ipairs({{temperature = 0}, {temperature = 0.9, top_k = 20, top_p = 0.9, n = 2}}) do
        local opts = {max_new_tokens = 12, max_batch = 3, stop_token_ids = {}}
        for k, v in pairs(cfg) do opts[k] = v end
        -- stop ids: tokens some samples produce early (so they leave and others join mid-run)
        local probe = lunar.generate(model, prompts, opts)
        opts.stop_token_ids = {probe[2].ids[4], probe[#probe - 1].ids[6]}
        local together = lunar.generate(model, prompts, opts)
        T.equal(#together, #prompts * (cfg.n or 1), 'one result per sample')
        local stopped = 0
        for _, r in ipairs(together) do if r.finish_reason == 'stop' then stopped = stopped + 1 end end
        assert(stopped > 0 and stopped < #together, ('some samples stop early (%d of %d)'):format(stopped, #together))
        for _, r in ipairs(together) do
            local alone = lunar.generate(model, {prompts[r.prompt]}, opts)[r.sample]
            same_list(r.ids, alone.ids, ('prompt %d sample %d ids'):format(r.prompt, r.sample))
            same_list(r.logprobs, alone.logprobs, ('prompt %d sample %d logprobs'):format(r.prompt, r.sample))
            assert(r.finish_reason == alone.finish_reason, 'finish reason')
        end
        -- and in another order, with another batch size
        local rev = {}
        for i = #prompts, 1, -1 do rev[#rev + 1] = prompts[i] end
        opts.max_batch = 5
        local back = lunar.generate(model, rev, opts)
        for _, r in ipairs(back) do
            local fwd = together[(#prompts - r.prompt) * (cfg.n or 1) + r.sample]
            same_list(r.ids, fwd.ids, 'reversed order')
        end
    end
end)

T:test('n samples above max_batch: a prompt\'s samples are admitted together, the cache holds them', function()
    local model = lunar.model.load(ROOT .. 'glm5_dsa')
    local V = model.cfg.vocab_size
    local prompts = {{ids = prompt(5, V, 1), seed = 31}, {ids = prompt(21, V, 2), seed = 32}}
    local opts = {max_new_tokens = 20, temperature = 1, n = 4, max_batch = 4, stop_token_ids = {}}
    local wide = lunar.generate(model, prompts, opts)
    for _, mb in ipairs({1, 2, 3}) do
        opts.max_batch = mb
        local narrow = lunar.generate(model, prompts, opts)
        T.equal(#narrow, #wide, 'max_batch ' .. mb .. ': one result per sample')
        for k, r in ipairs(narrow) do
            T.equal(#r.ids, 20, ('max_batch %d prompt %d sample %d: every token generated'):format(mb, r.prompt, r.sample))
            same_list(r.ids, wide[k].ids, ('max_batch %d prompt %d sample %d ids'):format(mb, r.prompt, r.sample))
        end
    end
end)

T:test('a full batch (32 sequences: an expert gets many rows) gives each request its bits alone', function()
    -- every product of a decode step is row-invariant (lunar.ops.gemm's row_invariant): BLAS's
    -- sgemm changes a row's bits once a product has more rows (4 on one thread, 13 on two here),
    -- which the small batches above never reach
    for _, name in ipairs({'glm5_dsa', 'glm4moe'}) do
        local model = lunar.model.load(ROOT .. name)
        local V = model.cfg.vocab_size
        local prompts = {}
        for i = 1, 32 do prompts[i] = {ids = prompt(3 + (i * 5) % 23, V, i), seed = 200 + i} end
        for _, cfg in ipairs({{temperature = 0}, {temperature = 0.9, top_p = 0.95, n = 2}}) do
            local opts = {max_new_tokens = 8, max_batch = 64, stop_token_ids = {}}
            for k, v in pairs(cfg) do opts[k] = v end
            local together = lunar.generate(model, prompts, opts)
            for _, r in ipairs(together) do
                local alone = lunar.generate(model, {prompts[r.prompt]}, opts)[r.sample]
                local what = ('%s T %g prompt %d sample %d'):format(name, cfg.temperature, r.prompt, r.sample)
                same_list(r.ids, alone.ids, what .. ' ids')
                same_list(r.logprobs, alone.logprobs, what .. ' logprobs')
            end
        end
    end
end)

T:test('logprobs equal the training forward within 1e-5 (f32); below 0.004 mean gap in bf16', function()
    for _, name in ipairs({'glm5_dsa', 'glm4moe'}) do
        local model = lunar.model.load(ROOT .. name)
        local V = model.cfg.vocab_size
        local res = lunar.generate(model, {prompt(9, V, 1), prompt(30, V, 2)},
            {max_new_tokens = 16, temperature = 0.8, seed = 3})
        for _, r in ipairs(res) do
            -- sampled at temperature 0.8, whose logprobs are of logits / 0.8; the sequences are
            -- then scored greedily (temperature 1 logprobs) against the forward
            local g = lunar.generate(model, {r.prompt_ids}, {max_new_tokens = 16})[1]
            local wg = forward_logprobs(model, g.prompt_ids, g.ids)
            for k = 1, #g.ids do
                local d = math.abs(g.logprobs[k] - wg[k])
                assert(d <= 1e-5, ('%s token %d: generation %.9g, forward %.9g'):format(name, k, g.logprobs[k], wg[k]))
            end
        end
    end
    local model = lunar.model.load(ROOT .. 'glm5_bf16', {dtype = 'bf16'})
    local V = model.cfg.vocab_size
    local res = lunar.generate(model, {prompt(20, V, 1), prompt(40, V, 2), prompt(9, V, 3)}, {max_new_tokens = 48})
    local sum, n = 0, 0
    for _, r in ipairs(res) do
        local want = forward_logprobs(model, r.prompt_ids, r.ids)
        for k = 1, #r.ids do sum, n = sum + math.abs(r.logprobs[k] - want[k]), n + 1 end
    end
    local gap = sum / n
    print(('      bf16 mean absolute logprob gap, generation vs training forward: %.5f over %d tokens'):format(gap, n))
    assert(gap < 0.004, ('bf16 gap %.5f'):format(gap))
end)

T:test('routing recorded in generation replays in the training forward, also over a changed router', function()
    local model = lunar.model.load(ROOT .. 'glm5_dsa')
    local V = model.cfg.vocab_size
    local res = lunar.generate(model, {prompt(12, V, 4), prompt(25, V, 5)}, {max_new_tokens = 10, routing = true})
    for _, r in ipairs(res) do
        local n = #r.prompt_ids + #r.ids
        local layers = 0
        for layer, idx in pairs(r.routing) do
            layers = layers + 1
            T.equal(idx:size(1), n, 'a row per token of prompt and completion')
        end
        assert(layers > 0, 'routing of the MoE layers')
        -- the training forward without replay routes the same way
        local _, routed = forward_logprobs(model, r.prompt_ids, r.ids)
        for layer, idx in pairs(r.routing) do T.equal(routed[layer].idx, idx, 'layer ' .. layer .. ' experts') end
    end
    -- change every router: without replay the experts move, with replay they are the recorded ones
    local r = res[1]
    for name, t in pairs(model:parameters()) do
        if name:find('%.mlp%.gate%.weight$') then t:copy_(lunar.randn(t:size(1), t:size(2), {rng = lunar.rng(9)})) end
    end
    local _, moved = forward_logprobs(model, r.prompt_ids, r.ids)
    local differ = false
    for layer, idx in pairs(r.routing) do
        local a, b = moved[layer].idx:tolist_flat(), idx:tolist_flat()
        for k = 1, #a do if a[k] ~= b[k] then differ = true end end
    end
    assert(differ, 'a new router routes differently')
    local _, replayed = forward_logprobs(model, r.prompt_ids, r.ids, r.routing)
    for layer, idx in pairs(r.routing) do T.equal(replayed[layer].idx, idx, 'replayed layer ' .. layer) end
end)

T:test('stops: strings (also across tokens), stop ids, length; chat prompts', function()
    local preset = dofile('recipes/presets/tiny.lua')
    local model = lunar.model.new(preset.common.model.config, {seed = 5})
    local tok = lunar.tokenizer.load('recipes/presets/tiny/tokenizer.json')
    local chat = {{role = 'user', content = 'What is 2 + 3?'}}
    local opts = {tokenizer = tok, max_new_tokens = 24, temperature = 1, seed = 11, stop_token_ids = {}}
    local base = lunar.generate(model, {chat}, opts)[1]
    T.equal(#base.ids, 24, 'no stop: max_new_tokens')
    assert(base.finish_reason == 'length', base.finish_reason)
    -- a stop string that spans two tokens: the end of token 5's text and the start of token 6's
    local pieces = {}
    for k = 1, #base.ids do pieces[k] = tok:decode({base.ids[k]}, {skip_special = true}) end
    local k = 5
    while k < 20 and (#pieces[k] == 0 or #pieces[k + 1] == 0) do k = k + 1 end
    local stop = pieces[k]:sub(-1) .. pieces[k + 1]:sub(1, 1)
    local o2 = {}
    for kk, v in pairs(opts) do o2[kk] = v end
    o2.stop = {stop}
    local cut = lunar.generate(model, {chat}, o2)[1]
    assert(cut.finish_reason == 'stop' and cut.stop_reason == stop, cut.finish_reason)
    local at = base.text:find(stop, 1, true)
    assert(cut.text == base.text:sub(1, at - 1), ('text %q, want %q'):format(cut.text, base.text:sub(1, at - 1)))
    assert(#cut.ids <= k + 1 and #cut.ids >= 1, 'ids end at the token that completed the stop string')
    -- of two stop strings, the one that comes first in the text ends it
    o2.stop = {pieces[k + 3] .. pieces[k + 4], stop}
    local first = lunar.generate(model, {chat}, o2)[1]
    assert(first.stop_reason == stop and first.text == cut.text, 'the earlier stop string')
    -- streaming: on_token sees the text so far, which ends as the result's
    local seen = {}
    local o4 = {}
    for kk, v in pairs(opts) do o4[kk] = v end
    o4.on_token = function(r) seen[#seen + 1] = r.text end
    local streamed = lunar.generate(model, {chat}, o4)[1]
    T.equal(#seen, #streamed.ids, 'one call per token')
    assert(seen[#seen] == streamed.text and streamed.text == base.text, 'the streamed text')
    -- a stop id: the sample ends with it
    local o3 = {}
    for kk, v in pairs(opts) do o3[kk] = v end
    o3.stop_token_ids = {base.ids[6]}
    local byid = lunar.generate(model, {chat}, o3)[1]
    assert(byid.finish_reason == 'stop' and byid.ids[#byid.ids] == base.ids[6], 'stop id')
    same_list(byid.ids, {unpack(base.ids, 1, #byid.ids)}, 'the same tokens up to the stop')
    -- default stop ids of a chat: the model's eos and the template's end-of-turn tokens
    local def = lunar.generate(model, {chat}, {tokenizer = tok, max_new_tokens = 4})[1]
    -- the generation prompt ends the rendered chat: <|assistant|>, then <think> (thinking on)
    same_list({def.prompt_ids[#def.prompt_ids - 1], def.prompt_ids[#def.prompt_ids]},
        {tok:token_to_id('<|assistant|>'), tok:token_to_id('<think>')}, 'the generation prompt')
end)

T:test('bad input gives clear errors', function()
    local model = lunar.model.load(ROOT .. 'glm5_dsa')
    local V = model.cfg.vocab_size
    refuses(function() lunar.generate(model, {{}}, {}) end, 'prompt 1 is empty')
    local long = prompt(model.cfg.max_position_embeddings, V, 1)
    refuses(function() lunar.generate(model, {{1, 2}, long}, {}) end, 'prompt 2 has ' .. #long .. ' tokens')
    refuses(function() lunar.generate(model, {{1, 2}}, {temperature = 1, top_p = 0, seed = 1}) end, 'top_p')
    refuses(function() lunar.generate(model, {{1, 2}}, {temperature = -1}) end, 'temperature')
    refuses(function() lunar.generate(model, {{1, 2}}, {temperature = 0.5}) end, 'seed')
    refuses(function() lunar.generate(model, {{1, 2}}, {budget_bytes = 1000}) end, 'needs')
    refuses(function() lunar.generate(model, {{1, 2}}, {max_new = 3}) end, 'unknown option "max_new"')
    refuses(function() lunar.generate(model, {{1, V}}, {}) end, 'token 2 is ' .. V)
    refuses(function() lunar.generate(model, {'text'}, {}) end, 'pass opts.tokenizer')
    refuses(function() lunar.generate(model, {{1}}, {stop = 'x'}) end, 'stop strings need opts.tokenizer')
end)

os.exit(T:run())
