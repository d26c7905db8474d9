-- test_model_flash.lua: GLM-5.3-Flash (glm5_next) models against transformers 5.25.0, from the
-- committed fixtures tests/fixtures/models/flash_* (tests/ref/make_flash_refs.py): each case's
-- checkpoint loaded by lunar.model.load, its batch run forward and backward:
--   logits at the tokens: max error / max |logit| below 1e-5; the loss within 1e-6 relative;
--   each DSA layer's selection the same set of keys as HF's for every token; every parameter
--   gradient within 1e-4 relative L2 (norms floored at 1e-5 of the largest gradient's; exactly the
--   parameters HF gives one get one);
-- and what transformers cannot do: a packed row equals each document run alone.
local lunar = require 'lunar'
local lio = require 'lunar.io'
local core = require 'lunar.core'
local ops = lunar.ops
local T = require('lunar.testing').suite('model.flash')

local ROOT = 'tests/fixtures/models/'

local function rel_l2(a, b)
    local af, bf = a:contiguous():float():tolist_flat(), b:contiguous():float():tolist_flat()
    assert(#af == #bf, ('sizes differ: %d and %d'):format(#af, #bf))
    local num, den = 0, 0
    for i = 1, #bf do num = num + (af[i] - bf[i]) ^ 2; den = den + bf[i] ^ 2 end
    return math.sqrt(num / math.max(den, 1e-30))
end

local function sorted_valid(list)
    local out = {}
    for _, v in ipairs(list) do if v >= 0 then out[#out + 1] = v end end
    table.sort(out)
    return table.concat(out, ',')
end

local function run_case(name)
    local dir = ROOT .. name
    local ref = lio.load_checkpoint(dir .. '/reference.safetensors')
    local model = lunar.model.load(dir)
    local batch = {input_ids = ref.input_ids, attention_mask = ref.attention_mask, labels = ref.labels}
    local out = model:forward(batch, {loss = true})
    local B, Tn, V = ref.logits:size(1), ref.logits:size(2), ref.logits:size(3)
    -- logits at the tokens (padding rows are never read)
    local am = ref.attention_mask:tolist_flat()
    local got, want = out.logits:contiguous():tolist_flat(), ref.logits:contiguous():tolist_flat()
    local err, scale = 0, 0
    for r = 0, B * Tn - 1 do
        if am[r + 1] ~= 0 then
            for v = 1, V do
                err = math.max(err, math.abs(got[r * V + v] - want[r * V + v]))
                scale = math.max(scale, math.abs(want[r * V + v]))
            end
        end
    end
    if not (err / scale < 1e-5) then error(('%s: logits max error %.3g of max |logit| %.3g'):format(name, err, scale)) end
    local lref = ref.loss:item()
    if not (math.abs(out.loss - lref) / math.abs(lref) < 1e-6) then
        error(('%s: loss %.9g, HF %.9g'):format(name, out.loss, lref))
    end
    -- the DSA selections, as sets per token
    local nsel = 0
    for key, t in pairs(ref) do
        local layer = key:match('^topk%.(%d+)$')
        if layer then
            local mine = out.topk[tonumber(layer)]
            assert(mine, name .. ': no selection from layer ' .. layer)
            local W1, W2 = t:size(3), mine:size(3)
            local a, b = t:tolist_flat(), mine:tolist_flat()
            for r = 0, B * Tn - 1 do
                if am[r + 1] ~= 0 then
                    local sa, sb = {}, {}
                    for j = 1, W1 do sa[j] = a[r * W1 + j] end
                    for j = 1, W2 do sb[j] = b[r * W2 + j] end
                    if sorted_valid(sa) ~= sorted_valid(sb) then
                        error(('%s: layer %s token %d selects {%s}, HF {%s}'):format(name, layer, r, sorted_valid(sb),
                            sorted_valid(sa)))
                    end
                end
            end
            nsel = nsel + 1
        end
    end
    assert(nsel > 0, name .. ': the fixture has no DSA selection')
    model:backward()
    local grads = model:gradients()
    -- relative L2 error below 1e-4, the norm floored at 1e-5 of the largest gradient's: a gradient
    -- that small is a sum of cancelling terms fixed only to f32 rounding (transformers' own f32
    -- gradient of such a tensor, e.g. a layer's mHC scales, moves 1e-4 under another rounding of
    -- the same inputs)
    local largest = 0
    for key, g in pairs(ref) do
        if key:match('^grad%.') then largest = math.max(largest, ops.norm(g:float()):item()) end
    end
    local n, floored, worst, worst_name = 0, 0, 0, ''
    for key, g in pairs(ref) do
        local pname = key:match('^grad%.(.*)$')
        if pname then
            local mine = grads[pname]
            assert(mine, name .. ': no gradient for ' .. pname)
            local gn = ops.norm(g:float()):item()
            if gn > 0 and gn < 1e-5 * largest then floored = floored + 1 end
            local e = ops.norm(ops.sub(mine, g:float())):item() / math.max(gn, 1e-5 * largest)
            if e > worst then worst, worst_name = e, pname end
            n = n + 1
        end
    end
    if not (worst < 1e-4) then error(('%s: gradient of %s: relative L2 error %.3g'):format(name, worst_name, worst)) end
    print(('%s: %d gradients, worst relative L2 %.3g (%s); %d nonzero ones below the floor'):format(name, n, worst, worst_name, floored))
    for pname in pairs(grads) do
        assert(ref['grad.' .. pname], name .. ': ' .. pname .. ' got a gradient, HF gives it none')
    end
    return n, err / scale, worst, model
end

T:test('flash_a (hc_mult 4, KDA over 3 chunks, full + shared + full DSA, clamps, left padding) equals HF', function()
    local n = run_case('flash_a')
    assert(n > 200, n)
end)

T:test('flash_b (hc_mult 2, tied embeddings, softplus gate, kp 2 without tail, right padding) equals HF', function()
    run_case('flash_b')
end)

T:test('a packed row equals each document alone (KDA state, conv history and pools reset)', function()
    local model = lunar.model.load(ROOT .. 'flash_a')
    local ref = lio.load_checkpoint(ROOT .. 'flash_a/reference.safetensors')
    local ids = ref.input_ids:select(1, 1)          -- (140) tokens of row 0
    local cut = {0, 37, 100, 140}
    local packed = model:forward({input_ids = ids:view(1, 140), labels = ids:view(1, 140),
                                  cu_seqlens = lunar.tensor(cut, 'i64')}, {loss = true})
    local worst = 0
    for d = 1, 3 do
        local a, len = cut[d], cut[d + 1] - cut[d]
        local piece = ids:narrow(1, a + 1, len):contiguous():view(1, len)
        local alone = model:forward({input_ids = piece, labels = piece}, {loss = true})
        local p = packed.logits:narrow(2, a + 1, len)
        local e = ops.max(ops.abs(ops.sub(p, alone.logits))):item() / ops.max(ops.abs(alone.logits)):item()
        worst = math.max(worst, e)
        -- the selections too
        for layer, sel in pairs(alone.topk) do
            local ps = packed.topk[layer]:narrow(2, a + 1, len):contiguous():tolist_flat()
            local as = sel:contiguous():tolist_flat()
            local W1, W2 = packed.topk[layer]:size(3), sel:size(3)
            for s = 0, len - 1 do
                local x, y = {}, {}
                for j = 1, W1 do local v = ps[s * W1 + j]; x[j] = v >= 0 and v - a or -1 end
                for j = 1, W2 do y[j] = as[s * W2 + j] end
                assert(sorted_valid(x) == sorted_valid(y), ('document %d layer %d token %d'):format(d, layer, s))
            end
        end
    end
    assert(worst < 1e-5, ('packed logits %.3g from the documents alone'):format(worst))
end)

local function read_config(case)
    return lio.read_json(ROOT .. case .. '/config.json')
end

local function copy(t)
    if type(t) ~= 'table' then return t end
    local o = {}
    for k, v in pairs(t) do o[k] = copy(v) end
    return o
end

T:test('the flat text-only config equals the nested one; the outer config decides the tie', function()
    local nested = read_config('flash_b')
    local a = lunar.model.config.from_table(nested, 'nested')
    local flat = copy(nested.text_config)
    flat.architectures, flat.model_type = {'Glm5NextForConditionalGeneration'}, 'glm5_next'
    flat.tie_word_embeddings = nested.tie_word_embeddings
    local b = lunar.model.config.from_table(flat, 'flat')
    for _, k in ipairs({'hidden_size', 'hc_mult', 'index_kpool', 'linear_num_heads', 'swiglu_limit', 'tie_word_embeddings',
                        'linear_lower_bound', 'index_kpool_always_select_tail'}) do
        assert(a[k] == b[k], k .. ': ' .. tostring(a[k]) .. ' vs ' .. tostring(b[k]))
    end
    for i = 1, a.num_hidden_layers do
        assert(a.layer_types[i] == b.layer_types[i] and a.indexer_types[i] == b.indexer_types[i])
    end
    assert(a.tie_word_embeddings == true and a.linear_lower_bound == nil and a.nested and not b.nested)
    -- the text config's own tie flag is not read (transformers ignores it)
    local c = copy(nested)
    c.text_config.tie_word_embeddings = false
    assert(lunar.model.config.from_table(c, 'x').tie_word_embeddings == true)
    -- the derived schedules: KDA except every 4th layer, 3 dense MLP layers, legacy names
    local d = lunar.model.config.from_table({model_type = 'glm5_next', text_config = {num_hidden_layers = 8,
        vocab_size = 256, index_kpool = 4, pad_token_id = 0}}, 'defaults')
    assert(table.concat(d.layer_types, ' '):gsub('linear_attention', 'K'):gsub('indexed_attention', 'D') == 'K K K D K K K D')
    assert(table.concat(d.mlp_layer_types, ' ') == 'dense dense dense sparse sparse sparse sparse sparse')
    assert(d.hidden_size == 4096 and d.n_routed_experts == 288 and d.linear_lower_bound == -5 and d.hc_mult == 4)
    local e = lunar.model.config.from_table({model_type = 'glm5_next', num_hidden_layers = 2, vocab_size = 256,
        pad_token_id = 0, index_kpool = 4, layer_types = {'mamba', 'deepseek_sparse_attention'},
        linear_attn_config = {num_heads = 3, head_dim = 5, short_conv_kernel_size = 2, gate_lower_bound = -3}}, 'legacy')
    assert(e.layer_types[1] == 'linear_attention' and e.layer_types[2] == 'indexed_attention')
    assert(e.linear_num_heads == 3 and e.linear_head_dim == 5 and e.linear_conv_kernel_dim == 2 and e.linear_lower_bound == -3)
end)

T:test('bad configs and checkpoints: one line naming the key or tensor', function()
    local base = read_config('flash_a')
    local function bad(mut, want)
        local c = copy(base)
        mut(c.text_config, c)
        local err = T.raises(function() lunar.model.config.from_table(c, 'cfg.json') end, want)
        assert(not err:find('\n'), 'one line: ' .. err)
    end
    bad(function(t) t.qk_rope_head_dim = 64 end, 'qk_rope_head_dim (64) must be 0')
    bad(function(t) t.layer_types[7] = 'linear_attention' end, 'layer_types has 7 entries but num_hidden_layers is 6')
    bad(function(t) t.layer_types[2] = 'sliding_attention' end, 'layer_types entry 2 is "sliding_attention"')
    bad(function(t) t.indexer_types[3] = 'half' end, 'indexer_types entry 3 is "half"')
    bad(function(t) t.hc_mult = 0 end, 'hc_mult (0) must be between 1 and 64')
    bad(function(t) t.index_topk = 10 end, 'index_topk (10) must be divisible by index_kpool (4)')
    bad(function(t) t.num_key_value_heads = 2 end, 'num_key_value_heads (2) must equal num_attention_heads (4)')
    bad(function(t) t.q_lora_rank = lunar.io.null end, 'q_lora_rank is null')
    -- a shared DSA layer after a KDA layer (transformers fails at its first forward)
    bad(function(t) t.indexer_types[6] = 'shared' end, "makes DSA layer 5 'shared', but layer 4 is not a full DSA layer")
    -- a checkpoint missing a KDA tensor
    local dir = os.tmpname()
    os.remove(dir)
    os.execute(('mkdir -p %q'):format(dir))
    local tensors = lio.load_checkpoint(ROOT .. 'flash_a/model.safetensors')
    tensors['model.language_model.layers.4.self_attn.k_conv1d.weight'] = nil
    lio.save_checkpoint(dir, tensors)
    lio.write_json(dir .. '/config.json', base)
    T.raises(function() lunar.model.load(dir) end, 'model.language_model.layers.4.self_attn.k_conv1d.weight')
    os.execute(('rm -rf %q'):format(dir))
end)

T:test('import then export is byte-identical (one file and sharded), the vision tower carried', function()
    local model = lunar.model.load(ROOT .. 'flash_a')
    local src = lio.load_checkpoint(ROOT .. 'flash_a/model.safetensors')
    local nvis = 0
    for name in pairs(src) do if name:find('^model%.visual%.') then nvis = nvis + 1 end end
    assert(nvis > 0, 'the fixture has vision tensors')
    for _, shard in ipairs({false, 40000}) do
        local dir = os.tmpname()
        os.remove(dir)
        model:save_hf(dir, {max_shard_bytes = shard or nil})
        local back = lio.load_checkpoint(dir)
        local n = 0
        for name, t in pairs(src) do
            local b = back[name]
            assert(b, 'export lacks ' .. name)
            assert(b:dtype() == t:dtype(), name .. ' dtype')
            T.equal(b, t, name)
            n = n + 1
        end
        for name in pairs(back) do assert(src[name], 'export adds ' .. name) end
        if not shard then
            local f1 = assert(io.open(ROOT .. 'flash_a/model.safetensors', 'rb'))
            local f2 = assert(io.open(dir .. '/model.safetensors', 'rb'))
            local a, b = f1:read('*a'), f2:read('*a')
            f1:close(); f2:close()
            assert(a == b, 'model.safetensors differs from the imported file byte for byte')
        end
        os.execute(('rm -rf %q'):format(dir))
    end
end)

T:test('the FP8 block-scaled form loads as exactly the BF16 weights it encodes', function()
    -- every projection stored as f8e4m3 with block scales (a power of two per block, so the BF16
    -- weight q * s is exact), against the same weights stored in BF16; blocks of 16 x 16 (the
    -- release's are 128 x 128: quantization_config.weight_block_size), so the tiny matrices hold
    -- several blocks with different scales
    local BS = 16
    local src = lio.load_checkpoint(ROOT .. 'flash_b/model.safetensors')
    local fp8, bf16 = {}, {}
    local nq, varied = 0, 0
    for name, t in pairs(src) do
        if name:find('_proj%.weight$') and t:dim() == 2 and not name:find('indexer', 1, true) then
            local R, C = t:size(1), t:size(2)
            local q = core.empty({R, C}, 'f8e4m3', 'cpu')
            local scale = core.empty({math.ceil(R / BS), math.ceil(C / BS)}, 'f32', 'cpu')
            local deq = core.empty({R, C}, 'f32', 'cpu')
            for bi = 1, scale:size(1) do
                for bj = 1, scale:size(2) do
                    local r0, c0 = (bi - 1) * BS, (bj - 1) * BS
                    local blk = t:narrow(1, r0 + 1, math.min(BS, R - r0)):narrow(2, c0 + 1, math.min(BS, C - c0)):float()
                    local amax = ops.max(ops.abs(blk)):item()
                    local s = 2 ^ math.ceil(math.log(math.max(amax, 1e-30) / 448) / math.log(2))
                    scale:narrow(1, bi, 1):narrow(2, bj, 1):fill_(s)
                    local qb = ops.div(blk, s):to('f8e4m3')
                    q:narrow(1, r0 + 1, blk:size(1)):narrow(2, c0 + 1, blk:size(2)):copy_(qb)
                    deq:narrow(1, r0 + 1, blk:size(1)):narrow(2, c0 + 1, blk:size(2)):copy_(ops.mul(qb:to('f32'), s))
                end
            end
            if ops.max(scale):item() ~= ops.min(scale):item() then varied = varied + 1 end
            fp8[name], fp8[name .. '_scale_inv'] = q, scale
            bf16[name] = deq:to('bf16')
            nq = nq + 1
        else
            fp8[name], bf16[name] = t, t
        end
    end
    assert(nq > 40, 'projections quantised: ' .. nq)
    assert(varied > 10, 'tensors whose blocks have different scales: ' .. varied)
    local cfg = lio.read_json(ROOT .. 'flash_b/config.json')
    local d8, d16 = os.tmpname(), os.tmpname()
    os.remove(d8); os.remove(d16)
    os.execute(('mkdir -p %q %q'):format(d8, d16))
    lio.write_json(d16 .. '/config.json', cfg)
    lio.save_safetensors(d16 .. '/model.safetensors', bf16)
    cfg.quantization_config = {quant_method = 'fp8', fmt = 'e4m3', activation_scheme = 'dynamic',
                               weight_block_size = {BS, BS}}
    lio.write_json(d8 .. '/config.json', cfg)
    lio.save_safetensors(d8 .. '/model.safetensors', fp8)
    local a, b = lunar.model.load(d8, {quiet = true}), lunar.model.load(d16)
    local n = 0
    for name, t in pairs(b:parameters()) do
        T.equal(a:parameters()[name], t, name)
        n = n + 1
    end
    assert(n > nq)
    -- a block size the scales do not fit: one line naming the scale tensor
    cfg.quantization_config.weight_block_size = {128, 128}
    lio.write_json(d8 .. '/config.json', cfg)
    T.raises(function() lunar.model.load(d8, {quiet = true}) end, '_scale_inv has shape')
    os.execute(('rm -rf %q %q'):format(d8, d16))
end)

T:test('split layouts: this rank\'s blocks by heads; what is not built yet is refused in one line', function()
    local cfg = lunar.model.config.from_table(read_config('flash_a'), 'flash_a')
    local fparams = require 'lunar.model.glm5_next_params'
    local whole, split = {}, {}
    for _, s in ipairs(fparams.spec(cfg)) do whole[s.name] = s end
    for _, s in ipairs(fparams.spec(cfg, {tp = {rank = 1, size = 2}, experts = {first = 4, count = 4}})) do split[s.name] = s end
    local a = 'model.language_model.layers.0.self_attn.'
    -- KDA by heads: q/k/v and their convs, f_b, dt_bias, A_log, b, g_b by rows; o_proj by columns
    for _, n in ipairs({'q_proj.weight', 'q_conv1d.weight', 'f_b_proj.weight', 'dt_bias', 'A_log', 'b_proj.weight',
                        'g_b_proj.weight'}) do
        local s = split[a .. n]
        assert(s.slice and s.slice.dim == 1 and s.slice.start == s.shape[1] and s.full_shape[1] == 2 * s.shape[1], n)
        T.equal(#s.shape, #whole[a .. n].shape, n .. ': the same rank')
    end
    assert(split[a .. 'o_proj.weight'].slice.dim == 2, 'o_proj by columns')
    for _, n in ipairs({'f_a_proj.weight', 'g_a_proj.weight', 'o_norm.weight'}) do
        assert(not split[a .. n].slice, n .. ' whole')
    end
    -- this rank's experts only
    assert(split['model.language_model.layers.1.mlp.experts.4.gate_proj.weight'] and
           not split['model.language_model.layers.1.mlp.experts.3.gate_proj.weight'], 'experts 4..7')
    local fake = {size = function() return 2 end, rank = function() return 0 end}
    T.raises(function() lunar.model.load(ROOT .. 'flash_b', {tp = fake, sequence_parallel = true}) end,
        'with sequence_parallel is not implemented for glm5_next')
    T.raises(function() lunar.model.load(ROOT .. 'flash_b', {tp = fake, split_indexer = true}) end,
        'with split_indexer is not implemented for glm5_next')
    local model = lunar.model.load(ROOT .. 'flash_b')
    local ids = lunar.tensor({{1, 2, 3, 4}}, 'i64')
    T.raises(function() model:forward({input_ids = ids, key_lists = lunar.tensor({{{0}}}, 'i64')}) end,
        'batch.key_lists is not supported by glm5_next')
    T.raises(function() model:forward({input_ids = ids, position_ids = lunar.tensor({{0, 1, 0, 1}}, 'i64')}) end,
        'position_ids (restarting without cu_seqlens)')
    -- positions that say nothing more are taken
    model:forward({input_ids = ids, position_ids = lunar.tensor({{0, 1, 2, 3}}, 'i64')})
end)

os.exit(T:run())
