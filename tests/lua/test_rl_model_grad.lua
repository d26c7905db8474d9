-- test_rl_model_grad.lua: the model side of RL (lunar.model.glm): temperature-scaled log-probs,
-- the entropy output and backward{dlogprobs, dentropy}.
--   glm.entropy and the temperature log-probs on rows of logits against torch
--   (tests/fixtures/rl/token_stats.json, float64) within 1e-6;
--   tiny models (tests/fixtures/models): out.logprobs and out.entropy at temperature 0.7 against a
--   float64 computation on lunar's own logits of the same batch within 1e-6 (abs + rel);
--   parameter gradients of backward{dlogprobs, dentropy} against central finite differences of
--   sum(dlogprobs * logprobs + dentropy * entropy) (f32 model, eps 1e-2, rtol 3e-2, atol 3e-4 as
--   the LoRA gradcheck; parameters after the last routing decision and a dense layer's);
--   backward{dlogprobs = -1/n at valid targets} gives the SFT loss backward's gradients bit for
--   bit, also at a temperature and for LoRA adapters; errors of misuse.
local lunar = require 'lunar'
local io_ = require 'lunar.io'
local glm = require 'lunar.model.glm'
local peft = require 'lunar.peft'
local ops = lunar.ops
local T = require('lunar.testing').suite('rl.model')

local here = debug.getinfo(1, 'S').source:match('^@(.*)/[^/]*$') or '.'
local ROOT = here .. '/../fixtures/models/'

local function load_case(name)
    local dir = ROOT .. name
    local model = lunar.model.load(dir)
    local ref = io_.load_checkpoint(dir .. '/reference.safetensors')
    local batch = {input_ids = ref.input_ids, labels = ref.labels, position_ids = ref.position_ids,
                   attention_mask = ref.attention_mask, cu_seqlens = ref.cu_seqlens}
    return model, batch
end

-- (B*T) 1/0 f32: positions whose target counts
local function valid_targets(model, batch)
    local tg = model:targets(batch, model:prepare(batch))
    return ops.ne(tg, -100, {dtype = 'f32'})
end

T:test('glm.entropy and temperature log-probs match torch on rows of logits', function()
    local fx = io_.read_json(here .. '/../fixtures/rl/token_stats.json')
    assert(#fx.cases == 3)
    for _, case in ipairs(fx.cases) do
        local z = lunar.tensor(case.logits)
        if case.temperature ~= 1 then ops.div_(z, case.temperature) end
        local _, lp, lse = ops.cross_entropy(z, lunar.tensor(case.targets, {dtype = 'i64'}))
        T.close(lp, case.logprobs, {rtol = 1e-6, atol = 1e-6, msg = 'logprobs at T=' .. case.temperature})
        T.close(glm.entropy(z, lse), case.entropy, {rtol = 1e-6, atol = 1e-6, msg = 'entropy at T=' .. case.temperature})
    end
end)

for _, case in ipairs({'glm4moe', 'glm5_dsa', 'glm5_padded'}) do
    T:test(case .. ': logprobs and entropy at temperature 0.7 vs float64 on lunar\'s own logits', function()
        local model, batch = load_case(case)
        local raw = model:forward(batch, {keep = false}).logits:contiguous()
        local B, S, V = raw:size(1), raw:size(2), raw:size(3)
        local temp = 0.7
        local out = model:forward(batch, {logprobs = true, entropy = true, temperature = temp, keep = false})
        local tg = model:targets(batch, model:prepare(batch)):tolist_flat()
        local logits = raw:view(B * S, V):tolist_flat()
        local want_lp, want_h = {}, {}
        for r = 1, B * S do
            local zmax = -math.huge
            for v = 1, V do zmax = math.max(zmax, logits[(r - 1) * V + v] / temp) end
            local se = 0
            for v = 1, V do se = se + math.exp(logits[(r - 1) * V + v] / temp - zmax) end
            local lse = zmax + math.log(se)
            local h = 0
            for v = 1, V do
                local lp = logits[(r - 1) * V + v] / temp - lse
                h = h - math.exp(lp) * lp
            end
            want_h[r] = h
            want_lp[r] = tg[r] == -100 and 0 or logits[(r - 1) * V + tg[r] + 1] / temp - lse
        end
        T.close(out.logprobs, want_lp, {rtol = 1e-6, atol = 1e-6, msg = 'logprobs'})
        T.close(out.entropy, want_h, {rtol = 1e-6, atol = 1e-6, msg = 'entropy'})
        T.equal(out.entropy:size(), {B, S}, 'entropy shape')
        -- the scaled logits are what out.logits holds
        T.close(out.logits, ops.div(raw, temp), {rtol = 0, atol = 0, msg = 'scaled logits in place'})
    end)
end

-- f(model) = sum dlp * logprobs + dent * entropy, summed in float64
local function objective(model, batch, dlp, dent, temp)
    local out = model:forward(batch, {logprobs = true, entropy = true, temperature = temp, keep = false})
    local lp, h = out.logprobs:tolist_flat(), out.entropy:tolist_flat()
    local a, b = dlp:tolist_flat(), dent:tolist_flat()
    local f = 0
    for i = 1, #lp do f = f + a[i] * lp[i] + b[i] * h[i] end
    return f
end

T:test('glm4moe: backward{dlogprobs, dentropy} = central finite differences (temperature 0.8)', function()
    local model, batch = load_case('glm4moe')
    local B, S = batch.input_ids:size(1), batch.input_ids:size(2)
    local rng = lunar.core.rng_new(5)
    local valid = valid_targets(model, batch):view(B, S)
    local dlp = ops.mul(rng:normal_(lunar.empty(B, S), 0, 1), valid)
    local dent = rng:normal_(lunar.empty(B, S), 0, 0.5)
    local temp = 0.8
    model:zero_grad()
    model:forward(batch, {logprobs = true, entropy = true, temperature = temp})
    model:backward{dlogprobs = dlp, dentropy = dent}
    local names = {'lm_head.weight', 'model.norm.weight', 'model.layers.2.mlp.shared_experts.down_proj.weight',
                   'model.layers.2.mlp.shared_experts.up_proj.weight', 'model.layers.0.mlp.down_proj.weight',
                   'model.layers.2.self_attn.o_proj.weight'}
    local inputs, grads = {}, {}
    for _, name in ipairs(names) do
        inputs[#inputs + 1] = model:parameters()[name]
        local g = model:gradients()[name]
        assert(g, 'no gradient for ' .. name)
        assert(ops.norm(g):item() > 0, 'zero gradient for ' .. name)
        grads[#grads + 1] = g:clone()
    end
    T.gradcheck{name = 'rl objective', eps = 1e-2, rtol = 3e-2, atol = 3e-4, max_checks = 6,
        f = function() return objective(model, batch, dlp, dent, temp) end, inputs = inputs, grads = grads}
end)

T:test('glm4moe: the entropy part alone (dlogprobs nil) = finite differences', function()
    local model, batch = load_case('glm4moe')
    local B, S = batch.input_ids:size(1), batch.input_ids:size(2)
    local dent = lunar.core.rng_new(9):normal_(lunar.empty(B, S), 0, 1)
    local zero = lunar.zeros(B, S)
    model:zero_grad()
    model:forward(batch, {entropy = true})
    model:backward{dentropy = dent}
    local names = {'lm_head.weight', 'model.norm.weight'}
    local inputs, grads = {}, {}
    for _, name in ipairs(names) do
        inputs[#inputs + 1] = model:parameters()[name]
        grads[#grads + 1] = model:gradients()[name]:clone()
    end
    T.gradcheck{name = 'entropy', eps = 1e-2, rtol = 3e-2, atol = 3e-4, max_checks = 8,
        f = function() return objective(model, batch, zero, dent, 1) end, inputs = inputs, grads = grads}
end)

-- every gradient of two runs bit for bit
local function same_gradients(ga, gb, what)
    local n = 0
    for name, g in pairs(ga) do
        assert(gb[name], what .. ': ' .. name .. ' missing')
        T.equal(gb[name], g, what .. ': ' .. name)
        n = n + 1
    end
    for name in pairs(gb) do assert(ga[name], what .. ': extra ' .. name) end
    assert(n > 10, what .. ': gradients compared ' .. n)
end

local function clone_all(grads)
    local out = {}
    for name, g in pairs(grads) do out[name] = g:clone() end
    return out
end

for _, temp in ipairs({1, 0.6}) do
    T:test(('backward{dlogprobs = -1/n at valid targets} = the SFT loss backward, bit for bit (T = %g)'):format(temp),
        function()
        for _, case in ipairs({'glm5_dsa', 'glm5_packed'}) do
            local model, batch = load_case(case)
            model:zero_grad()
            local out = model:forward(batch, {loss = true, temperature = temp})
            model:backward()
            local sft = clone_all(model:gradients())
            model:zero_grad()
            local valid = valid_targets(model, batch)
            local n = ops.sum(valid):item()
            local dlp = ops.mul(valid, -1 / n):view(batch.input_ids:size())
            local out2 = model:forward(batch, {logprobs = true, temperature = temp})
            assert(out2.loss == out.loss)
            model:backward{dlogprobs = dlp}
            same_gradients(sft, model:gradients(), case)
        end
    end)
end

T:test('LoRA adapters: the RL backward reaches them like the SFT backward', function()
    local model, batch = load_case('glm5_dsa')
    local set = peft.apply(model, {targets = {'q_a_proj', 'o_proj', 'gate_proj', 'down_proj'}, r = 2, alpha = 4})
    local rng = lunar.core.rng_new(3)
    for _, mod in ipairs(set.order) do
        local ad = set:get(mod)
        rng:normal_(set.params:get(ad.b_name), 0, 0.1)
    end
    set.params:zero_grad()
    model:forward(batch, {loss = true})
    model:backward()
    assert(next(model.params.grads) == nil, 'no base gradients')
    local sft = clone_all(set.params.grads)
    set.params:zero_grad()
    local valid = valid_targets(model, batch)
    local dlp = ops.mul(valid, -1 / ops.sum(valid):item()):view(batch.input_ids:size())
    model:forward(batch, {logprobs = true, entropy = true})
    model:backward{dlogprobs = dlp, dentropy = lunar.zeros(batch.input_ids:size())}
    assert(next(model.params.grads) == nil, 'no base gradients (RL)')
    local rl = set.params.grads
    local n = 0
    for name, g in pairs(sft) do
        -- a zero dentropy adds exact zeros: the same values
        T.close(rl[name], g, {rtol = 0, atol = 0, msg = name})
        n = n + 1
    end
    assert(n > 4, 'adapter gradients compared: ' .. n)
end)

T:test('the entropy backward in chunks of 3 rows (N not a multiple) = one chunk, bit for bit', function()
    local z = lunar.randn(13, 37, {rng = lunar.core.rng_new(4)})
    local _, _, lse = ops.cross_entropy(z, lunar.zeros(13, {dtype = 'i64'}))
    local dH = lunar.randn(13, {rng = lunar.core.rng_new(6)})
    local h1 = glm.entropy(z, lse)
    local d1 = glm.entropy_backward_(lunar.zeros(13, 37), z, lse, h1, dH)
    local saved = glm.entropy_chunk_elems
    glm.entropy_chunk_elems = 3 * 37
    local ok, err = pcall(function()
        local h3 = glm.entropy(z, lse)
        T.equal(h3, h1, 'entropy')
        T.equal(glm.entropy_backward_(lunar.zeros(13, 37), z, lse, h3, dH), d1, 'entropy backward')
    end)
    glm.entropy_chunk_elems = saved
    assert(ok, err)
end)

T:test('head_positions: the head on some rows = those rows of the full forward, gradients too', function()
    for _, case in ipairs({'glm5_dsa', 'glm5_packed'}) do
        local model, batch = load_case(case)
        local B, S = batch.input_ids:size(1), batch.input_ids:size(2)
        local temp = 0.8
        -- every third position and the last one, out of order with a repeat left out
        local at = {}
        for p = B * S - 1, 0, -3 do at[#at + 1] = p end
        local pos = lunar.tensor(at, {dtype = 'i64'})
        local rng = lunar.core.rng_new(11)
        local dlp, dh = lunar.randn(#at, {rng = rng}), lunar.randn(#at, {rng = rng})
        -- full: the same upstream gradients scattered onto (B, T)
        model:zero_grad()
        local full = model:forward(batch, {logprobs = true, entropy = true, temperature = temp})
        local dlp_full, dh_full = lunar.zeros(B * S), lunar.zeros(B * S)
        ops.index_add_(dlp_full, 1, pos, dlp)
        ops.index_add_(dh_full, 1, pos, dh)
        model:backward{dlogprobs = dlp_full:view(B, S), dentropy = dh_full:view(B, S)}
        local g_full = clone_all(model:gradients())
        model:zero_grad()
        local part = model:forward(batch, {logprobs = true, entropy = true, temperature = temp, head_positions = pos})
        T.equal(part.logprobs:size(), {#at}, case .. ': logprobs shape')
        T.close(part.logprobs, ops.index_select(full.logprobs:contiguous():view(B * S), 1, pos),
            {rtol = 1e-6, atol = 1e-6, msg = case .. ': logprobs'})
        T.close(part.entropy, ops.index_select(full.entropy:contiguous():view(B * S), 1, pos),
            {rtol = 1e-6, atol = 1e-6, msg = case .. ': entropy'})
        model:backward{dlogprobs = dlp, dentropy = dh}
        local g_part, n = model:gradients(), 0
        for name, g in pairs(g_full) do
            T.close(g_part[name], g, {rtol = 1e-4, atol = 1e-6, msg = case .. ': ' .. name})
            n = n + 1
        end
        assert(n > 10, 'gradients compared: ' .. n)
        T.raises(function() model:forward(batch, {logprobs = true, head_positions = lunar.tensor({B * S}, {dtype = 'i64'})}) end,
            'head_positions holds ' .. B * S .. ', outside')
        T.raises(function() model:forward(batch, {logprobs = true, head_positions = lunar.tensor({0})}) end,
            'head_positions must be an i64 vector')
    end
end)

T:test('a packed row longer than index_topk of documents no longer than it = the documents alone', function()
    -- glm5_dsa's index_topk against documents of index_topk tokens at most, packed into one row
    -- longer than it: the row skips the indexer (every visible key is selected) and gives each
    -- document's logprobs as a forward of that document alone
    local model = lunar.model.load(ROOT .. 'glm5_dsa')
    local k = model.cfg.index_topk
    local lens, ids, cu = {k, k - 3, 5}, {}, {0}
    local docs = {}
    for d, n in ipairs(lens) do
        local doc = {}
        for i = 1, n do doc[i] = 1 + (d * 7919 + i * 104729) % (model.cfg.vocab_size - 2); ids[#ids + 1] = doc[i] end
        docs[d] = doc
        cu[#cu + 1] = #ids
    end
    assert(#ids > k, 'the row is longer than index_topk')
    local row = lunar.tensor({ids}, {dtype = 'i64'})
    local packed = model:forward({input_ids = row, labels = row, cu_seqlens = lunar.tensor(cu, {dtype = 'i64'})},
        {logprobs = true, keep = false}).logprobs:view(#ids):tolist_flat()
    for d, doc in ipairs(docs) do
        local one = lunar.tensor({doc}, {dtype = 'i64'})
        local alone = model:forward({input_ids = one, labels = one}, {logprobs = true, keep = false}).logprobs
        T.close(lunar.tensor({unpack(packed, cu[d] + 1, cu[d + 1])}),
            alone:view(#doc), {rtol = 1e-5, atol = 1e-5, msg = 'document ' .. d})
    end
end)

T:test('misuse: one clear error each', function()
    local model, batch = load_case('glm4moe')
    local B, S = batch.input_ids:size(1), batch.input_ids:size(2)
    T.raises(function() model:forward(batch, {logprobs = true, temperature = 0}) end,
        'opts.temperature must be a number > 0')
    model:forward(batch, {logprobs = true})
    T.raises(function() model:backward{dentropy = lunar.zeros(B, S)} end, 'dentropy needs forward(batch, {entropy = true})')
    model:forward(batch, {logprobs = true})
    T.raises(function() model:backward{dlogprobs = lunar.zeros(B, S + 1)} end, 'dlogprobs must be a (B, T) tensor')
    model:forward(batch, {logprobs = true})
    T.raises(function() model:backward{dlogprobs = lunar.zeros(B, S), loss_scale = 1} end,
        'give either loss_scale')
    local nolabels = {input_ids = batch.input_ids}
    local out = model:forward(nolabels, {entropy = true})
    assert(out.entropy and not out.logprobs)
    T.raises(function() model:backward{dlogprobs = lunar.zeros(B, S)} end, 'dlogprobs needs forward(batch, {logprobs = true})')
    model:forward(nolabels, {entropy = true})
    T.raises(function() model:backward() end, 'call forward(batch, {loss = true}) first')
end)

os.exit(T:run())
