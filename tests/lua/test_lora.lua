-- test_lora.lua: LoRA adapters (lunar.nn.lora, lunar.peft).
--
--   * Linear + adapter: forward against x W^T + b + s x A^T B^T; finite-difference gradients of
--     x, A and B (dropout 0 and 0.25 with the mask draw held fixed; f32, eps 1e-2, rtol 2e-2,
--     atol 2e-3); the dropout mask is the documented Philox draw; eval mode drops nothing.
--   * MoE with adapters on every expert's gate/up/down and the shared experts: forward equal to
--     the MoE with merged weights (rtol 1e-5), gradients of x and every adapter tensor by finite
--     differences under routing replay (router path included), with and without dropout.
--   * The tiny GLM-5 fixture (glm5_mtp): MLA projections, dense MLP and experts adapted;
--     finite-difference gradients of the loss for adapters on each kind of module; no gradient
--     for any base tensor; a few AdamW steps lower the loss and leave every base tensor
--     bit-identical.
--   * PEFT files: the golden adapter (tests/fixtures/lora_adapter, from
--     shared/data/golden/make_golden.py) written byte for byte and read back; save -> load round
--     trip reproduces tensors and logits exactly; target_modules as leaves or full names.
--   * Merging: merged forward (in place, and exported with save_merged and reloaded) equals the
--     adapted forward within 1e-5 relative; save_merged leaves the model as it was.
--   * Error messages for bad targets, files and states.
local lunar = require 'lunar'
local nn = require 'lunar.nn'
local ops = lunar.ops
local io_ = require 'lunar.io'
local lora = require 'lunar.nn.lora'
local peft = require 'lunar.peft'
local optim = require 'lunar.optim'
local T = require('lunar.testing').suite('lora')

lunar.manual_seed(21)

local here = debug.getinfo(1, 'S').source:match('^@(.*)/[^/]*$') or '.'
local FIX = here .. '/../fixtures/'

local function projection_loss(y, r) return ops.sum(ops.mul(y, r)):item() end

local function read_bytes(path)
    local f = assert(io.open(path, 'rb'))
    local s = f:read('*a')
    f:close()
    return s
end

local function tmpdir()
    local d = os.tmpname()
    os.remove(d)
    os.execute(('mkdir -p %q'):format(d))
    return d
end

-- random B for every adapter of a set (B starts at zero, which hides A's gradient)
local function randomize_B(set, scale)
    for _, name in ipairs(set.order) do
        local B = set.params:get(set.modules[name].b_name)
        B:copy_(ops.mul(lunar.randn(B:size()), scale or 0.2))
    end
end

local function snapshot(store)
    local s = {}
    for name in store:names() do s[name] = store:get(name):clone() end
    return s
end

local function rel_max(a, b)
    return ops.max(ops.abs(ops.sub(a:float(), b:float()))):item() / ops.max(ops.abs(b:float())):item()
end

---------------------------------------------------------------------------------------------
-- Linear

local function linear_case(p, bias)
    local s = nn.params.new()
    s:add('fc.weight', lunar.randn(5, 7))
    if bias then s:add('fc.bias', lunar.randn(5)) end
    local set = peft.apply(s, {targets = {'fc'}, r = 3, alpha = 6, dropout = p, seed = 4})
    randomize_B(set, 0.5)
    return s, set, nn.Linear.new(s, 'fc', {bias = bias})
end

T:test('Linear + adapter: forward is x W^T + b + (alpha/r) x A^T B^T; base frozen', function()
    local s, set, fc = linear_case(0, true)
    local x = lunar.randn(4, 7)
    local y = fc:forward(x)
    local A, B = set.params:get('fc.lora_A.weight'), set.params:get('fc.lora_B.weight')
    local want = ops.add(ops.add(ops.matmul(x, s:get('fc.weight'):t()), s:get('fc.bias')),
        ops.mul(ops.matmul(ops.matmul(x, A:t()), B:t()), 2))
    T.close(y, want, {rtol = 1e-5, atol = 1e-6})
    assert(not s:is_trainable('fc.weight') and not s:is_trainable('fc.bias'), 'base frozen')
    -- PEFT's init: A ~ U(-1/sqrt(in), 1/sqrt(in)), B = 0
    local s2 = nn.params.new()
    s2:add('big.weight', lunar.randn(3, 400))
    local set2 = peft.apply(s2, {targets = {'big'}, r = 16})
    local a = set2.params:get('big.lora_A.weight')
    local bound = 1 / math.sqrt(400)
    assert(ops.max(ops.abs(a)):item() <= bound, 'A within the kaiming bound')
    T.close(ops.mean(ops.abs(a)):item(), bound / 2, {rtol = 0.05, msg = 'A uniform'})
    T.equal(set2.params:get('big.lora_B.weight'), lunar.zeros(3, 16), 'B zero')
    T.equal(nn.Linear.new(s2, 'big'):forward(x:narrow(2, 1, 1):expand(4, 400):contiguous()),
        ops.matmul(x:narrow(2, 1, 1):expand(4, 400):contiguous(), s2:get('big.weight'):t()), 'B = 0: no change')
end)

T:test('Linear + adapter: gradients of x, A, B (dropout 0 and 0.25, mask draw fixed)', function()
    for _, p in ipairs({0, 0.25}) do
        for _, bias in ipairs({false, true}) do
            local s, set, fc = linear_case(p, bias)
            local x = lunar.randn(6, 7)
            local r = lunar.randn(6, 5)
            set.params:zero_grad()
            local d0 = set.draws
            local _, saved = fc:forward(x)
            local dx = fc:backward(r, saved)
            assert(next(s.grads) == nil, 'no gradient tensor for the frozen base')
            local A, B = set.params:get('fc.lora_A.weight'), set.params:get('fc.lora_B.weight')
            local gA, gB = set.params:grad('fc.lora_A.weight'):clone(), set.params:grad('fc.lora_B.weight'):clone()
            T.gradcheck{name = ('linear p=%g bias=%s'):format(p, tostring(bias)), eps = 1e-2, rtol = 2e-2, atol = 2e-3,
                f = function() set.draws = d0; return projection_loss((fc:forward(x)), r) end,
                inputs = {x, A, B}, grads = {dx, gA, gB}}
            -- need_dx = false: the same parameter gradients, no dx
            set.params:zero_grad()
            set.draws = d0
            local _, saved2 = fc:forward(x)
            assert(fc:backward(r, saved2, false) == nil)
            T.equal(set.params:grad('fc.lora_A.weight'), gA, 'need_dx=false dA')
            T.equal(set.params:grad('fc.lora_B.weight'), gB, 'need_dx=false dB')
        end
    end
end)

T:test('dropout: the Philox mask of each draw, inverted scaling, off in eval mode', function()
    local s = nn.params.new()
    s:add('fc.weight', lunar.zeros(3, 200))
    local set = peft.apply(s, {targets = {'fc'}, r = 2, alpha = 2, dropout = 0.3, seed = 9})
    randomize_B(set, 1)
    local fc = nn.Linear.new(s, 'fc')
    local x = lunar.randn(50, 200)
    local y1 = fc:forward(x)
    local y2 = fc:forward(x)
    T.equal(set.draws, 2, 'one draw per forward')
    assert(rel_max(y1, y2) > 1e-3, 'different masks per call')
    -- draw 1 by hand: u = uniform from rng(seed):split('lora_dropout'):split(1); keep u >= p
    local u = lunar.empty(50, 200)
    lunar.rng(9):split('lora_dropout'):split(1):uniform_(u)
    local mask = ops.mul(ops.ge(u, 0.3, {dtype = 'f32'}), 1 / 0.7)
    local kept = ops.mean(ops.ne(mask, 0):float()):item()
    T.close(kept, 0.7, {atol = 0.02, msg = 'kept fraction'})
    local A, B = set.params:get('fc.lora_A.weight'), set.params:get('fc.lora_B.weight')
    T.close(y1, ops.matmul(ops.matmul(ops.mul(x, mask), A:t()), B:t()), {rtol = 1e-5, atol = 1e-6, msg = 'draw 1'})
    set:eval()
    T.close(fc:forward(x), ops.matmul(ops.matmul(x, A:t()), B:t()), {rtol = 1e-5, atol = 1e-6, msg = 'eval'})
    T.equal(set.draws, 2, 'no draw in eval mode')
    -- the dropout stream is resumable from (seed, draws)
    set:train()
    local st = set:rng_state()
    local y3 = fc:forward(x)
    set:set_rng_state(st)
    T.equal(fc:forward(x), y3, 'resumed dropout stream')
end)

---------------------------------------------------------------------------------------------
-- MoE experts

local MCFG = {n_routed_experts = 6, num_experts_per_tok = 2, n_group = 1, topk_group = 1, norm_topk_prob = true,
              routed_scaling_factor = 2.5, n_shared_experts = 1, hidden_act = 'silu'}

local function moe_store(H, Im)
    local s = nn.params.new()
    local name = 'model.layers.1.mlp'
    s:add(name .. '.gate.weight', ops.mul(lunar.randn(6, H), 0.5))
    s:add(name .. '.gate.e_score_correction_bias', ops.mul(lunar.randn(6), 0.05), false)
    for e = 0, 5 do
        local p = name .. '.experts.' .. e
        s:add(p .. '.gate_proj.weight', ops.mul(lunar.randn(Im, H), 0.3))
        s:add(p .. '.up_proj.weight', ops.mul(lunar.randn(Im, H), 0.3))
        s:add(p .. '.down_proj.weight', ops.mul(lunar.randn(H, Im), 0.3))
    end
    local p = name .. '.shared_experts'
    s:add(p .. '.gate_proj.weight', ops.mul(lunar.randn(Im, H), 0.3))
    s:add(p .. '.up_proj.weight', ops.mul(lunar.randn(Im, H), 0.3))
    s:add(p .. '.down_proj.weight', ops.mul(lunar.randn(H, Im), 0.3))
    return s, name
end

T:test('MoE + adapters on every expert and the shared experts: forward equals merged weights', function()
    local s, name = moe_store(8, 5)
    local m = nn.MoE.new(s, name, MCFG)
    local set = peft.apply(s, {targets = {'gate_proj', 'up_proj', 'down_proj'}, r = 2, alpha = 3})
    T.equal(#set.order, 6 * 3 + 3, 'adapted modules')
    randomize_B(set, 0.5)
    local x = lunar.randn(9, 8)
    local y, _, routing = m:forward(x)
    -- the same layer with W + s B A and no adapters
    local s2 = nn.params.new()
    for n in s:names() do s2:add(n, s:get(n):clone(), s:is_trainable(n)) end
    for _, mod in ipairs(set.order) do
        s2:get(mod .. '.weight'):copy_(ops.add(s:get(mod .. '.weight'), lora.delta(set.modules[mod])))
    end
    local y2, _, routing2 = nn.MoE.new(s2, name, MCFG):forward(x)
    T.equal(routing.idx, routing2.idx, 'same routing')
    T.close(y, y2, {rtol = 1e-5, atol = 1e-6})
end)

T:test('MoE + adapters: gradients of x and every adapter tensor (replayed routing; dropout 0 and 0.2)', function()
    for _, p in ipairs({0, 0.2}) do
        local s, name = moe_store(6, 4)
        local m = nn.MoE.new(s, name, MCFG)
        local set = peft.apply(s, {targets = {'gate_proj', 'up_proj', 'down_proj'}, r = 2, alpha = 4, dropout = p, seed = 3})
        randomize_B(set, 0.5)
        local x = lunar.randn(7, 6)
        local d0 = set.draws
        local y0, _, routing = m:forward(x)
        local replay = routing.idx
        local r = lunar.randn(y0:size())
        set.params:zero_grad()
        set.draws = d0
        local _, saved = m:forward(x, {replay_idx = replay})
        local dx = m:backward(r, saved)
        assert(s.grads[name .. '.gate.weight'] == nil and s.grads[name .. '.experts.0.down_proj.weight'] == nil,
            'no base gradients')
        local inputs, grads = {x}, {dx}
        for pname in set.params:names() do
            inputs[#inputs + 1] = set.params:get(pname)
            grads[#grads + 1] = set.params:grad(pname):clone()
        end
        T.equal(#inputs, 1 + 2 * (6 * 3 + 3), 'every adapter (also of experts without tokens) has a gradient')
        T.gradcheck{name = 'moe lora p=' .. p, eps = 1e-2, rtol = 2e-2, atol = 2e-3, max_checks = 12,
            f = function() set.draws = d0; return projection_loss((m:forward(x, {replay_idx = replay})), r) end,
            inputs = inputs, grads = grads}
    end
end)

---------------------------------------------------------------------------------------------
-- the tiny GLM-5 model

local function load_model(case)
    local dir = FIX .. 'models/' .. case
    local model = lunar.model.load(dir)
    local ref = io_.load_checkpoint(dir .. '/reference.safetensors')
    local batch = {input_ids = ref.input_ids, labels = ref.labels, position_ids = ref.position_ids,
                   attention_mask = ref.attention_mask, cu_seqlens = ref.cu_seqlens}
    return model, batch, dir
end

local TARGETS = {'q_a_proj', 'q_b_proj', 'kv_a_proj_with_mqa', 'kv_b_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj'}

T:test('GLM-5 model: adapters on MLA, dense MLP, experts; finite-difference gradients of the loss', function()
    local model, batch = load_model('glm5_mtp')
    local set = peft.apply(model, {targets = TARGETS, r = 2, alpha = 4})
    -- layer 0 dense, layer 1 sparse (8 experts + shared); the MTP layer 2 is left out by default
    T.equal(#set.order, 2 * 5 + 3 + 8 * 3 + 3, 'adapted modules')
    assert(set:get('model.layers.2.self_attn.q_a_proj') == nil, 'MTP layer not adapted')
    randomize_B(set, 0.1)
    set.params:zero_grad()
    model:forward(batch, {loss = true})
    model:backward()
    assert(next(model.params.grads) == nil, 'no gradient for any base tensor')
    local check = {'model.layers.0.self_attn.q_a_proj', 'model.layers.0.self_attn.kv_a_proj_with_mqa',
        'model.layers.1.self_attn.kv_b_proj', 'model.layers.1.self_attn.o_proj', 'model.layers.0.mlp.gate_proj',
        'model.layers.1.mlp.shared_experts.up_proj'}
    -- an expert that got tokens
    local routing = model:forward(batch, {keep = false}).routing
    local e = routing[1].idx:get(1, 1)
    check[#check + 1] = 'model.layers.1.mlp.experts.' .. e .. '.down_proj'
    check[#check + 1] = 'model.layers.1.mlp.experts.' .. e .. '.gate_proj'
    local inputs, grads = {}, {}
    for _, mod in ipairs(check) do
        local ad = set:get(mod)
        for _, pn in ipairs({ad.a_name, ad.b_name}) do
            inputs[#inputs + 1] = set.params:get(pn)
            grads[#grads + 1] = set.params:grad(pn):clone()
        end
    end
    T.gradcheck{name = 'glm5 lora', eps = 1e-2, rtol = 3e-2, atol = 3e-4, max_checks = 4,
        f = function() return model:forward(batch, {loss = true, keep = false}).loss end,
        inputs = inputs, grads = grads}
end)

T:test('GLM-5 model: AdamW on the adapters lowers the loss; base tensors bit-identical', function()
    local model, batch = load_model('glm5_dsa')
    local base = snapshot(model.params)
    local set = peft.apply(model, {targets = TARGETS, r = 4, alpha = 8, dropout = 0.1, seed = 2})
    local opt = optim.AdamW.new(set.params, {lr = 2e-2, weight_decay = 0.01, clip = 1.0})
    local losses = {}
    for k = 1, 4 do
        opt:zero_grad()
        losses[k] = model:forward(batch, {loss = true}).loss
        model:backward()
        local info = opt:step{loss = losses[k]}
        assert(not info.skipped)
    end
    assert(losses[4] < losses[1] - 0.05, ('loss did not fall: %g -> %g'):format(losses[1], losses[4]))
    for name, t in pairs(base) do T.equal(model.params:get(name), t, 'base tensor ' .. name) end
    for name in pairs(opt.state) do assert(name:find('%.lora_[AB]%.weight$'), 'optimizer state for ' .. name) end
    assert(next(model.params.grads) == nil, 'no base gradients')
end)

---------------------------------------------------------------------------------------------
-- PEFT files

T:test('the golden PEFT adapter is written byte for byte and read back', function()
    local s = nn.params.new()
    s:add('model.layers.0.self_attn.q_a_proj.weight', lunar.randn(4, 4))
    local set = peft.apply(s, {targets = {'q_a_proj'}, r = 2, alpha = 4})
    set.params:get('model.layers.0.self_attn.q_a_proj.lora_A.weight'):copy_(
        lunar.tensor({0.1, 0.2, 0.3, 0.4, -0.1, -0.2, -0.3, -0.4}):view(2, 4))
    local dir = tmpdir()
    peft.save(s, dir, {base_model_name_or_path = 'zai-org/GLM-5'})
    for _, f in ipairs({'adapter_config.json', 'adapter_model.safetensors'}) do
        T.equal(read_bytes(dir .. '/' .. f) == read_bytes(FIX .. 'lora_adapter/' .. f) and 1 or 0, 1, f .. ' bytes')
    end
    os.execute(('rm -rf %q'):format(dir))
    -- read the golden back onto a fresh store
    local s2 = nn.params.new()
    s2:add('model.layers.0.self_attn.q_a_proj.weight', lunar.randn(4, 4))
    local set2 = peft.load(s2, FIX .. 'lora_adapter')
    local ad = set2:get('model.layers.0.self_attn.q_a_proj')
    T.equal(ad.r, 2, 'r'); T.equal(ad.scale, 2, 'scale')
    T.equal(set2.params:get(ad.a_name), set.params:get(ad.a_name), 'A')
    T.equal(set2.params:get(ad.b_name), lunar.zeros(4, 2), 'B')
end)

T:test('save -> load round trip: tensors and logits identical; target_modules', function()
    local model, batch = load_model('glm5_dsa')
    local set = peft.apply(model, {targets = TARGETS, r = 3, alpha = 5, dropout = 0.05})
    randomize_B(set, 0.1)
    set:eval()
    local logits = model:forward(batch, {keep = false}).logits
    local dir = tmpdir()
    peft.save(model, dir)
    -- experts adapted: lora_dropout 0 by default (PEFT's fused-expert wrapper refuses others)
    T.equal(io_.read_json(dir .. '/adapter_config.json').lora_dropout, 0, 'default lora_dropout with experts')
    peft.save(model, dir, {lora_dropout = 0.05})
    local cfg = io_.read_json(dir .. '/adapter_config.json')
    T.equal(cfg.r, 3, 'r'); T.equal(cfg.lora_alpha, 5, 'alpha'); T.close(cfg.lora_dropout, 0.05, {rtol = 0})
    assert(cfg.peft_type == 'LORA' and cfg.task_type == 'CAUSAL_LM' and cfg.base_model_name_or_path:find('glm5_dsa'))
    -- routed experts and complete leaves bare in target_modules; the dense MLP (layer 0) and the
    -- shared experts as target_parameters (PEFT would take them for routed experts), also bare
    local tm = table.concat(cfg.target_modules, ',')
    assert(tm == 'down_proj,gate_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj,q_a_proj,q_b_proj,up_proj', tm)
    local tp = table.concat(cfg.target_parameters, ',')
    assert(tp == 'mlp.down_proj.weight,mlp.gate_proj.weight,mlp.shared_experts.down_proj.weight,'
        .. 'mlp.shared_experts.gate_proj.weight,mlp.shared_experts.up_proj.weight,mlp.up_proj.weight', tp)
    local f = io_.safetensors_open(dir .. '/adapter_model.safetensors')
    local keys = f:keys()
    T.equal(#keys, 2 * #set.order, 'tensors in the file')
    assert(f:info('base_model.model.model.layers.1.mlp.experts.7.down_proj.lora_A.weight'), 'per-expert names')
    f:close()
    local model2 = load_model('glm5_dsa')
    local set2 = peft.load(model2, dir)
    set2:eval()
    for pname in set.params:names() do T.equal(set2.params:get(pname), set.params:get(pname), pname) end
    T.equal(model2:forward(batch, {keep = false}).logits, logits, 'logits after reload')
    T.equal(set2:get('model.layers.0.self_attn.o_proj').dropout, 0.05, 'dropout read back')
    os.execute(('rm -rf %q'):format(dir))
    -- a partial choice is written as full module names
    local m3 = load_model('glm5_dsa')
    peft.apply(m3, {targets = {'^model%.layers%.1%.mlp%.experts%.[01]%.', 'o_proj'}, exclude = {'up_proj'}})
    local dir3 = tmpdir()
    peft.save(m3, dir3)
    local c3 = io_.read_json(dir3 .. '/adapter_config.json')
    T.equal(c3.lora_dropout, 0, 'experts: dropout 0')
    -- experts 0 and 1 of layer 1: the fused experts need gate, up and down of every expert (the
    -- others are zero in the file); o_proj of every layer: bare
    local got = table.concat(c3.target_modules, ',')
    assert(got == 'down_proj,gate_proj,o_proj,up_proj', got)
    assert(c3.target_parameters == nil, 'no target_parameters')
    local m4 = load_model('glm5_dsa')
    peft.apply(m4, {targets = {'^model%.layers%.[01]%.self_attn%.o_proj$'}, dropout = 0.1})
    peft.save(m4, dir3)
    c3 = io_.read_json(dir3 .. '/adapter_config.json')
    T.close(c3.lora_dropout, 0.1, {rtol = 0, msg = 'no experts: the training dropout'})
    got = table.concat(c3.target_modules, ',')
    assert(got == 'model.layers.0.self_attn.o_proj,model.layers.1.self_attn.o_proj', got)
    os.execute(('rm -rf %q'):format(dir3))
end)

---------------------------------------------------------------------------------------------
-- merging

T:test('merge: the merged forward equals the adapted one; save_merged exports it and keeps the model', function()
    local model, batch, dir = load_model('glm5_dsa')
    local set = peft.apply(model, {targets = TARGETS, r = 4, alpha = 8})
    randomize_B(set, 0.05)
    local base = snapshot(model.params)
    local adapted = model:forward(batch, {keep = false}).logits
    local out = tmpdir()
    peft.save_merged(model, out)
    for name, t in pairs(base) do T.equal(model.params:get(name), t, 'save_merged changed ' .. name) end
    T.equal(model:forward(batch, {keep = false}).logits, adapted, 'adapters still attached')
    local reloaded = lunar.model.load(out)
    local e1 = rel_max(reloaded:forward(batch, {keep = false}).logits, adapted)
    assert(e1 < 1e-5, 'exported merged model: ' .. e1)
    -- only adapted weights differ from the base checkpoint
    local a, b = io_.load_checkpoint(dir .. '/model.safetensors'), io_.load_checkpoint(out)
    local changed = 0
    for name, t in pairs(a) do
        if not t:equal(b[name]) then
            changed = changed + 1
            assert(set:get(name:match('^(.*)%.weight$') or ''), 'unexpected change in ' .. name)
        end
    end
    T.equal(changed, #set.order, 'changed tensors')
    os.execute(('rm -rf %q'):format(out))
    peft.merge(model)
    assert(model.params.lora == nil and model.params:is_trainable('model.layers.0.self_attn.q_a_proj.weight'),
        'detached, trainable again')
    local e2 = rel_max(model:forward(batch, {keep = false}).logits, adapted)
    assert(e2 < 1e-5, 'merged in place: ' .. e2)
end)

T:test('bf16 model: adapters in f32, base bf16 weights unchanged by training', function()
    local _, batch = load_model('glm5_gelu_tied')
    local m16 = lunar.model.load(FIX .. 'models/glm5_gelu_tied', {dtype = 'bf16'})
    local base = snapshot(m16.params)
    local set = peft.apply(m16, {targets = {'q_b_proj', 'o_proj', 'down_proj'}, r = 2, alpha = 2})
    local opt = optim.AdamW.new(set.params, {lr = 1e-2})
    for _ = 1, 2 do
        opt:zero_grad()
        local out = m16:forward(batch, {loss = true})
        m16:backward()
        assert(not opt:step{loss = out.loss}.skipped)
    end
    for name, t in pairs(base) do T.equal(m16.params:get(name), t, name) end
    assert(set.params:get('model.layers.0.self_attn.o_proj.lora_B.weight'):dtype() == 'f32')
    assert(ops.norm(set.params:get('model.layers.0.self_attn.o_proj.lora_B.weight')):item() > 0, 'B moved')
end)

T:test('errors name the problem', function()
    local model = load_model('glm5_dsa')
    T.raises(function() peft.apply(model, {targets = {'mlp.gate'}}) end, 'which is the MoE router')
    T.raises(function() peft.apply(model, {targets = {'wq_b'}}) end, 'part of the DSA indexer')
    T.raises(function() peft.apply(model, {targets = {'qkv_proj'}}) end, 'target "qkv_proj" matches no linear module')
    T.raises(function() peft.apply(model, {targets = {'o_proj'}, r = 0}) end, 'r must be a positive integer')
    T.raises(function() peft.save(model, '/tmp/x') end, 'the model has no adapters')
    peft.apply(model, {targets = {'o_proj'}})
    T.raises(function() peft.apply(model, {targets = {'o_proj'}}) end, 'already has adapters')
    -- a file whose shapes do not fit
    local dir = tmpdir()
    peft.save(model, dir)
    local m2 = load_model('glm5_dsa')
    local cfg = io_.read_json(dir .. '/adapter_config.json')
    cfg.r = 4
    io_.write_json(dir .. '/adapter_config.json', cfg)
    T.raises(function() peft.load(m2, dir) end, 'expected (4, 24) and (32, 4) for r = 4')
    cfg.r = 8; cfg.use_dora = true
    io_.write_json(dir .. '/adapter_config.json', cfg)
    T.raises(function() peft.load(m2, dir) end, 'DoRA adapters (use_dora) are not supported')
    os.execute(('rm -rf %q'):format(dir))
end)

os.exit(T:run())
