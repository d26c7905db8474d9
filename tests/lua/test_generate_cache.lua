-- test_generate_cache.lua: KV-cached generation (lunar.generate.cache, lunar.generate.decode)
-- against the full forward, f32 on CPU.
--   For every model under tests/fixtures/models and two random configs of our own (GLM-5 with
--   DSA active and a LoRA adapter on kv_b_proj; GLM-4.x with one KV head): greedy generation of
--   64 tokens (fewer where max_position_embeddings stops it) for a batch of prompts of different
--   lengths, prefilled together: at every step the logits are within 1e-5 of the largest |logit|
--   of a full forward of the whole sequence without a cache, and the tokens are its argmax; the
--   prompts' own logits (prefill's all_logits) likewise; the routed experts of every token equal
--   the full forward's, and a forward replaying them (batch.routing, R3) gives the same logits.
--   Bytes per token: GLM-5 (kv_lora_rank + qk_rope_head_dim + index_head_dim on full-indexer
--   layers) x 4 per layer, GLM-4.x 2 x heads x head_dim x 4 per layer.
--   Freed blocks reused in another order give bit-identical logits; fork shares a prompt; a decode
--   step that spans as many blocks as the one before allocates no new memory; bad input errors.
local lunar = require 'lunar'
local ops = lunar.ops
local core = lunar.core
local Cache = require 'lunar.generate.cache'
local decode = require 'lunar.generate.decode'
local lora = require 'lunar.nn.lora'
local T = require('lunar.testing').suite('generate.cache')

local ROOT = 'tests/fixtures/models/'
local N_NEW = 64
local TOL = 1e-5

local function argmax(row)
    local _, i = ops.topk(row, 1)
    return i:item()
end

local function rel_err(got, ref)
    return ops.max(ops.abs(ops.sub(got, ref))):item() / ops.max(ops.abs(ref)):item()
end

-- deterministic prompt of n tokens
local function prompt(n, V, salt)
    local p = {}
    for j = 1, n do p[j] = (j * 7 + salt * 13 + j * j * salt) % V end
    return p
end

-- Greedy generation of n_new tokens for the prompts through prefill + decode steps. Returns, per
-- sequence, the logits of every step (the first from prefill) as (V) tensors, the generated
-- tokens, and the routed experts per MoE layer as a list of (K) rows, prompt tokens first.
local function greedy(cache, prompts, n_new, opts)
    opts = opts or {}
    local B = #prompts
    local seqs, res = {}, {}
    for i = 1, B do
        seqs[i] = cache:new_sequence()
        res[i] = {logits = {}, tokens = {}, routing = {}}
    end
    local out = decode.prefill(cache, seqs, prompts, {all_logits = true, routing = true})
    local function add_routing(routing, rows_of)
        for layer, idx in pairs(routing) do
            for i = 1, B do
                local r = res[i].routing
                r[layer] = r[layer] or {}
                local lo, n = rows_of(i)
                for j = lo, lo + n - 1 do r[layer][#r[layer] + 1] = idx:select(1, j):tolist_flat() end
            end
        end
    end
    add_routing(out.routing, function(i) return out.cu_seqlens[i] + 1, out.cu_seqlens[i + 1] - out.cu_seqlens[i] end)
    for i = 1, B do res[i].prompt_logits = out.all_logits:narrow(1, out.cu_seqlens[i] + 1, #prompts[i]) end
    local logits = out.logits
    for s = 1, n_new do
        local toks = {}
        for i = 1, B do
            local row = logits:select(1, i)
            res[i].logits[s] = row
            toks[i] = argmax(row)
            res[i].tokens[s] = toks[i]
        end
        if s == n_new then break end
        out = decode.step(cache, seqs, toks, {routing = true})
        add_routing(out.routing, function(i) return i, 1 end)
        logits = out.logits
    end
    if opts.free ~= false then for _, id in ipairs(seqs) do cache:free(id) end end
    return res, seqs
end

-- Every step of res against a full forward of each whole sequence: returns the worst relative
-- logits error; asserts the tokens and the routing.
local function check_against_full(model, prompts, res, what)
    local worst = 0
    for i, p in ipairs(prompts) do
        local full = {}
        for _, t in ipairs(p) do full[#full + 1] = t end
        for s = 1, #res[i].tokens - 1 do full[#full + 1] = res[i].tokens[s] end
        local out = model:forward({input_ids = lunar.tensor(full, {dtype = 'i64'}):view(1, #full)}, {keep = false})
        local L = out.logits:select(1, 1)
        local e = rel_err(res[i].prompt_logits, L:narrow(1, 1, #p))
        worst = math.max(worst, e)
        for s, got in ipairs(res[i].logits) do
            local ref = L:select(1, #p + s - 1)
            e = rel_err(got, ref)
            worst = math.max(worst, e)
            assert(e <= TOL, ('%s: sequence %d step %d: logits differ from the full forward by %.3g of max |logit|'):format(
                what, i, s, e))
            assert(res[i].tokens[s] == argmax(ref), ('%s: sequence %d step %d: token %d, full forward argmax %d'):format(
                what, i, s, res[i].tokens[s], argmax(ref)))
        end
        -- routing: the tokens of the full forward (all but the last generated one, never fed)
        local replay = {}
        for layer, r in pairs(out.routing) do
            local ref = r.idx
            local got = res[i].routing[layer]
            assert(got and #got == ref:size(1), ('%s: routing of layer %d: %s rows, expected %d'):format(
                what, layer, got and #got or 'no', ref:size(1)))
            for j = 1, ref:size(1) do
                local a, b = {unpack(got[j])}, ref:select(1, j):tolist_flat()
                table.sort(a); table.sort(b)
                assert(table.concat(a, ',') == table.concat(b, ','), ('%s: sequence %d token %d layer %d: experts {%s}, full forward {%s}'):format(
                    what, i, j, layer, table.concat(a, ','), table.concat(b, ',')))
            end
            local rows = {}
            for j = 1, #got do for _, e in ipairs(got[j]) do rows[#rows + 1] = e end end
            replay[layer] = lunar.tensor(rows, {dtype = 'i64'}):view(#got, ref:size(2))
        end
        -- and the recorded ids are what routing replay (R3) takes: the replayed forward is the same
        local rep = model:forward({input_ids = lunar.tensor(full, {dtype = 'i64'}):view(1, #full), routing = replay},
            {keep = false})
        assert(rel_err(rep.logits:select(1, 1), L) <= 1e-6, what .. ': the forward replaying the recorded routing differs')
    end
    return worst
end

-- bytes per token from the config, as the issue states it
local function expected_bpt(cfg)
    local n = 0
    for l = 0, cfg.num_hidden_layers - 1 do
        if cfg.model_type == 'glm_moe_dsa' then
            n = n + cfg.kv_lora_rank + cfg.qk_rope_head_dim + (cfg.indexer_types[l + 1] == 'full' and cfg.index_head_dim or 0)
        else
            n = n + 2 * cfg.num_key_value_heads * cfg.head_dim
        end
    end
    return n * 4
end

-- prompts of three different lengths, longer than index_topk where the room allows
local function prompts_for(cfg)
    local max_pos = cfg.max_position_embeddings
    local base = cfg.index_topk and cfg.index_topk + 1 or 5
    local lens = {base, base + 6, base + 13}
    -- leave room for the new tokens
    local room = max_pos - N_NEW
    if lens[3] > room then lens = {2, 5, 8} end
    local ps = {}
    for i, n in ipairs(lens) do ps[i] = prompt(n, cfg.vocab_size, i) end
    return ps, math.min(N_NEW, max_pos - lens[3])
end

local function run_case(model, what, block_size)
    local cfg = model.cfg
    local prompts, n_new = prompts_for(cfg)
    local cache = Cache.new(model, {budget_bytes = 2 * 2^20, block_size = block_size, max_seq_len = math.min(cfg.max_position_embeddings, 160)})
    assert(cache:bytes_per_token() == expected_bpt(cfg), ('%s: %d bytes per token, expected %d'):format(
        what, cache:bytes_per_token(), expected_bpt(cfg)))
    local res = greedy(cache, prompts, n_new)
    local worst = check_against_full(model, prompts, res, what)
    assert(cache:free_blocks() == cache.nblocks, what .. ': blocks left owned after freeing every sequence')
    print(('  %-26s %4d B/token  %d tokens x %d prompts (%d, %d, %d)  worst logits error %.2g'):format(
        what, cache:bytes_per_token(), n_new, #prompts, #prompts[1], #prompts[2], #prompts[3], worst))
    cache:release()
end

T:test('every fixture model: cached greedy decoding equals the full forward', function()
    local names = assert(core.fs.list(ROOT))
    table.sort(names)
    local n = 0
    for _, name in ipairs(names) do
        local f = io.open(ROOT .. name .. '/config.json')
        if f then
            f:close()
            local model = lunar.model.load(ROOT .. name)
            -- GLM-5.3-Flash keeps per-sequence state too, and without the index_kpool tail its
            -- full forward is not causal: test_generate_flash
            if model.cfg.model_type ~= 'glm5_next' then
                run_case(model, name, 4 + n % 3)
                n = n + 1
            end
        end
    end
    assert(n >= 15, 'expected the 15 fixture models, found ' .. n)
end)

-- ---- random configs of our own ----------------------------------------------------------------

local function glm5_random()
    return lunar.model.new({
        model_type = 'glm_moe_dsa', vocab_size = 160, hidden_size = 64, num_hidden_layers = 5,
        num_attention_heads = 4, num_key_value_heads = 4, q_lora_rank = 32, kv_lora_rank = 24,
        qk_nope_head_dim = 12, qk_rope_head_dim = 8, v_head_dim = 10, index_n_heads = 4,
        index_head_dim = 16, index_topk = 6, indexer_types = {'full', 'shared', 'full', 'shared', 'shared'},
        mlp_layer_types = {'dense', 'sparse', 'sparse', 'dense', 'sparse'}, intermediate_size = 48,
        moe_intermediate_size = 16, n_routed_experts = 8, num_experts_per_tok = 3, n_group = 4, topk_group = 2,
        n_shared_experts = 1, routed_scaling_factor = 2.5, max_position_embeddings = 512,
        initializer_range = 0.15, rope_parameters = {rope_type = 'default', rope_theta = 5000.0},
        attention_bias = true, num_nextn_predict_layers = 0,
    }, {seed = 7})
end

local function glm4_random()
    return lunar.model.new({
        model_type = 'glm4_moe', vocab_size = 160, hidden_size = 48, num_hidden_layers = 3,
        num_attention_heads = 6, num_key_value_heads = 1, head_dim = 12, intermediate_size = 40,
        moe_intermediate_size = 12, n_routed_experts = 6, num_experts_per_tok = 2, n_group = 1, topk_group = 1,
        first_k_dense_replace = 1, n_shared_experts = 1, routed_scaling_factor = 1.5, max_position_embeddings = 512,
        initializer_range = 0.15, partial_rotary_factor = 0.5, use_qk_norm = true, attention_bias = true,
        num_nextn_predict_layers = 0,
    }, {seed = 11})
end

-- random (non-zero) LoRA adapters on kv_b_proj (the absorbed products) and q_b_proj of every layer
local function add_lora(model)
    local set = lora.new_set({seed = 3})
    local rng = core.rng_new(5)
    for _, L in ipairs(model.layers) do
        for _, lin in ipairs({L.attn.kv_b_proj, L.attn.q_b_proj}) do
            local W = model.params:get(lin.wname)
            local A = core.empty({4, W:size(2)}, 'f32')
            local B = core.empty({W:size(1), 4}, 'f32')
            rng:split(lin.name .. 'A'):normal_(A, 0, 0.3)
            rng:split(lin.name .. 'B'):normal_(B, 0, 0.3)
            set:add(lin.name, W:size(1), W:size(2), {r = 4, alpha = 8, A = A, B = B})
        end
    end
    set:eval()
    lora.attach(model.params, set)
    return set
end

T:test('random GLM-5 (DSA, IndexShare, LoRA on kv_b_proj) and GLM-4.x configs equal the full forward', function()
    local m5 = glm5_random()
    run_case(m5, 'random glm5', 5)
    add_lora(m5)
    run_case(m5, 'random glm5 + LoRA', 3)
    run_case(glm4_random(), 'random glm4moe', 4)
end)

T:test('a LoRA adapter with dropout in training mode on kv_b_proj is refused', function()
    local m = glm5_random()
    local set = add_lora(m)
    set.modules['model.layers.0.self_attn.kv_b_proj'].dropout = 0.1
    set:train()
    local cache = Cache.new(m, {budget_bytes = 2^20, max_seq_len = 64})
    local s = cache:new_sequence()
    decode.prefill(cache, {s}, {{1, 2, 3}})
    local ok, err = pcall(decode.step, cache, {s}, {4})
    assert(not ok and err:find('model.layers.0.self_attn.kv_b_proj', 1, true) and err:find('set:eval()', 1, true), tostring(err))
end)

T:test('freed blocks reused in another order give bit-identical logits', function()
    local m = glm5_random()
    local cache = Cache.new(m, {budget_bytes = 2^20, block_size = 4, max_seq_len = 128})
    local prompts = {prompt(9, 160, 1), prompt(15, 160, 2), prompt(7, 160, 3)}
    local first = greedy(cache, prompts, 24)
    -- the free list now hands out the blocks in another order; a live sequence takes some first
    local other = cache:new_sequence()
    decode.prefill(cache, {other}, {prompt(13, 160, 4)})
    local second, seqs = greedy(cache, prompts, 24, {free = false})
    local moved = false
    for i = 1, #prompts do
        for s = 1, 24 do
            assert(first[i].tokens[s] == second[i].tokens[s], 'tokens differ after reuse')
            local a, b = first[i].logits[s]:tolist_flat(), second[i].logits[s]:tolist_flat()
            for j = 1, #a do assert(a[j] == b[j], ('sequence %d step %d: logit %d %.9g vs %.9g'):format(i, s, j, a[j], b[j])) end
        end
        if cache.seqs[seqs[i]].blocks[1] ~= i - 1 then moved = true end
    end
    assert(moved, 'the second run used the same blocks: the test shows nothing')
end)

T:test('fork shares a prefilled prompt; each branch equals its full forward', function()
    local m = glm5_random()
    local cache = Cache.new(m, {budget_bytes = 2^20, block_size = 4, max_seq_len = 64})
    for _, n in ipairs({7, 8}) do      -- a partly filled last block (copied) and a full one (shared)
        local p = prompt(n, 160, n)
        local a = cache:new_sequence()
        local out = decode.prefill(cache, {a}, {p})
        local free_before = cache:free_blocks()
        local b = cache:fork(a)
        assert(cache:free_blocks() == free_before - (n % 4 == 0 and 0 or 1), 'fork took the wrong number of blocks')
        local la = out.logits:select(1, 1)
        local ta, tb = {argmax(la)}, {(argmax(la) + 1) % 160}
        local steps = {}
        for s = 1, 6 do
            local o = decode.step(cache, {a, b}, {ta[s], tb[s]})
            steps[s] = o.logits
            ta[s + 1], tb[s + 1] = argmax(o.logits:select(1, 1)), argmax(o.logits:select(1, 2))
        end
        for k, toks in ipairs({ta, tb}) do
            local full = {}
            for _, t in ipairs(p) do full[#full + 1] = t end
            for s = 1, 6 do full[#full + 1] = toks[s] end
            local L = m:forward({input_ids = lunar.tensor(full, {dtype = 'i64'}):view(1, #full)}, {keep = false}).logits:select(1, 1)
            for s = 1, 6 do
                local e = rel_err(steps[s]:select(1, k), L:select(1, n + s))
                assert(e <= TOL, ('fork (prompt %d) branch %d step %d: %.3g'):format(n, k, s, e))
            end
        end
        cache:free(a)
        cache:free(b)
        assert(cache:free_blocks() == cache.nblocks, 'fork: blocks left after freeing both branches')
    end
end)

T:test('a decode step within the blocks of the step before allocates no new memory', function()
    local m = glm5_random()
    local cache = Cache.new(m, {budget_bytes = 2^20, block_size = 8, max_seq_len = 128})
    local seqs = {cache:new_sequence(), cache:new_sequence()}
    local out = decode.prefill(cache, seqs, {prompt(9, 160, 1), prompt(17, 160, 2)})
    local toks = {argmax(out.logits:select(1, 1)), argmax(out.logits:select(1, 2))}
    out.logits:free()
    local checked, last_nblk = 0, nil
    for _ = 1, 20 do
        local nblk = 0
        for _, id in ipairs(seqs) do nblk = math.max(nblk, math.ceil((cache:length(id) + 1) / 8)) end
        local before = lunar.memory_stats('cpu').allocs
        out = decode.step(cache, seqs, toks)
        local fresh = lunar.memory_stats('cpu').allocs - before
        if nblk == last_nblk then
            assert(fresh == 0, ('a decode step over %d blocks per sequence, as the one before, made %d new allocations'):format(nblk, fresh))
            checked = checked + 1
        end
        last_nblk = nblk
        toks = {argmax(out.logits:select(1, 1)), argmax(out.logits:select(1, 2))}
        out.logits:free()
    end
    assert(checked >= 10, 'too few steps checked: ' .. checked)
end)

T:test('bytes per token, capacity and a budget too small for one sequence', function()
    local m = lunar.model.load(ROOT .. 'glm5_dsa')
    -- 4 layers x (kv_lora_rank 16 + qk_rope_head_dim 8) + 2 full-indexer layers x index_head_dim 16, f32
    local plan = Cache.plan(m, {budget_bytes = 2^20, block_size = 16, max_seq_len = 128})
    assert(plan.bytes_per_token == (4 * (16 + 8) + 2 * 16) * 4, 'bytes per token ' .. plan.bytes_per_token)
    assert(plan.bytes_per_token == 512)
    -- six cache tensors of 64-byte alignment: (2^20 - 6 * 64) // (512 * 16) = 127 blocks
    assert(plan.blocks == 127 and plan.tokens == 127 * 16, 'blocks ' .. plan.blocks)
    local c = Cache.new(m, {budget_bytes = 2^20, block_size = 16, max_seq_len = 128})
    assert(c:capacity() == 2032 and c:summary():find('512 bytes per token', 1, true), c:summary())
    print('  ' .. c:summary())
    c:release()
    local ok, err = pcall(Cache.new, m, {budget_bytes = 60000, block_size = 16, max_seq_len = 128})
    -- 8 blocks of 16 tokens x 512 bytes + 6 x 64 alignment = 65920 bytes
    assert(not ok and err:find('budget_bytes = 60000', 1, true) and err:find('max_seq_len = 128 tokens needs 65920 bytes', 1, true),
        tostring(err))
    assert(pcall(Cache.new, m, {budget_bytes = 65920, block_size = 16, max_seq_len = 128}))
    local g = lunar.model.load(ROOT .. 'glm4moe')
    -- 3 layers x 2 (K and V) x 2 KV heads x head_dim 16, f32
    assert(Cache.plan(g, {budget_bytes = 2^20, max_seq_len = 64}).bytes_per_token == 3 * 2 * 2 * 16 * 4)
end)

T:test('bad input: clear errors, and a refused call changes nothing', function()
    local m = lunar.model.load(ROOT .. 'glm5_dsa')
    local function fails(pat, fn, ...)
        local ok, err = pcall(fn, ...)
        assert(not ok, 'expected an error matching ' .. pat)
        assert(tostring(err):find(pat, 1, true), ('expected "%s" in: %s'):format(pat, tostring(err)))
    end
    fails('budget_bytes must be a positive whole number', Cache.new, m, {})
    fails('block_size must be a positive integer', Cache.new, m, {budget_bytes = 2^20, block_size = 0})
    fails("max_seq_len 300 exceeds the model's max_position_embeddings 256", Cache.new, m, {budget_bytes = 2^20, max_seq_len = 300})
    -- room for exactly two sequences of 32 tokens
    local c = Cache.new(m, {budget_bytes = 2 * 32 * 512 + 6 * 64, block_size = 8, max_seq_len = 32})
    assert(c.nblocks == 8)
    local a, b = c:new_sequence(), c:new_sequence()
    fails('prefill: prompt 2 is empty', decode.prefill, c, {a, b}, {{1, 2}, {}})
    fails('prefill: prompt 1, token 2 is 128, not a token id in [0, 128)', decode.prefill, c, {a}, {{1, 128}})
    fails('prefill: prompt 1, token 1 is 1.5', decode.prefill, c, {a}, {{1.5}})
    fails("prefill: prompt 1 has 33 tokens, more than the kv cache's max_seq_len 32", decode.prefill, c, {a}, {prompt(33, 128, 1)})
    fails('prefill: 2 sequences need 2 prompts, got 1', decode.prefill, c, {a, b}, {{1}})
    fails('is not a live sequence', decode.prefill, c, {99}, {{1}})
    assert(c:free_blocks() == 8 and c:length(a) == 0, 'a refused prefill took blocks')
    decode.prefill(c, {a, b}, {prompt(30, 128, 1), prompt(20, 128, 2)})
    fails('prefill: sequence 1 already holds 30 tokens', decode.prefill, c, {a}, {{1}})
    fails('decode: sequence 1 appears twice in one call', decode.step, c, {a, a}, {1, 2})
    fails('decode: 2 sequences need 2 tokens, got 1', decode.step, c, {a, b}, {1})
    fails('decode: tokens, token 1 is -1', decode.step, c, {a}, {-1})
    decode.step(c, {a}, {1}); decode.step(c, {a}, {2})
    fails("decode: sequence 1 would hold 33 tokens, more than the kv cache's max_seq_len 32", decode.step, c, {a}, {3})
    -- b holds 3 blocks; a third sequence takes the last free one, then b cannot grow past 24
    local d = c:new_sequence()
    decode.prefill(c, {d}, {prompt(8, 128, 3)})
    for t = 1, 4 do decode.step(c, {b}, {t}) end
    assert(c:length(b) == 24 and c:free_blocks() == 0)
    fails('decode: the kv cache has 0 free blocks of 8 tokens, these sequences need 2 more', decode.step, c, {b, d}, {1, 2})
    assert(c:length(b) == 24 and c:length(d) == 8 and c:free_blocks() == 0, 'a refused step changed the sequences')
    c:free(d)
    local e = c:new_sequence()
    decode.prefill(c, {e}, {prompt(7, 128, 1)})
    fails(('kv cache: fork of sequence %d needs a free block for its partly filled last block'):format(e), c.fork, c, e)
    c:free(b)
    fails('kv cache: free: 2 is not a live sequence', c.free, c, b)
    c:release()
    fails('the kv cache was released', decode.step, c, {a}, {1})
end)

os.exit(T:run())
