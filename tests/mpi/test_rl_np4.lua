-- np: 4
-- The RL recipes on 4 ranks (lunar.rl.parallel): the step's prompts split over dp, the model over
-- tp / ep / etp, generation on the sharded weights. Against the same recipe on one rank:
--   * GRPO (KL term, two mini-batches) at dp=4, tp=2 x ep=2 and ep=2 x etp=2: the same rollouts
--     (reward, lengths, tokens), and per step the loss, gradient norm, entropy, clip fraction, ratios,
--     KL, loss terms and trained tokens
--     within 1e-5 relative or 1e-6 absolute (the loss of a group-normalised batch cancels to near 0);
--   * DAPO with dynamic sampling at ep=4: the ranks keep different numbers of groups (dummy
--     micro-batches pad them), the kept, dropped and short counts and the loss are one rank's;
--   * a GRPO run at tp=2 x ep=2 stopped after a checkpoint and resumed gives the later steps'
--     metrics bit for bit, resumed at ep=4 instead (the optimizer state resharded) within the
--     tolerance above, and its final model is one rank's format (transformers' names);
--   * LoRA GRPO at tp=2 x ep=2 trains and writes its adapters.
local lunar = require 'lunar'
local common = dofile('tests/mpi/common.lua')
local dpc = dofile('tests/mpi/dp_common.lua')
local d = lunar.dist

lunar.threads(1)
local T = common.suite('rl recipes np4', 4)
local recipes = dofile('recipes/common.lua')

-- a reward that tells samples apart: a score in {-1, -1/3, 1/3, 1} from the response's bytes
local function reward(text)
    local h = 0
    for i = 1, #text do h = (h * 31 + text:byte(i)) % 1000003 end
    return (h % 4) * 2 / 3 - 1
end

local merge = dpc.merge

local function small(dir, extra)
    return merge({quiet = true, data = {limit = 64, valid = false},
        rl = {reward = reward, prompts = 4, n = 4, micro_batch = 3, mini_batches = 2, kl_coef = 0.01},
        rollout = {max_new_tokens = 10, max_prompt_len = 400},
        train = {steps = 2, log_every = 100},
        checkpoint = {dir = dir .. '/ckpt', every = 100, keep_last = 3},
        metrics = {dir = dir, tensorboard = false}, output = {dir = dir .. '/final'},
        parallel = {bucket_mb = 1}}, extra)
end

-- the metrics.jsonl rows of training steps (rank 0's files)
local function steps_of(dir)
    local out = {}
    local f = assert(io.open(dir .. '/metrics.jsonl', 'rb'))
    for line in f:read('*a'):gmatch('[^\n]+') do
        local row = lunar.io.decode_json(line)
        if row.reward_mean ~= nil then out[row.step] = row end
    end
    f:close()
    return out
end

-- the one-rank run on rank 0 (the others wait), its rows sent to every rank
local function one_rank(kind, dir, extra)
    if d.rank() == 0 then
        local cfg = recipes.recipe(kind, small(dir, extra))
        recipes.validate(cfg)
        recipes.validate_rl(cfg)
        cfg.single_rank = true
        require('lunar.rl.trainer').run(recipes.clean(cfg))
    end
    d.barrier()
    return steps_of(dir)
end

local KEYS = {'loss', 'grad_norm', 'entropy_mean', 'pg_clipfrac', 'ratio_mean', 'ratio_min', 'ratio_max', 'kl_mean',
              'kl_term', 'pg_loss', 'train_tokens', 'logprob_gap', 'reward_mean', 'reward_std', 'response_len_mean',
              'response_len_max', 'tokens'}

local function same_steps(label, got, want, n, keys)
    local worst_rel, worst_abs, compared = 0, 0, 0
    for s = 1, n do
        local g, w = got[s], want[s]
        assert(g and w, ('%s: step %d missing'):format(label, s))
        for _, k in ipairs(keys or KEYS) do
            local a, b = g[k], w[k]
            if b ~= nil or a ~= nil then
                assert(type(a) == 'number' and type(b) == 'number', ('%s step %d: %s is %s, one rank %s'):format(label,
                    s, k, tostring(a), tostring(b)))
                local err = math.abs(a - b)
                local rel = err / math.max(math.abs(b), 1e-30)
                assert(err <= 1e-6 or rel <= 1e-5, ('%s step %d: %s %.9g, one rank %.9g (rel %.3g)'):format(label, s, k,
                    a, b, rel))
                worst_abs, compared = math.max(worst_abs, err), compared + 1
                if math.abs(b) >= 1e-3 then worst_rel = math.max(worst_rel, rel) end
            end
        end
    end
    if d.rank() == 0 then
        print(('  %s: %d steps, %d numbers; worst relative difference %.2g (of those >= 1e-3), worst absolute %.2g')
            :format(label, n, compared, worst_rel, worst_abs))
    end
end

T:test('GRPO at dp=4, tp=2 x ep=2 and ep=2 x etp=2 equals one rank', function()
    local dir = dpc.tmpdir()
    local want = one_rank('grpo', dir .. '/one')
    assert(want[1].reward_std > 0 and math.abs(want[1].loss) > 1e-6, 'the rewards tell the samples apart')
    for _, layout in ipairs({{}, {tp = 2, ep = 2}, {ep = 2, etp = 2}}) do
        local name = next(layout) and ('tp=%d ep=%d etp=%d'):format(layout.tp or 1, layout.ep or 1, layout.etp or 1)
            or 'dp=4'
        local sub = dir .. '/' .. name:gsub('[ =]', '_')
        recipes.run('grpo', small(sub, {parallel = layout}))
        same_steps('GRPO ' .. name, steps_of(sub), want, 2)
    end
    d.barrier()
    if d.rank() == 0 then os.execute(('rm -rf %q'):format(dir)) end
end)

T:test('DAPO with dynamic sampling at ep=4: uneven kept groups, one rank\'s counts and loss', function()
    local dir = dpc.tmpdir()
    -- the groups of prompts of an odd problem index are all wrong (dropped); the others mixed
    local function mixed(text, _, info)
        if info.prompt % 2 == 1 then return -1 end
        return reward(text) > 0 and 1 or -1
    end
    local extra = {rl = {reward = mixed, prompts = 4, mini_batches = 2, dynamic_sampling = true, max_gen_batches = 3,
        loss_reduction = 'token-mean', eps_low = 0.2, eps_high = 0.28, kl_coef = 0, overlong_buffer = 4,
        overlong_penalty = 1}}
    local want = one_rank('dapo', dir .. '/one', extra)
    assert(want[1].groups_dropped > 0, 'groups were dropped')
    recipes.run('dapo', small(dir .. '/ep4', merge(extra, {parallel = {ep = 4}})))
    local got = steps_of(dir .. '/ep4')
    same_steps('DAPO ep=4', got, want, 2, {'loss', 'grad_norm', 'groups_kept', 'groups_dropped', 'groups_short',
        'gen_rounds', 'reward_mean', 'tokens', 'pg_clipfrac'})
    d.barrier()
    if d.rank() == 0 then os.execute(('rm -rf %q'):format(dir)) end
end)

T:test('GRPO at tp=2 x ep=2 stopped and resumed: the later steps bit for bit (at ep=4 within 1e-5); the final model '
    .. 'in one rank\'s names',
    function()
    local dir = dpc.tmpdir()
    local settings = {train = {steps = 4}, checkpoint = {every = 2}, parallel = {tp = 2, ep = 2}}
    recipes.run('grpo', small(dir .. '/whole', settings))
    recipes.run('grpo', small(dir .. '/cut', merge(merge({}, settings), {stop_after = 3})))
    if d.rank() == 0 then os.execute(('cp -r %q %q'):format(dir .. '/cut', dir .. '/other')) end
    d.barrier()
    local again = recipes.run('grpo', small(dir .. '/cut', settings))
    T.equal(again.start_step, 2, 'resumed from the checkpoint of step 2')
    local a, b = steps_of(dir .. '/whole'), steps_of(dir .. '/cut')
    for s = 3, 4 do
        for _, k in ipairs(KEYS) do
            assert(a[s][k] == b[s][k], ('step %d: %s %.17g uninterrupted, %.17g resumed'):format(s, k, a[s][k], b[s][k]))
        end
    end
    -- the same checkpoint resumed at ep=4 (the optimizer state resharded): steps 3 and 4 as the
    -- uninterrupted run's
    local other = recipes.run('grpo', small(dir .. '/other', {train = {steps = 4}, checkpoint = {every = 2},
        parallel = {ep = 4}}))
    T.equal(other.start_step, 2, 'resumed at ep=4 from the checkpoint of step 2')
    local o = steps_of(dir .. '/other')
    same_steps('GRPO tp=2 x ep=2 resumed at ep=4', {o[3], o[4]}, {a[3], a[4]}, 2)
    if d.rank() == 0 then
        local whole = lunar.model.load(dir .. '/whole/final')
        T.equal(whole.params:get('lm_head.weight'):size(1), whole.cfg.vocab_size, 'the LM head whole')
        T.equal(whole.params:get('model.layers.1.mlp.experts.7.down_proj.weight'):size(2),
            whole.cfg.moe_intermediate_size, 'every expert whole')
    end
    d.barrier()
    if d.rank() == 0 then os.execute(('rm -rf %q'):format(dir)) end
end)

T:test('LoRA GRPO at tp=2 x ep=2 trains and writes its adapters', function()
    local dir = dpc.tmpdir()
    local peft = {r = 4, alpha = 8, dropout = 0, targets = {'q_a_proj', 'o_proj', 'gate_proj', 'down_proj'}}
    local want = one_rank('grpo', dir .. '/one', {peft = peft, train = {steps = 1}})
    recipes.run('grpo', small(dir .. '/tp', {peft = peft, train = {steps = 1}, parallel = {tp = 2, ep = 2}}))
    same_steps('LoRA GRPO tp=2 x ep=2', steps_of(dir .. '/tp'), want, 1)
    if d.rank() == 0 then
        assert(io.open(dir .. '/tp/final/adapter_model.safetensors', 'rb'), 'the adapters are written')
    end
    d.barrier()
    if d.rank() == 0 then os.execute(('rm -rf %q'):format(dir)) end
end)

os.exit(T:run())
