-- lunar.generate.decode: the model entry points of generation, over a KV cache
-- (lunar.generate.cache): a prefill of a batch of prompts and a decode step of one new token per
-- sequence. They run the model's own modules and weights (lunar.model.glm; nothing is copied),
-- leave its training forward untouched, and give the logits a full forward of each whole
-- sequence gives (docs/generation.md: the tests hold them to 1e-5 of the largest logit).
--
--   local Cache = require 'lunar.generate.cache'
--   local decode = require 'lunar.generate.decode'
--   local cache = Cache.new(model, {budget_bytes = 64 * 2^20})
--   local a, b = cache:new_sequence(), cache:new_sequence()
--   local out = decode.prefill(cache, {a, b}, {{5, 9, 2, 7}, {3, 1}})
--   -- out.logits (2, V): the next-token logits after each prompt
--   local nxt = {argmax of out.logits row 1, argmax of row 2}
--   out = decode.step(cache, {a, b}, nxt)      -- out.logits (2, V); a and b now hold 5 and 3 tokens
--   cache:free(a)                              -- b decodes on alone: decode.step(cache, {b}, {t})
--
--   decode.prefill(cache, seqs, prompts[, {all_logits = false, routing = false}]) -> out
--       seqs: ids of empty sequences of the cache; prompts: one token id list (Lua list of
--       0-based ids, or a 1-D integer tensor) per sequence, of any lengths. The prompts run as
--       one packed row with cu_seqlens (block-diagonal causal attention, positions restarting per
--       prompt), exactly as training runs packed documents, and every layer writes its cache
--       rows. out.logits (#seqs, V): each prompt's last position; out.all_logits (N, V) every
--       position, N = the prompts' total length, prompt after prompt (all_logits = true);
--       out.cu_seqlens: Lua list {0, n1, n1 + n2, ...}; out.routing (routing = true):
--       {[layer] = (N, K) i64} the routed experts of every token at every MoE layer (0-based
--       layer index), the form lunar.model's routing replay takes (batch.routing, R3).
--   decode.step(cache, seqs, tokens[, {routing = false}]) -> out
--       one new token per sequence (tokens: Lua list or (B) integer tensor, B = #seqs, each
--       sequence at most once); the token takes position length(seq) and is appended to the
--       cache. out.logits (B, V); out.routing {[layer] = (B, K) i64} (routing = true).
-- The multi-token prediction layer is not used. Errors name the prompt, token or sequence; a
-- refused call (a bad token, too long a sequence, a full cache) changes nothing in the cache,
-- while an error inside the model leaves the called sequences' contents undefined (free them).
--
-- Batch invariance: every product of a decode step is row-invariant (lunar.ops.gemm's
-- row_invariant), so a sequence's logits are the same bits whatever other sequences share the
-- step; a prefill runs its prompts' rows through the training modules (BLAS), which is why
-- lunar.generate prefills each prompt on its own.
--
-- Memory: each layer runs inside lunar.scope, so its temporaries (the gathered cache blocks
-- included) go back to the device's pool before the next layer; a decode step whose sequences
-- span as many blocks as the step before takes every buffer from the pool's free blocks and
-- allocates no new memory (tests/lua/test_generate_cache.lua checks the pool's counters).
local lunar = require 'lunar'
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local ops = require 'lunar.ops'
local gattn = require 'lunar.generate.attention'
local gpar = require 'lunar.generate.parallel'

local fail = tensor.fail

local M = {}

local function is_int(v) return type(v) == 'number' and v == math.floor(v) end

-- the f32 residual stream (lunar.model.glm's fp32_residual): sub-blocks read it in the
-- parameters' dtype and add back in f32
local function to_compute(model, x) return model.fp32_residual and x:to(model.dtype) or x end
local function to_residual(model, y) return model.fp32_residual and y:float() or y end

local function check_ids(list, V, what)
    for j, t in ipairs(list) do
        if not is_int(t) or t < 0 or t >= V then
            fail(('%s, token %d is %s, not a token id in [0, %d)'):format(what, j, tostring(t), V))
        end
    end
end

local function id_list(x, what)
    if tensor.is_tensor(x) then
        if x:dim() ~= 1 then fail(('%s must be a 1-D tensor or a Lua list, got %d dims'):format(what, x:dim())) end
        return x:to('cpu'):tolist_flat()
    end
    if type(x) ~= 'table' then fail(('%s must be a Lua list of token ids or a 1-D tensor, got a %s'):format(what, type(x))) end
    return x
end

local function check_seqs(seqs, who)
    if type(seqs) ~= 'table' or #seqs == 0 then fail(('%s: seqs must be a non-empty list of sequence ids'):format(who)) end
end

-- the MLP or MoE half of a layer: h + mlp(post_norm(h)) and the routed expert ids (MoE).
-- mopts: the MoE's forward options (a decode step asks for row-invariant expert products)
local function mlp_forward(model, L, h, mopts)
    local hn = L.post_norm:forward(to_compute(model, h))
    local m, routing
    if L.mlp_type == 'dense' then
        m = L.mlp:forward(hn, mopts)
    else
        local _
        m, _, routing = L.mlp:forward(hn, mopts)
    end
    -- sequence parallel: the blocks leave their partial sums to the layer (training
    -- reduce-scatters them); generation holds every row on every tp member
    m = model.par.decode_block:forward(m)
    return ops.add(h, to_residual(model, m)), routing and routing.idx
end

-- the final norm and lm_head of hidden rows x (n, H) -> (n, V); lopts: the Linear's options.
-- Under tensor parallel the logits are whole and the same bits on every member (gpar.logits).
local function head(model, x, lopts)
    local xf = model.norm:forward(to_compute(model, x))
    return gpar.logits(gpar.of(model), (model.lm_head:forward(xf, lopts)))
end

-- runs every decoder layer on x through layer_fn(L, cache_layer, xn, sel) -> attention output,
-- selection; frees each layer's temporaries; returns the last hidden state and the routing.
-- mopts: the MoE forward's options
local function run_layers(model, cache, x, want_routing, mopts, layer_fn)
    local sel, routing = nil, {}
    for i, L in ipairs(model.layers) do
        local cl = cache.layers[i]
        local nx, nsel, idx = lunar.scope(function()
            local xn = L.input_norm:forward(to_compute(model, x))
            local a, s = layer_fn(L, cl, xn, sel)
            local h = ops.add(x, to_residual(model, a))
            local out, r = mlp_forward(model, L, h, mopts)
            return out, s, r
        end)
        x:free()
        x = nx
        if tensor.is_tensor(sel) and sel ~= nsel then sel:free() end
        sel = nsel
        if idx then
            if want_routing then routing[i - 1] = idx else idx:free() end
        end
    end
    if tensor.is_tensor(sel) then sel:free() end
    return x, want_routing and routing or nil
end

-- a model family's own generation (lunar.generate.flash for GLM-5.3-Flash), or nil: GLM-5's and
-- GLM-4.x's, below
local function family(model) return model.decode_module and require(model.decode_module) end

-- the packed forward of prefill, after the checks and the cache's append
local function prefill_run(model, cache, lists, slots_list, opts)
    local dev = model:device()
    local flat, cu, last = {}, {0}, {}
    for i, list in ipairs(lists) do
        for _, t in ipairs(list) do flat[#flat + 1] = t end
        cu[i + 1] = #flat
        last[i] = #flat - 1
    end
    local N = #flat
    local b = model:prepare({input_ids = core.from_flat(flat, {1, N}, 'i64'),
                             cu_seqlens = core.from_flat(cu, {#cu}, 'i64')})
    local slots = core.from_flat(slots_list, {N}, 'i64', dev)
    local x = to_residual(model, (model.embed:forward(b.ids)))
    local hidden, routing = run_layers(model, cache, x, opts.routing, nil, function(L, cl, xn, sel)
        local a, _, topk = L.attn:forward(xn, b, sel)
        a = model.par.decode_block:forward(a)   -- left partial for sequence parallel
        gattn.store_prefill(L, cl, cache, xn, b, slots)
        return a, topk
    end)
    local out = {cu_seqlens = cu, routing = routing}
    out.logits = head(model, ops.index_select(hidden, 1, core.from_flat(last, {#last}, 'i64', dev)))
    if opts.all_logits then out.all_logits = head(model, hidden) end
    return out
end

function M.prefill(cache, seqs, prompts, opts)
    opts = opts or {}
    local who = 'prefill'
    check_seqs(seqs, who)
    local model = cache.model
    local V = model.cfg.vocab_size
    if type(prompts) ~= 'table' or #prompts ~= #seqs then
        fail(('%s: %d sequences need %d prompts, got %s'):format(who, #seqs, #seqs,
            type(prompts) == 'table' and tostring(#prompts) or 'a ' .. type(prompts)))
    end
    local lists, counts = {}, {}
    for i, p in ipairs(prompts) do
        local list = id_list(p, ('%s: prompt %d'):format(who, i))
        if #list == 0 then fail(('%s: prompt %d is empty (a prompt needs at least one token)'):format(who, i)) end
        check_ids(list, V, ('%s: prompt %d'):format(who, i))
        lists[i], counts[i] = list, #list
    end
    for i, id in ipairs(seqs) do
        local n = cache:length(id)
        if n ~= 0 then
            fail(('%s: sequence %s already holds %d tokens; prefill fills empty sequences (decode.step extends them)'):format(
                who, tostring(id), n))
        end
        if counts[i] > cache.max_seq_len then
            fail(('%s: prompt %d has %d tokens, more than the kv cache\'s max_seq_len %d'):format(
                who, i, counts[i], cache.max_seq_len))
        end
    end
    local slots_list = cache:append(seqs, counts, who)
    -- everything but the results goes back to the pool on return (the (N, N) mask included)
    local impl = family(model)
    if impl then return lunar.scope(impl.prefill, model, cache, seqs, lists, slots_list, opts) end
    return lunar.scope(prefill_run, model, cache, lists, slots_list, opts)
end

-- A decode step multiplies the rows of every sequence of the batch together (and the rows an
-- expert gets depend on which other sequences are in the step), so every product of the step is
-- row-invariant (the Linears, the MoE's router and experts, the absorbed MLA products): a
-- sequence's bits do not depend on the others. BLAS's sgemm changes a row's bits with the number
-- of rows. A prefill runs one prompt's rows only (lunar.generate prefills each prompt on its own)
-- and keeps BLAS.
local ROW_INVARIANT = {row_invariant = true}

-- one decode step's forward, after the checks and the cache's append
local function step_run(model, cache, seqs, list, slots_list, starts, opts)
    local B, dev = #seqs, model:device()
    if model.inv_freq:device() ~= dev then model.inv_freq = model.inv_freq:to(dev) end
    local view = cache:view(seqs)
    gattn.prepare_step(model, cache, view)
    local step = {
        view = view, slots = core.from_flat(slots_list, {B}, 'i64', dev),
        positions = core.from_flat(starts, {B, 1}, 'i64', dev), inv_freq = model.inv_freq, rope_scale = 1,
        linear = ROW_INVARIANT,
    }
    local x = to_residual(model, (model.embed:forward(core.from_flat(list, {B}, 'i64', dev))))
    local hidden, routing = run_layers(model, cache, x, opts.routing, ROW_INVARIANT, function(L, cl, xn, sel)
        local a, s = gattn.decode(L, cl, cache, xn, step, sel)
        a = model.par.decode_heads:forward(a)   -- the heads' partial sums
        return a, s
    end)
    return {logits = head(model, hidden, ROW_INVARIANT), routing = routing}
end

function M.step(cache, seqs, tokens, opts)
    opts = opts or {}
    local who = 'decode'
    check_seqs(seqs, who)
    local model = cache.model
    local list = id_list(tokens, ('%s: tokens'):format(who))
    if #list ~= #seqs then fail(('%s: %d sequences need %d tokens, got %d'):format(who, #seqs, #seqs, #list)) end
    check_ids(list, model.cfg.vocab_size, ('%s: tokens'):format(who))
    local ones = {}
    for i = 1, #seqs do ones[i] = 1 end
    local slots_list, starts = cache:append(seqs, ones, who)
    local impl = family(model)
    if impl then return lunar.scope(impl.step, model, cache, seqs, list, slots_list, starts, opts) end
    return lunar.scope(step_run, model, cache, seqs, list, slots_list, starts, opts)
end

return M
