-- lunar.generate: generation with the model lunar trains, its tensors and kernels: a KV cache in
-- blocks (lunar.generate.cache), prefill and decode steps (lunar.generate.decode), per-request
-- sampling (lunar.generate.sampling) and continuous batching. No copy of the weights, no sync,
-- and the logprobs of the training forward.
--
--   local results = lunar.generate(model, prompts, opts)
--   for _, r in ipairs(results) do print(r.text, r.finish_reason) end
--
-- prompts: a list; each one is a list of 0-based token ids, a 1-D integer tensor, a chat
-- conversation (a list of {role =, content =} messages, or {messages =, tools =}: rendered with
-- lunar.chat, add_generation_prompt = true, and encoded; needs opts.tokenizer), or a string
-- (encoded as it is; needs opts.tokenizer). A prompt table may also carry its own seed.
--
-- opts (defaults in brackets):
--   max_new_tokens [256]   tokens to generate at most per sample (a sample also stops at the
--                          model's context, max_seq_len, with finish_reason 'length')
--   n [1]                  samples per prompt; they share one prefill
--   temperature [0]        0 is greedy (argmax); top_k [0 = off], top_p [1], min_p [0]
--                          (lunar.generate.sampling has the exact rules)
--   seed                   required when temperature > 0: prompt i uses seed + i - 1 unless its
--                          table has a seed; sample j of it draws from its own stream (j), token t
--                          of the completion at position t of that stream, so a sample is the
--                          same alone or in any batch
--   stop_token_ids         ids that end a sample (they are part of its ids) [the model's
--                          eos_token_id, those of generation_config.json beside a loaded
--                          checkpoint, and for chat prompts the template's <|user|> and
--                          <|observation|> when the tokenizer has them]
--   stop                   strings that end a sample: the text is cut before the first one (a
--                          stop string may span tokens; needs a tokenizer); ids keep the token
--                          that completed it
--   tokenizer              lunar.tokenizer (or a path) for text, chat prompts and stop strings;
--                          without one results carry no text
--   template ['glm5'], enable_thinking         for chat prompts (lunar.chat)
--   processed_logprobs [false]  also each token's logprob under the processed distribution
--   routing [false]        the routed experts of every token (prompt and completion) at every
--                          MoE layer, {[layer] = (T, K) i64 on the CPU}, the form
--                          model:forward's batch.routing (R3) replays
--   budget_bytes           the cache's budget [what max_batch sequences of the longest length
--                          take]; max_batch [64] sequences decode together at most;
--                          block_size [16]
--   on_token               function(result, token) called after each new token of a sample
--                          (streaming: result.ids and, with a tokenizer, result.text so far)
--   quiet [true]           false prints the cache's size and a final line of tokens/s
--
-- Each result (one per sample, prompt by prompt, sample by sample): {prompt = i, sample = j
-- (1-based), prompt_ids, ids (the completion), text, logprobs (list: log_softmax(logits / T) at
-- each token, T = 1 for greedy), processed_logprobs, finish_reason ('stop' | 'length'),
-- stop_reason (the stop token id or string), routing}.
--
-- Continuous batching: samples decode together while the cache has room; each admitted prompt
-- reserves the blocks its samples can reach (prompt + max_new_tokens), so nothing is ever
-- preempted; a finished sample frees its blocks at once and the next prompt takes them.
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local ops = require 'lunar.ops'
local Cache = require 'lunar.generate.cache'
local decode = require 'lunar.generate.decode'
local sampling = require 'lunar.generate.sampling'
local gpar = require 'lunar.generate.parallel'

local fail = tensor.fail

local M = {cache = Cache, decode = decode, sampling = sampling}

local OPTS = {max_new_tokens = true, n = true, temperature = true, top_k = true, top_p = true, min_p = true,
    seed = true, stop_token_ids = true, stop = true, tokenizer = true, template = true, enable_thinking = true,
    processed_logprobs = true, routing = true, budget_bytes = true, max_batch = true, block_size = true,
    on_token = true, quiet = true}

local function is_int(v) return type(v) == 'number' and v == math.floor(v) end

local function check_opts(opts)
    if type(opts) ~= 'table' then fail('generate: opts must be a table, got a ' .. type(opts)) end
    for k in pairs(opts) do
        if not OPTS[k] then
            local known = {}
            for name in pairs(OPTS) do known[#known + 1] = name end
            table.sort(known)
            fail(('generate: unknown option %q (known: %s)'):format(tostring(k), table.concat(known, ', ')))
        end
    end
    local function int(k, min)
        local v = opts[k]
        if v ~= nil and (not is_int(v) or v < min) then
            fail(('generate: %s must be an integer >= %d, got %s'):format(k, min, tostring(v)))
        end
    end
    int('max_new_tokens', 1)
    int('n', 1)
    int('max_batch', 1)
    int('block_size', 1)
    int('budget_bytes', 1)
    if opts.stop ~= nil then
        local stop = type(opts.stop) == 'string' and {opts.stop} or opts.stop
        if type(stop) ~= 'table' then fail('generate: stop must be a string or a list of strings') end
        for i, s in ipairs(stop) do
            if type(s) ~= 'string' or s == '' then fail(('generate: stop string %d must be a non-empty string'):format(i)) end
        end
        if #stop > 0 and not opts.tokenizer then fail('generate: stop strings need opts.tokenizer (to see the text)') end
    end
end

-- ---- prompts --------------------------------------------------------------------------------------

local function is_message_list(p)
    return type(p) == 'table' and type(p[1]) == 'table' and p[1].role ~= nil
end

-- the token ids of prompt i, and whether it was a chat
local function prompt_ids(p, i, opts, tok)
    if tensor.is_tensor(p) then
        if p:dim() ~= 1 then fail(('generate: prompt %d is a tensor of %d dims; a prompt tensor is 1-D'):format(i, p:dim())) end
        return p:to('cpu'):tolist_flat(), false
    end
    local messages
    if type(p) == 'string' then
        if not tok then fail(('generate: prompt %d is text; pass opts.tokenizer'):format(i)) end
        return tok:encode(p, {special = true}), false
    elseif is_message_list(p) then
        messages = p
    elseif type(p) == 'table' and p.messages then
        messages = p.messages
    elseif type(p) == 'table' and p.ids then
        return prompt_ids(p.ids, i, opts, tok)
    elseif type(p) == 'table' then
        return p, false
    else
        fail(('generate: prompt %d is a %s; a prompt is a list of token ids, a 1-D tensor, a string or a chat'):format(
            i, type(p)))
    end
    if not tok then fail(('generate: prompt %d is a chat; pass opts.tokenizer'):format(i)) end
    local text = require('lunar.chat').render(messages, {template = opts.template or 'glm5',
        tools = type(p) == 'table' and p.tools or nil, add_generation_prompt = true,
        enable_thinking = opts.enable_thinking})
    return tok:encode(text, {special = true}), true
end

-- the stop token ids: opts.stop_token_ids, else the model's eos ids (config.json, and
-- generation_config.json beside a loaded checkpoint), and the chat template's end-of-turn tokens
local function stop_ids(model, opts, tok, any_chat)
    local set, list = {}, {}
    local function add(v)
        if type(v) == 'table' then for _, x in ipairs(v) do add(x) end
        elseif is_int(v) and not set[v] then set[v] = true; list[#list + 1] = v end
    end
    if opts.stop_token_ids ~= nil then
        add(opts.stop_token_ids)
        return set, list
    end
    add(model.cfg.eos_token_id)
    local dir = model.source and model.source.path
    if dir then
        local ok, gc = pcall(require('lunar.io').read_json, dir .. '/generation_config.json')
        if ok and type(gc) == 'table' then add(gc.eos_token_id) end
    end
    if any_chat and tok then
        for _, t in ipairs({'<|user|>', '<|observation|>'}) do add(tok:token_to_id(t)) end
    end
    return set, list
end

-- ---- the run ------------------------------------------------------------------------------------

local function tokenizer_of(opts)
    local tok = opts.tokenizer
    if type(tok) == 'string' then tok = require('lunar.tokenizer').load(tok) end
    return tok
end

-- the leftmost occurrence of any stop string starting at or after byte `from` (less each stop
-- string's length, so one that began a little earlier is found too): its start and the string
local function find_stop(text, stops, from)
    local best, which
    for _, s in ipairs(stops) do
        local at = text:find(s, math.max(1, from - #s + 1), true)
        if at and (not best or at < best) then best, which = at, s end
    end
    return best, which
end

-- generate(model, prompts, opts) -> results (see the header)
function M.run(model, prompts, opts)
    opts = opts or {}
    check_opts(opts)
    if type(model) ~= 'table' or not model.cfg or not model.params then fail('generate: expected a lunar model') end
    local par = gpar.of(model)
    -- under expert parallel a rank with no prompts still takes part in the others' forwards
    if type(prompts) ~= 'table' or (#prompts == 0 and not (par and par.lockstep)) then
        fail('generate: prompts must be a non-empty list')
    end
    local tok = tokenizer_of(opts)
    local max_new = opts.max_new_tokens or 256
    local nsamp = opts.n or 1
    local stops = type(opts.stop) == 'string' and {opts.stop} or (opts.stop or {})
    local V = model.cfg.vocab_size

    -- the requests: prompt ids, sampling params of each sample
    local reqs, any_chat, longest = {}, false, 0
    for i, p in ipairs(prompts) do
        local ids, chat = prompt_ids(p, i, opts, tok)
        if #ids == 0 then fail(('generate: prompt %d is empty (no token to start from)'):format(i)) end
        for j, t in ipairs(ids) do
            if not is_int(t) or t < 0 or t >= V then
                fail(('generate: prompt %d, token %d is %s, not a token id in [0, %d)'):format(i, j, tostring(t), V))
            end
        end
        any_chat = any_chat or chat
        local seed = type(p) == 'table' and not tensor.is_tensor(p) and p.seed or nil
        if seed == nil and opts.seed ~= nil then seed = opts.seed + (i - 1) end
        local params = {}
        for j = 1, nsamp do
            params[j] = sampling.params({temperature = opts.temperature or 0, top_k = opts.top_k, top_p = opts.top_p,
                min_p = opts.min_p, seed = seed}, j - 1)
        end
        reqs[i] = {index = i, ids = ids, params = params, seed = seed}
        longest = math.max(longest, #ids)
    end
    local stop_set = stop_ids(model, opts, tok, any_chat)

    -- the cache: every sequence up to the model's context, at most max_batch of them at once (or
    -- one prompt's n samples, which are admitted together when n is above max_batch)
    local max_seq = model.cfg.max_position_embeddings
    for _, r in ipairs(reqs) do
        if #r.ids >= max_seq then
            fail(('generate: prompt %d has %d tokens; the model\'s context (max_position_embeddings) is %d, which '
                .. 'leaves no room for a new token'):format(r.index, #r.ids, max_seq))
        end
    end
    local max_batch = opts.max_batch or 64
    local need_len = math.min(longest + max_new, max_seq)
    local budget = opts.budget_bytes
    -- the sequences alive at once: a model with per-sequence state (KDA) needs a slot for each
    local alive = math.max(1, math.min(math.max(max_batch, nsamp), #reqs * nsamp))
    local plan = Cache.plan(model, {budget_bytes = 2 ^ 50, block_size = opts.block_size, max_seq_len = need_len,
                                    max_sequences = 1})
    local nseq = plan.bytes_per_sequence > 0 and alive or nil
    local block = plan.block_size
    if not budget then
        local per_seq = math.ceil(need_len / plan.block_size) * plan.block_size * plan.bytes_per_token
            + plan.bytes_per_sequence
        budget = plan.overhead_bytes + per_seq * alive
    end
    if par and par.tp then
        -- (everything that decides the batches and the tokens: the members must form the same ones)
        local lists, what = {}, {max_new, nsamp, opts.temperature or 0, opts.top_k or 0, opts.top_p or 1, opts.min_p or 0,
            max_batch, block, budget, opts.routing and 1 or 0, opts.processed_logprobs and 1 or 0}
        for i, r in ipairs(reqs) do lists[i] = r.ids; what[#what + 1] = r.seed or '-' end
        for _, st in ipairs(stops) do what[#what + 1] = st end
        local ids = {}
        for t in pairs(stop_set) do ids[#ids + 1] = t end
        table.sort(ids)
        for _, t in ipairs(ids) do what[#what + 1] = t end
        gpar.same_requests(par, lists, table.concat(what, ','))
    end
    local cache = Cache.new(model, {budget_bytes = budget, block_size = block, max_seq_len = need_len,
                                    max_sequences = nseq})
    if opts.quiet == false then print('[lunar] generate: ' .. cache:summary()) end

    -- adapters: no dropout while generating
    local adapters = model.params.lora
    local was_training = adapters and adapters.training
    if was_training then adapters:eval() end

    local results, all, waiting, active = {}, {}, {}, {}
    local scope = require('lunar').scope
    for i, r in ipairs(reqs) do waiting[i] = r end
    local next_wait, reserved = 1, 0
    local total_blocks = cache:capacity() / block
    local t0, new_tokens = core.clock(), 0

    -- blocks a request's samples can reach: every sample its own copy of the last prompt block
    -- and the rest of its completion (forks share the full prompt blocks)
    local function blocks_of(r)
        local len = math.min(#r.ids + max_new, max_seq)
        local shared = math.floor(#r.ids / block)
        return shared + nsamp * (math.ceil(len / block) - shared)
    end

    local function finish(s, reason, why)
        s.result.finish_reason, s.result.stop_reason = reason, why
        s.done = true
    end

    -- appends token t (with its logprobs) to sample s; ends s on a stop token, string or length
    -- stop strings are looked for in the text of the last few tokens (every token but a special
    -- one has at least a byte, so this many cover the longest stop string and the newest token);
    -- the whole text is decoded once, when the sample ends (or at each token for on_token)
    local tail_tokens = 2
    for _, st in ipairs(stops) do tail_tokens = math.max(tail_tokens, #st + 2) end

    local function full_text(res) return tok:decode(res.ids, {skip_special = true, skip_unknown = true}) end

    -- appends token t (with its logprobs) to sample s; ends s on a stop token, string or length
    local function push(s, t, lp, plp)
        local res = s.result
        res.ids[#res.ids + 1] = t
        res.logprobs[#res.logprobs + 1] = lp
        if opts.processed_logprobs then res.processed_logprobs[#res.processed_logprobs + 1] = plp end
        new_tokens = new_tokens + 1
        if #stops > 0 then
            local n = #res.ids
            local tail = tok:decode({unpack(res.ids, math.max(1, n - tail_tokens + 1), n)},
                {skip_special = true, skip_unknown = true})
            if find_stop(tail, stops, 1) then
                -- a stop string has just appeared: the first one in the whole text ends the sample
                local text = full_text(res)
                local at, which = find_stop(text, stops, math.max(1, #text - #tail))
                if at then
                    res.text = text:sub(1, at - 1)
                    finish(s, 'stop', which)
                end
            end
        end
        if not s.done and stop_set[t] then finish(s, 'stop', t) end
        if not s.done and (#res.ids >= max_new or #res.prompt_ids + #res.ids >= max_seq) then finish(s, 'length') end
        if tok and not res.text and (s.done or opts.on_token) then res.text = full_text(res) end
        if opts.on_token then
            opts.on_token(res, t)
            if not s.done then res.text = nil end
        end
    end

    -- reads the sampled tokens of one step back and hands them to their samples
    local function take(samples, logits)
        local params, positions = {}, {}
        for k, s in ipairs(samples) do params[k], positions[k] = s.params, #s.result.ids end
        local out = sampling.sample(logits, params, positions, {processed_logprobs = opts.processed_logprobs})
        local toks = out.tokens:to('cpu'):tolist_flat()
        local lps = out.logprobs:to('cpu'):tolist_flat()
        local plps = out.processed_logprobs and out.processed_logprobs:to('cpu'):tolist_flat() or {}
        for k, s in ipairs(samples) do push(s, toks[k], lps[k], plps[k]) end
    end

    local function add_routing(s, routing, row_from, row_to)
        for layer, idx in pairs(routing) do
            -- a copy of its own: samples of one prompt each keep (and later free) their rows
            local rows = idx:narrow(1, row_from + 1, row_to - row_from):to('cpu'):clone()
            local list = s.routing_parts[layer] or {}
            list[#list + 1] = rows
            s.routing_parts[layer] = list
        end
    end

    local ok, err = pcall(function()
        while true do
            local busy = (next_wait <= #waiting or #active > 0) and 1 or 0
            -- admit the next prompts while their samples fit (the first always does: the budget
            -- holds one sequence of the longest length)
            local admit = {}
            while next_wait <= #waiting and #active + (#admit + 1) * nsamp <= math.max(max_batch, nsamp) do
                local r = waiting[next_wait]
                local nb = blocks_of(r)
                if reserved + nb > total_blocks and (#active > 0 or #admit > 0) then break end
                reserved = reserved + nb
                admit[#admit + 1] = r
                next_wait = next_wait + 1
            end
            -- expert parallel: every rank runs as many prefills as the most any rank runs
            -- (lunar.generate.parallel), and the loop ends when every rank's requests are done
            local most = gpar.agree(par, {busy, #admit})
            if most[1] == 0 then break end
            for _ = #admit + 1, most[2] do gpar.empty_forward(model, par) end
            -- each prompt is prefilled on its own: a prompt's logits then do not depend on which
            -- other prompts came in with it (packed prefills round differently: the expert
            -- groups and matrix shapes change), so a request is the same alone or in a batch
            for _, r in ipairs(admit) do
                local seq = cache:new_sequence()
                local out = scope(function() return decode.prefill(cache, {seq}, {r.ids}, {routing = opts.routing}) end)
                local fresh = {}
                for j = 1, nsamp do
                    local s = {seq = j == 1 and seq or cache:fork(seq), req = r, params = r.params[j],
                               blocks = j == 1 and blocks_of(r) or 0, routing_parts = {},
                               result = {prompt = r.index, sample = j, prompt_ids = r.ids, ids = {}, logprobs = {},
                                         processed_logprobs = opts.processed_logprobs and {} or nil}}
                    if opts.routing then add_routing(s, out.routing, 0, #r.ids) end
                    results[#results + 1] = s.result
                    all[#all + 1] = s
                    fresh[j] = s
                end
                -- the first token of every sample comes from the prompt's last logits
                local logits = out.logits:expand(nsamp, out.logits:size(2)):contiguous()
                take(fresh, logits)
                if logits ~= out.logits then logits:free() end
                out.logits:free()
                if opts.routing then for _, t in pairs(out.routing) do t:free() end end
                for _, s in ipairs(fresh) do active[#active + 1] = s end
            end
            -- samples that ended: free their blocks (a sample with routing first runs its last
            -- token, so every token of prompt + completion has its experts)
            local keep, last = {}, {}
            for _, s in ipairs(active) do
                if s.done then
                    if opts.routing and not s.final_routed then last[#last + 1] = s else
                        cache:free(s.seq)
                        reserved = reserved - s.blocks
                    end
                else
                    keep[#keep + 1] = s
                end
            end
            -- one decode step for every sample still going (and the routing-only last steps)
            local step = {}
            for _, s in ipairs(keep) do step[#step + 1] = s end
            for _, s in ipairs(last) do step[#step + 1] = s end
            if gpar.agree(par, {#step})[1] > 0 and #step == 0 then gpar.empty_forward(model, par) end
            if #step > 0 then
                local seqs, toks = {}, {}
                for k, s in ipairs(step) do seqs[k], toks[k] = s.seq, s.result.ids[#s.result.ids] end
                local out = scope(function() return decode.step(cache, seqs, toks, {routing = opts.routing}) end)
                if opts.routing then
                    for k, s in ipairs(step) do add_routing(s, out.routing, k - 1, k) end
                end
                local going = {}
                for k = 1, #keep do going[k] = keep[k] end
                if #keep > 0 then
                    local logits = #last > 0 and out.logits:narrow(1, 1, #keep) or out.logits
                    take(going, logits)
                end
                out.logits:free()
                for _, s in ipairs(last) do
                    s.final_routed = true
                    cache:free(s.seq)
                    reserved = reserved - s.blocks
                end
            end
            active = keep
        end
    end)
    if was_training then adapters:train() end
    cache:release()
    if not ok then error(err, 0) end
    if opts.routing then
        -- each sample's rows in order: its prompt's prefill rows, then one row per decode step
        for _, s in ipairs(all) do
            local routing = {}
            for layer, parts in pairs(s.routing_parts) do
                local T = 0
                for _, t in ipairs(parts) do T = T + t:size(1) end
                local full = core.empty({T, parts[1]:size(2)}, 'i64', 'cpu')
                local row = 0
                for _, t in ipairs(parts) do
                    full:narrow(1, row + 1, t:size(1)):copy_(t)
                    row = row + t:size(1)
                    t:free()
                end
                routing[layer] = full
            end
            s.result.routing = routing
        end
    end
    local elapsed = core.clock() - t0
    if opts.quiet == false then
        print(('[lunar] generate: %d samples, %d new tokens in %.2f s (%.1f tokens/s)'):format(#results, new_tokens,
            elapsed, new_tokens / math.max(elapsed, 1e-9)))
    end
    return results
end

return setmetatable(M, {__call = function(_, ...) return M.run(...) end})
