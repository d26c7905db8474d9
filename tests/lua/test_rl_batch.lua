-- test_rl_batch.lua: the RL training batches (lunar.rl.batch). A group's samples packed with one
-- copy of their prompt (share_prompts) give the logprobs and entropies of the plain packing (each
-- sample with its own prompt copy) within 1e-5, and the same parameter gradients within 1e-4
-- relative, on fixture models with MLA + DSA (the indexer choosing among more keys than index_topk,
-- and every key selected) and with GQA; the routes generation recorded land on the tokens they
-- were recorded for; a group whose samples routed their prompt differently is not shared.
local lunar = require 'lunar'
local rlbatch = require 'lunar.rl.batch'
local ops = lunar.ops
local T = require('lunar.testing').suite('rl.batch')

local here = debug.getinfo(1, 'S').source:match('^@(.*)/[^/]*$') or '.'
local ROOT = here .. '/../fixtures/models/'

-- deterministic token lists
local function tokens(n, seed, vocab)
    local out = {}
    for i = 1, n do out[i] = 1 + (seed * 7919 + i * 104729 + i * i * 31) % (vocab - 2) end
    return out
end

-- two groups (prompts of 5 and 7 tokens) of 3 samples with responses of several lengths, and a
-- lone sample; routes: each token's experts (rows: prompt then response but its last token)
local function groups_for(model, opts)
    local V, K = model.cfg.vocab_size, model.cfg.num_experts_per_tok
    local E = model.cfg.n_routed_experts
    local groups = {}
    for g, spec in ipairs({{5, {4, 1, 6}}, {7, {3, 5, 2}}, {4, {5}}}) do
        local prompt = tokens(spec[1], g, V)
        local grp = {samples = {}}
        for i, n in ipairs(spec[2]) do
            local s = {prompt_ids = prompt, ids = tokens(n, 10 * g + i, V), logprobs = {}, train = i ~= 2 or g ~= 2}
            for j = 1, n do s.logprobs[j] = -1 end
            if opts.routing then
                s.routing = {}
                for _, layer in ipairs(opts.moe_layers) do
                    local rows, flat = spec[1] + n - 1, {}
                    for r = 1, rows do
                        -- the prompt's rows are the group's; the response's the sample's own
                        local key = r <= spec[1] and (g * 100 + r) or (g * 1000 + i * 100 + r)
                        local a = key % E
                        flat[#flat + 1] = a
                        flat[#flat + 1] = (a + 1 + key % (E - 1)) % E
                    end
                    s.routing[layer] = lunar.tensor(flat, {dtype = 'i64'}):view(rows, K)
                end
            end
            grp.samples[i] = s
        end
        groups[g] = grp
    end
    return groups
end

local function moe_layers(model)
    local list = {}
    for i, L in ipairs(model.layers) do if L.mlp_type == 'sparse' then list[#list + 1] = i - 1 end end
    return list
end

-- logprobs and entropy (S, R) of the one micro-batch, and the gradients of sum(G * logprobs)
local function run_layout(model, groups, share, opts)
    local minis = rlbatch.build(groups, {mini_batches = 1, micro_batch = 64, share_prompts = share,
        routing = opts.routing, replay = opts.routing, experts_per_token = model.cfg.num_experts_per_tok,
        moe_layers = opts.moe_layers})
    assert(#minis == 1 and #minis[1].micro == 1)
    local mb = minis[1].micro[1]
    mb.batch.block_mask = rlbatch.block_mask(mb, 'cpu')
    model:zero_grad()
    local out = model:forward(mb.batch, {logprobs = true, entropy = true, head_positions = mb.positions,
        head_targets = mb.targets})
    local function gather(v) return ops.mul(ops.index_select(v, 1, mb.index):view(mb.S, mb.R), mb.mask) end
    local lp, ent = gather(out.logprobs), gather(out.entropy)
    local G = ops.mul(lunar.randn(mb.S, mb.R, {rng = lunar.core.rng_new(9)}), mb.mask)
    local d = lunar.zeros(mb.P)
    ops.index_add_(d, 1, mb.index, G:contiguous():view(mb.S * mb.R))
    model:backward{dlogprobs = d}
    local grads = {}
    for name, g in pairs(model:gradients()) do grads[name] = g:clone() end
    return {lp = lp, ent = ent, grads = grads, T = mb.T, mb = mb}
end

local function compare(model, groups, opts, what)
    local plain = run_layout(model, groups, false, opts)
    local shared = run_layout(model, groups, true, opts)
    assert(shared.T < plain.T, ('%s: the shared row is shorter (%d against %d tokens)'):format(what, shared.T, plain.T))
    T.close(shared.lp, plain.lp, {rtol = 1e-5, atol = 1e-5, msg = what .. ': logprobs'})
    T.close(shared.ent, plain.ent, {rtol = 1e-5, atol = 1e-5, msg = what .. ': entropy'})
    local n = 0
    for name, g in pairs(plain.grads) do
        local s = shared.grads[name]
        assert(s, what .. ': no gradient for ' .. name)
        local diff = ops.norm(ops.sub(s, g)):item()
        local ref = math.max(ops.norm(g):item(), 1e-12)
        assert(diff / ref < 1e-4, ('%s: %s differs by %.3g relative'):format(what, name, diff / ref))
        n = n + 1
    end
    assert(n > 10, what .. ': gradients compared: ' .. n)
    return plain, shared
end

T:test('glm5_dsa (MLA, the DSA indexer choosing 4 of more keys): shared prompts = the plain packing', function()
    local model = lunar.model.load(ROOT .. 'glm5_dsa')
    local opts = {routing = false, moe_layers = moe_layers(model)}
    compare(model, groups_for(model, opts), opts, 'glm5_dsa')
end)

T:test('glm5_dsa with every visible key selected (index_topk 64): the key lists are the selection', function()
    local model = lunar.model.load(ROOT .. 'glm5_dsa')
    for _, L in ipairs(model.layers) do if L.attn.index_topk then L.attn.index_topk = 64 end end
    local opts = {routing = false, moe_layers = moe_layers(model)}
    compare(model, groups_for(model, opts), opts, 'glm5_dsa topk 64')
end)

T:test('glm4moe (GQA): shared prompts = the plain packing', function()
    local model = lunar.model.load(ROOT .. 'glm4moe')
    local opts = {routing = false, moe_layers = moe_layers(model)}
    compare(model, groups_for(model, opts), opts, 'glm4moe')
end)

T:test('routing replay: each token gets the routes recorded for it, in both layouts', function()
    local model = lunar.model.load(ROOT .. 'glm5_dsa')
    local opts = {routing = true, moe_layers = moe_layers(model)}
    local groups = groups_for(model, opts)
    local plain, shared = compare(model, groups, opts, 'glm5_dsa replayed')
    -- the routes of each sample's tokens, read back from the packed rows of both layouts
    local function routes_of(mb, layer, s, first_row, n)
        return mb.batch.routing[layer]:narrow(1, first_row + 1, n):tolist_flat(), s
    end
    local layer = opts.moe_layers[1]
    local pi, si = 0, 0       -- packed offsets: plain, shared
    local shared_prompt_at = {}
    for _, g in ipairs(groups) do
        for i, s in ipairs(g.samples) do
            local P, n = #s.prompt_ids, #s.ids
            local want = s.routing[layer]:tolist_flat()
            local got = routes_of(plain.mb, layer, s, pi, P + n - 1)
            for k = 1, #want do assert(got[k] == want[k], 'plain layout: route ' .. k) end
            pi = pi + P + n
            if i == 1 then shared_prompt_at[g] = si; si = si + P end
            local gp = routes_of(shared.mb, layer, s, shared_prompt_at[g], P)
            local gr = routes_of(shared.mb, layer, s, si, n - 1)
            local K = model.cfg.num_experts_per_tok
            for k = 1, P * K do assert(gp[k] == want[k], 'shared layout: prompt route ' .. k) end
            for k = 1, (n - 1) * K do assert(gr[k] == want[P * K + k], 'shared layout: response route ' .. k) end
            si = si + n
        end
    end
end)

T:test('a sample whose prompt was routed otherwise gets a prompt copy of its own', function()
    local model = lunar.model.load(ROOT .. 'glm5_dsa')
    local opts = {routing = true, moe_layers = moe_layers(model)}
    local groups = groups_for(model, opts)
    local s = groups[1].samples[2]
    local r = s.routing[opts.moe_layers[1]]:clone()
    local K = model.cfg.num_experts_per_tok
    local flat = r:tolist_flat()
    flat[1], flat[2] = flat[2], flat[1] == flat[2] and flat[1] or flat[1]
    flat[1] = (flat[1] + 3) % model.cfg.n_routed_experts
    if flat[1] == flat[2] then flat[1] = (flat[1] + 1) % model.cfg.n_routed_experts end
    s.routing[opts.moe_layers[1]] = lunar.tensor(flat, {dtype = 'i64'}):view(r:size(1), K)
    local all = run_layout(model, groups, true, opts)
    local together = run_layout(model, groups_for(model, opts), true, opts)
    -- one more prompt copy (5 tokens) than when the group's prompt routes agree
    T.equal(all.T, together.T + #s.prompt_ids, 'tokens in the row')
end)

os.exit(T:run())
