-- test_generate_flash.lua: generation for GLM-5.3-Flash (lunar.generate.flash), f32 on CPU:
--   * cached decoding (each KDA layer's state and conv history per sequence, the NoPE MLA
--     latents, the pooled indexer keys written once per complete pool) gives, for 64 generated
--     tokens, the logits of a full forward of the whole sequence within 1e-5 of the largest logit:
--     on flash_a and on random configs (hc_mult 2 and 4, the softplus and the bounded forget gate,
--     index_kpool 1, 2 and 4, shared DSA layers, conv widths 2 to 4, tied embeddings), prompts
--     shorter than one pool and longer than index_topk, LoRA adapters on KDA, MLA and MLP
--     projections;
--   * without the tail (flash_b), a sequence's first index_kpool - 1 tokens select no key and
--     average every value uniformly, as transformers' eager attention does over the whole forward:
--     a longer full forward changes those rows, so decoding continues from the prefill's (as
--     transformers' own cached generate does: test_generate_hf); the prefill is exact;
--   * a fork in the middle of a pool: both branches equal their full forwards;
--   * continuous batching: each request's ids and logprobs alone and in a batch, bit for bit;
--   * logprobs within 1e-5 of the training forward (bf16: a mean gap below 0.004); routing
--     recorded in generation replays;
--   * the cache's bytes: per token and per sequence, against the formula; errors.
local lunar = require 'lunar'
local core = lunar.core
local ops = lunar.ops
local lora = require 'lunar.nn.lora'
local Cache = require 'lunar.generate.cache'
local decode = require 'lunar.generate.decode'
local T = require('lunar.testing').suite('generate.flash')

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

local function argmax(row)
    local _, i = ops.topk(row, 1)
    return i:item()
end

local function copy(t)
    if type(t) ~= 'table' then return t end
    local o = {}
    for k, v in pairs(t) do o[k] = copy(v) end
    return o
end

-- a random flat glm5_next config: base fields, then the case's
local function random_model(fields, seed)
    local c = {
        model_type = 'glm5_next', architectures = {'Glm5NextForConditionalGeneration'}, vocab_size = 96,
        hidden_size = 32, num_attention_heads = 4, num_key_value_heads = 4, q_lora_rank = 16, kv_lora_rank = 12,
        qk_nope_head_dim = 8, qk_rope_head_dim = 0, qk_head_dim = 8, v_head_dim = 8, head_dim = 0,
        index_n_heads = 16, index_head_dim = 8, intermediate_size = 40, moe_intermediate_size = 12,
        n_routed_experts = 6, num_experts_per_tok = 2, n_group = 2, topk_group = 1, n_shared_experts = 1,
        routed_scaling_factor = 2.5, norm_topk_prob = true, linear_num_heads = 2, linear_head_dim = 8,
        max_position_embeddings = 4096, initializer_range = 0.2, pad_token_id = 0, rms_norm_eps = 1e-5,
        tie_word_embeddings = false,
    }
    for k, v in pairs(fields) do c[k] = v end
    return lunar.model.new(c, {seed = seed})
end

local CASES = {
    {name = 'hc 2, softplus gate, kp 2 + tail, shared DSA, tied', fields = {
        num_hidden_layers = 5, hc_mult = 2, linear_lower_bound = core.io.null, index_kpool = 2, index_topk = 4,
        index_kpool_always_select_tail = true, linear_conv_kernel_dim = 3, tie_word_embeddings = true,
        layer_types = {'linear_attention', 'indexed_attention', 'indexed_attention', 'linear_attention', 'indexed_attention'},
        indexer_types = {'full', 'full', 'shared', 'full', 'full'},
        mlp_layer_types = {'dense', 'sparse', 'sparse', 'dense', 'sparse'}, swiglu_limit = 0.5}},
    {name = 'hc 4, bounded gate, kp 4 + tail, conv 2', fields = {
        num_hidden_layers = 4, hc_mult = 4, linear_lower_bound = -3.0, index_kpool = 4, index_topk = 8,
        linear_conv_kernel_dim = 2,
        layer_types = {'linear_attention', 'indexed_attention', 'linear_attention', 'indexed_attention'},
        indexer_types = {'full', 'full', 'full', 'full'}, mlp_layer_types = {'sparse', 'sparse', 'dense', 'sparse'}}},
    {name = 'hc 3, kp 1 (every token a pool)', fields = {
        num_hidden_layers = 3, hc_mult = 3, index_kpool = 1, index_topk = 5, linear_conv_kernel_dim = 4,
        layer_types = {'linear_attention', 'indexed_attention', 'indexed_attention'},
        indexer_types = {'full', 'full', 'shared'}, mlp_layer_types = {'dense', 'sparse', 'sparse'}}},
}

-- greedy decoding of prompts (one cache, all sequences in every step); per prompt the list of
-- the next-token logits after the prompt and after each generated token, and the key lists of
-- every full DSA layer at each decode step
local function greedy(model, prompts, n_new, opts)
    opts = opts or {}
    local cache = Cache.new(model, {budget_bytes = 2^22, max_seq_len = 256, max_sequences = #prompts,
                                    block_size = opts.block_size})
    local seqs = {}
    for i = 1, #prompts do seqs[i] = cache:new_sequence() end
    local out = decode.prefill(cache, seqs, prompts)
    local logits, gen = {}, {}
    for i = 1, #prompts do logits[i], gen[i] = {}, {} end
    local cur = out.logits
    for s = 1, n_new do
        local toks = {}
        for i = 1, #prompts do
            logits[i][s] = lunar.persist(cur:select(1, i):clone())
            toks[i] = argmax(cur:select(1, i))
            gen[i][s] = toks[i]
        end
        if s < n_new then cur = decode.step(cache, seqs, toks).logits end
    end
    for _, id in ipairs(seqs) do cache:free(id) end
    assert(cache:free_blocks() == cache.nblocks, 'blocks left owned after freeing every sequence')
    cache:release()
    return gen, logits
end

-- the worst |decode - full forward| / max |full| over every generated position
local function against_full(model, prompts, gen, logits, what)
    local worst = 0
    for i, p in ipairs(prompts) do
        local seq = {}
        for _, t in ipairs(p) do seq[#seq + 1] = t end
        for _, t in ipairs(gen[i]) do seq[#seq + 1] = t end
        local n = #seq
        lunar.scope(function()
            local full = model:forward({input_ids = core.from_flat(seq, {1, n}, 'i64')}, {keep = false}).logits:view(n, -1)
            for s, got in ipairs(logits[i]) do
                local ref = full:select(1, #p + s - 1)
                local e = ops.max(ops.abs(ops.sub(ref, got))):item() / ops.max(ops.abs(ref)):item()
                worst = math.max(worst, e)
                assert(e < 1e-5, ('%s prompt %d (%d tokens), token %d: logits %.3g from the full forward'):format(
                    what, i, #p, s, e))
            end
        end)
    end
    return worst
end

T:test('flash_a and random configs: 64 cached tokens equal the full forward', function()
    local runs = {{what = 'flash_a', model = lunar.model.load(ROOT .. 'flash_a')}}
    for k, c in ipairs(CASES) do runs[#runs + 1] = {what = c.name, model = random_model(c.fields, 10 + k)} end
    for _, r in ipairs(runs) do
        local model = r.model
        local kp, topk = model.cfg.index_kpool, model.cfg.index_topk
        local prompts = {prompt(1, model.cfg.vocab_size, 1), prompt(kp + 1, model.cfg.vocab_size, 2),
                         prompt(topk + 2 * kp + 1, model.cfg.vocab_size, 3)}
        local gen, logits = greedy(model, prompts, 64, {block_size = 8 * kp})
        local worst = against_full(model, prompts, gen, logits, r.what)
        print(('      %-48s worst %.2g (prompts %d, %d, %d + 64)'):format(r.what, worst, #prompts[1], #prompts[2],
            #prompts[3]))
    end
end)

T:test('LoRA adapters on KDA, NoPE MLA (kv_b_proj absorbed) and MLP projections: decode equals the full forward', function()
    local model = random_model(CASES[1].fields, 21)
    local set = lora.new_set({seed = 3})
    local rng = core.rng_new(5)
    local targets = {}
    for _, L in ipairs(model.layers) do
        local a = L.attn
        if L.kind == 'kda' then
            targets[#targets + 1] = a.q_proj
            targets[#targets + 1] = a.f_b_proj
            targets[#targets + 1] = a.o_proj
        else
            targets[#targets + 1] = a.kv_b_proj
            targets[#targets + 1] = a.q_b_proj
        end
        if L.mlp_type == 'dense' then targets[#targets + 1] = L.mlp.up end
    end
    for _, lin in ipairs(targets) do
        local W = model.params:get(lin.wname)
        local A = core.empty({4, W:size(2)}, 'f32')
        local B = core.empty({W:size(1), 4}, 'f32')
        rng:split(lin.name .. 'A'):normal_(A, 0, 0.3)
        rng:split(lin.name .. 'B'):normal_(B, 0, 0.3)
        set:add(lin.name, W:size(1), W:size(2), {r = 4, alpha = 8, A = A, B = B})
    end
    set:eval()
    lora.attach(model.params, set)
    local prompts = {prompt(3, 96, 4), prompt(11, 96, 5)}
    local gen, logits = greedy(model, prompts, 40)
    local worst = against_full(model, prompts, gen, logits, 'LoRA')
    print(('      %d adapters, worst %.2g'):format(#targets, worst))
end)

T:test('without the tail (flash_b): the first rows depend on the forward\'s length; the prefill is exact', function()
    local model = lunar.model.load(ROOT .. 'flash_b')
    assert(model.cfg.index_kpool_always_select_tail == false and model.cfg.index_kpool == 2)
    local V = model.cfg.vocab_size
    -- row 0 selects no key: the eager average covers every token of the forward, so a longer
    -- forward changes it (and every later row through the layers above): a cached continuation
    -- cannot equal the longer full forward, it continues from the prefill's rows, as
    -- transformers' cached generate does (its greedy ids: test_generate_hf)
    local p = prompt(6, V, 1)
    local a = model:forward({input_ids = core.from_flat(p, {1, 6}, 'i64')}, {keep = false}).logits:view(6, -1)
    local longer = {unpack(p)}
    longer[7] = 3
    local b = model:forward({input_ids = core.from_flat(longer, {1, 7}, 'i64')}, {keep = false}).logits:view(7, -1)
    local d0 = ops.max(ops.abs(ops.sub(a:select(1, 1), b:select(1, 1)))):item()
    assert(d0 > 1e-6, 'the first row depends on the forward\'s length without the tail')
    -- the prefill's logits are the prompt's full forward, for prompts of 1 to 9 tokens
    for n = 1, 9 do
        local q = prompt(n, V, n)
        local _, logits = greedy(model, {q}, 1)
        local full = model:forward({input_ids = core.from_flat(q, {1, n}, 'i64')}, {keep = false}).logits
        local ref = full:view(n, -1):select(1, n)
        local e = ops.max(ops.abs(ops.sub(ref, logits[1][1]))):item() / ops.max(ops.abs(ref)):item()
        assert(e < 1e-5, ('prompt of %d tokens: prefill %.3g from the full forward'):format(n, e))
    end
    -- index_kpool 4 without the tail: decode steps of sequences shorter than one pool select no
    -- key (a zero query over every token: the uniform average)
    local fields = copy(CASES[2].fields)
    fields.index_kpool_always_select_tail = false
    local m4 = random_model(fields, 5)
    local gen, logits = greedy(m4, {prompt(1, 96, 1), prompt(6, 96, 2)}, 8)
    for i = 1, 2 do
        for s2 = 1, 8 do
            local l = logits[i][s2]
            assert(ops.max(ops.abs(l)):item() < math.huge, 'finite logits')
        end
        T.equal(#gen[i], 8, 'tokens generated')
    end
end)

T:test('a fork in the middle of a pool: both branches equal their full forwards', function()
    local model = lunar.model.load(ROOT .. 'flash_a')
    local kp = model.cfg.index_kpool
    local V = model.cfg.vocab_size
    local cache = Cache.new(model, {budget_bytes = 2^22, max_seq_len = 128, max_sequences = 3})
    local p = prompt(2 * kp + 2, V, 7)          -- two pools and half of a third
    local a = cache:new_sequence()
    local first = decode.prefill(cache, {a}, {p}).logits:select(1, 1)
    local b = cache:fork(a)
    local seqs = {a, b}
    local toks = {{}, {}}
    local got = {{}, {}}
    local cur = {lunar.persist(first:clone()), lunar.persist(first:clone())}
    for s = 1, 3 * kp + 1 do
        local t = {argmax(cur[1]), (argmax(cur[2]) + 1 + s) % V}   -- the branches take different tokens
        for i = 1, 2 do got[i][s], toks[i][s] = cur[i], t[i] end
        local out = decode.step(cache, seqs, t).logits
        for i = 1, 2 do cur[i] = lunar.persist(out:select(1, i):clone()) end
    end
    for i = 1, 2 do
        local seq = {unpack(p)}
        for _, t in ipairs(toks[i]) do seq[#seq + 1] = t end
        local n = #seq
        local full = model:forward({input_ids = core.from_flat(seq, {1, n}, 'i64')}, {keep = false}).logits:view(n, -1)
        for s, l in ipairs(got[i]) do
            local ref = full:select(1, #p + s - 1)
            local e = ops.max(ops.abs(ops.sub(ref, l))):item() / ops.max(ops.abs(ref)):item()
            assert(e < 1e-5, ('branch %d token %d: %.3g from the full forward'):format(i, s, e))
        end
    end
    cache:free(a)
    cache:free(b)
    T.equal(cache:free_blocks(), cache.nblocks, 'every block free again')
    cache:release()
end)

T:test('continuous batching: each request as if alone, greedy and sampled, bit for bit', function()
    local model = lunar.model.load(ROOT .. 'flash_a')
    local V = model.cfg.vocab_size
    local prompts = {}
    for i = 1, 10 do prompts[i] = {ids = prompt(1 + (i * 5) % 23, V, i), seed = 100 + i} end
    for _, cfg in ipairs({{temperature = 0}, {temperature = 0.9, top_k = 20, top_p = 0.9, n = 2}}) do
        local opts = {max_new_tokens = 14, max_batch = 4, stop_token_ids = {}}
        for k, v in pairs(cfg) do opts[k] = v end
        local probe = lunar.generate(model, prompts, opts)
        opts.stop_token_ids = {probe[2].ids[4], probe[#probe - 1].ids[6]}
        local together = lunar.generate(model, prompts, opts)
        local stopped = 0
        for _, r in ipairs(together) do if r.finish_reason == 'stop' then stopped = stopped + 1 end end
        assert(stopped > 0 and stopped < #together, ('some samples stop early (%d of %d)'):format(stopped, #together))
        for _, r in ipairs(together) do
            local alone = lunar.generate(model, {prompts[r.prompt]}, opts)[r.sample]
            same_list(r.ids, alone.ids, ('T %g prompt %d sample %d ids'):format(cfg.temperature, r.prompt, r.sample))
            same_list(r.logprobs, alone.logprobs, ('T %g prompt %d sample %d logprobs'):format(cfg.temperature,
                r.prompt, r.sample))
        end
        -- all at once (20 sequences in a step: BLAS would change a row's bits at this size)
        opts.max_batch = 64
        local wide = lunar.generate(model, prompts, opts)
        for k, r in ipairs(wide) do same_list(r.ids, together[k].ids, 'max_batch 64') end
    end
end)

-- per-token logprobs of the training forward for prompt + completion: the completion's entries
local function forward_logprobs(model, prompt_ids, ids, routing)
    local all = {}
    for _, t in ipairs(prompt_ids) do all[#all + 1] = t end
    for _, t in ipairs(ids) do all[#all + 1] = t end
    local n = #all
    local x = lunar.tensor(all, {dtype = 'i64'}):view(1, n)
    return lunar.scope(function()
        local out = model:forward({input_ids = x, labels = x, routing = routing}, {logprobs = true, keep = false})
        local lp = out.logprobs:view(n):to('f32'):tolist_flat()
        local r = {}
        for k = 1, #ids do r[k] = lp[#prompt_ids + k - 1] end
        return r, out.routing
    end)
end

T:test('logprobs equal the training forward within 1e-5; routing recorded in generation replays', function()
    local model = lunar.model.load(ROOT .. 'flash_a')
    local V = model.cfg.vocab_size
    local res = lunar.generate(model, {prompt(9, V, 1), prompt(30, V, 2)},
        {max_new_tokens = 24, temperature = 1, seed = 3, n = 2, routing = true})
    local worst = 0
    for _, r in ipairs(res) do
        local want, routed = forward_logprobs(model, r.prompt_ids, r.ids)
        for k = 1, #r.ids do
            local d = math.abs(r.logprobs[k] - want[k])
            worst = math.max(worst, d)
            assert(d <= 1e-5, ('token %d: generation %.9g, forward %.9g'):format(k, r.logprobs[k], want[k]))
        end
        local layers = 0
        for layer, idx in pairs(r.routing) do
            layers = layers + 1
            T.equal(idx:size(1), #r.prompt_ids + #r.ids, 'a row per token of prompt and completion')
            T.equal(routed[layer].idx, idx, 'layer ' .. layer .. ' experts')
        end
        assert(layers == 4, 'the 4 MoE layers routed, got ' .. layers)
        local _, replayed = forward_logprobs(model, r.prompt_ids, r.ids, r.routing)
        for layer, idx in pairs(r.routing) do T.equal(replayed[layer].idx, idx, 'replayed layer ' .. layer) end
    end
    print(('      worst logprob gap %.3g'):format(worst))
    -- bf16 weights (the latents in bf16, the KDA states and pooled keys in f32): the mean gap
    -- below SkyRL's 0.004 floor
    local m16 = lunar.model.load(ROOT .. 'flash_a', {dtype = 'bf16'})
    local sum, n = 0, 0
    local V16 = m16.cfg.vocab_size
    local prompts16 = {prompt(20, V16, 1), prompt(40, V16, 2), prompt(9, V16, 3)}
    for _, r in ipairs(lunar.generate(m16, prompts16, {max_new_tokens = 48})) do
        local want = forward_logprobs(m16, r.prompt_ids, r.ids)
        for k = 1, #r.ids do sum, n = sum + math.abs(r.logprobs[k] - want[k]), n + 1 end
    end
    print(('      bf16 mean absolute logprob gap %.5f over %d tokens'):format(sum / n, n))
    assert(sum / n < 0.004, ('bf16 gap %.5f'):format(sum / n))
end)

T:test('cache bytes per token and per sequence; summary; errors', function()
    local model = lunar.model.load(ROOT .. 'flash_a')
    local cfg = model.cfg
    local plan = Cache.plan(model, {budget_bytes = 2^24, max_seq_len = 256, max_sequences = 2})
    -- per token: the latent of every DSA layer (f32 here), a pooled key per kp tokens of every
    -- full DSA layer; per sequence: state, conv inputs, the open pool
    local bpt, bps = 0, 0
    for i, t in ipairs(cfg.layer_types) do
        if t == 'linear_attention' then
            local Q = cfg.linear_num_heads * cfg.linear_head_dim
            bps = bps + 4 * (cfg.linear_num_heads * cfg.linear_head_dim ^ 2 + 3 * (cfg.linear_conv_kernel_dim - 1) * Q)
        else
            bpt = bpt + 4 * cfg.kv_lora_rank
            if cfg.indexer_types[i] == 'full' then
                bpt = bpt + 4 * cfg.index_head_dim / cfg.index_kpool
                bps = bps + 4 * cfg.index_kpool * 2 * cfg.index_head_dim
            end
        end
    end
    T.equal(plan.bytes_per_token, bpt, 'bytes per token')
    T.equal(plan.bytes_per_sequence, bps, 'bytes per sequence')
    local cache = Cache.new(model, {budget_bytes = 2^20, max_seq_len = 64, max_sequences = 2})
    assert(cache:summary():find(('%d bytes of state per sequence'):format(bps), 1, true), cache:summary())
    T.raises(function() Cache.new(model, {budget_bytes = 2^20}) end, 'max_sequences')
    T.raises(function() Cache.new(model, {budget_bytes = 2^20, block_size = 6, max_sequences = 1}) end,
        'block_size 6 is not a multiple of 4')
    local a, b = cache:new_sequence(), cache:new_sequence()
    T.raises(function() cache:new_sequence() end, 'all 2 sequence slots are taken')
    T.raises(function() cache:fork(a) end, 'needs a free sequence slot')
    cache:free(b)
    local c = cache:new_sequence()
    assert(c ~= b, 'a new id')
    cache:release()
    -- lunar.generate sizes the slots itself
    local r = lunar.generate(model, {prompt(5, cfg.vocab_size, 1)}, {max_new_tokens = 3, n = 3})
    T.equal(#r, 3, 'three samples')
end)

os.exit(T:run())
