-- test_model_variants.lua: small GLM-5 / GLM-4.x checkpoints against transformers 5.25.0
-- (tests/fixtures/models/<arch>_<case>, made by tests/ref/make_variant_refs.py), f32 on CPU:
--   - hidden_act gelu_pytorch_tanh, gelu_new and relu in the dense MLP, the routed and the shared
--     experts: logits within 1e-5 of max |logit| (the fixtures are made so that another
--     activation formula moves them by more than 1e-4), loss within 1e-6, every gradient
--     within 1e-4 relative L2;
--   - a checkpoint as transformers' save_pretrained writes it for a config that declares
--     num_nextn_predict_layers but holds no MTP tensor: loads with the MTP layer off and one
--     warning naming the checkpoint, matches transformers, exports what it read; strict = true
--     refuses it; a checkpoint with part of the MTP layer is refused in every mode.
local lunar = require 'lunar'
local io_ = require 'lunar.io'
local ops = lunar.ops
local T = require('lunar.testing').suite('model.variants')

local ROOT = 'tests/fixtures/models/'

-- runs fn with io.stderr replaced; returns the lines written to it and fn's results
local function capture_stderr(fn)
    local lines, real = {}, io.stderr
    io.stderr = {write = function(self, ...)
        for _, s in ipairs({...}) do lines[#lines + 1] = s end
        return self
    end}
    local res = {pcall(fn)}
    io.stderr = real
    if not res[1] then error(res[2], 0) end
    return lines, unpack(res, 2)
end

local function rel_l2(a, b)
    local d = ops.norm(ops.sub(a:float(), b:float())):item()
    local n = ops.norm(b:float()):item()
    return n > 0 and d / n or d
end

local function batch_of(ref)
    return {input_ids = ref.input_ids, labels = ref.labels, position_ids = ref.position_ids}
end

-- logits, loss, every gradient and the router's choices against the fixture
local function check_against_hf(case, model, ref)
    local out = model:forward(batch_of(ref), {loss = true})
    local le = ops.max(ops.abs(ops.sub(out.logits:float(), ref.logits))):item() / ops.max(ops.abs(ref.logits)):item()
    assert(le < 1e-5, ('%s: logits error %.3g'):format(case, le))
    local loss_err = math.abs(out.loss - ref.loss:item()) / math.abs(ref.loss:item())
    assert(loss_err < 1e-6, ('%s: loss %.9g vs %.9g'):format(case, out.loss, ref.loss:item()))
    model:backward()
    local n, worst, wname = 0, 0, '-'
    local grads = model:gradients()
    for name, g in pairs(grads) do
        local r = ref['grad.' .. name]
        if r then
            n = n + 1
            local e = rel_l2(g, r)
            if e > worst then worst, wname = e, name end
        else   -- the indexer: transformers gives it no gradient
            assert(ops.max(ops.abs(g)):item() == 0,
                case .. ': ' .. name .. ' has a gradient transformers does not give')
        end
    end
    for name in pairs(ref) do
        local p = name:match('^grad%.(.*)$')
        if p then assert(grads[p], case .. ': no gradient for ' .. p) end
    end
    assert(worst < 1e-4, ('%s: gradient %s relative L2 error %.3g'):format(case, wname, worst))
    for name, t in pairs(ref) do
        local layer = name:match('^routing%.(%d+)$')
        if layer then
            T.equal(ops.sort(out.routing[tonumber(layer)].idx:float()), t:float(), case .. ' routing layer ' .. layer)
        end
    end
    print(('      %s: logits %.2g, loss %.2g, %d gradients, worst rel L2 %.2g'):format(case, le, loss_err, n, worst))
end

local function load_ref(case) return io_.load_checkpoint(ROOT .. case .. '/reference.safetensors') end

for _, arch in ipairs({'glm5', 'glm4moe'}) do
    for _, act in ipairs({'gelu_pytorch_tanh', 'gelu_new', 'relu'}) do
        local case = arch .. '_' .. act
        T:test(case .. ': logits, loss and every gradient match transformers', function()
            local model = lunar.model.load(ROOT .. case)
            assert(model.cfg.hidden_act == act, case .. ': the fixture runs ' .. tostring(model.cfg.hidden_act))
            check_against_hf(case, model, load_ref(case))
        end)
    end
end

local function tmpdir()
    local d = os.tmpname()
    os.remove(d)
    os.execute(('mkdir -p %q'):format(d))
    return d
end

local function copy_file(from, to)
    local f = assert(io.open(from, 'rb'))
    local data = f:read('*a')
    f:close()
    f = assert(io.open(to, 'wb'))
    f:write(data)
    f:close()
end

-- a checkpoint directory with dir's config.json and the given tensors
local function write_ckpt(dir, tensors)
    local out = tmpdir()
    copy_file(dir .. '/config.json', out .. '/config.json')
    io_.save_checkpoint(out, tensors)
    return out
end

local function count(t)
    local n = 0
    for _ in pairs(t) do n = n + 1 end
    return n
end

for _, arch in ipairs({'glm5', 'glm4moe'}) do
    local case = arch .. '_nomtp'
    local dir = ROOT .. case

    T:test(case .. ': a save_pretrained checkpoint without MTP tensors loads with the MTP layer off', function()
        local lines, model = capture_stderr(function() return lunar.model.load(dir) end)
        assert(#lines == 1, ('%s: %d warning lines, expected one'):format(case, #lines))
        local w = lines[1]
        assert(w:find(dir, 1, true), 'the warning names the checkpoint: ' .. w)
        assert(w:find('no MTP layer', 1, true) and w:find('model.layers.2.*', 1, true),
            'the warning says what is missing: ' .. w)
        assert(model.cfg.num_nextn_predict_layers == 1, 'the config is kept as read')
        assert(#model.mtp == 0 and model.source.mtp_missing == true, 'the MTP layer is off')
        for name in pairs(model:parameters()) do
            assert(not name:find('^model%.layers%.2%.'), case .. ': a parameter of the missing layer: ' .. name)
        end
        check_against_hf(case, model, load_ref(case))
        -- quiet: no warning
        lines = capture_stderr(function() return lunar.model.load(dir, {quiet = true}) end)
        assert(#lines == 0, 'quiet = true prints nothing')
    end)

    T:test(case .. ': strict = true refuses it, naming the setting and the missing layer', function()
        local ok, err = pcall(lunar.model.load, dir, {strict = true, quiet = true})
        assert(not ok, 'strict = true must refuse a checkpoint without its MTP layer')
        err = tostring(err)
        assert(err:find(dir, 1, true) and err:find('num_nextn_predict_layers = 1', 1, true)
            and err:find('no MTP layer', 1, true) and err:find('strict = true', 1, true), err)
    end)

    T:test(case .. ': export writes the tensors it read (no MTP layer) and the same config', function()
        local model = lunar.model.load(dir, {quiet = true})
        local out = tmpdir()
        model:save_hf(out)
        local a = io_.load_checkpoint(dir .. '/model.safetensors')
        local b = io_.load_checkpoint(out)
        assert(count(a) == count(b), ('%d tensors in, %d out'):format(count(a), count(b)))
        for name, t in pairs(a) do T.equal(b[name], t, case .. ' export ' .. name) end
        assert(lunar.model.config.load(out .. '/config.json').num_nextn_predict_layers == 1)
        local lines, again = capture_stderr(function() return lunar.model.load(out) end)
        assert(#lines == 1 and #again.mtp == 0, 'the export loads as its source did')
        os.execute(('rm -rf %q'):format(out))
    end)
end

T:test('a checkpoint with part of the MTP layer is refused, strict or not', function()
    -- glm5_mtp holds the whole layer (model.layers.2.*): drop one of its tensors
    local full = io_.load_checkpoint(ROOT .. 'glm5_mtp/model.safetensors')
    local part = {}
    for name, t in pairs(full) do if name ~= 'model.layers.2.eh_proj.weight' then part[name] = t end end
    local d1 = write_ckpt(ROOT .. 'glm5_mtp', part)
    -- glm5_nomtp plus a single MTP tensor
    local some = io_.load_checkpoint(ROOT .. 'glm5_nomtp/model.safetensors')
    local extra = {}
    for name, t in pairs(some) do extra[name] = t end
    extra['model.layers.2.enorm.weight'] = lunar.ones(16)
    local d2 = write_ckpt(ROOT .. 'glm5_nomtp', extra)
    for _, c in ipairs({{d1, '1 of its'}, {d2, 'of its'}}) do
        for _, strict in ipairs({false, true, 'default'}) do
            local opts = {quiet = true}
            if strict ~= 'default' then opts.strict = strict end
            local ok, err = pcall(lunar.model.load, c[1], opts)
            assert(not ok, c[1] .. ': a partial MTP layer must be an error (strict ' .. tostring(strict) .. ')')
            err = tostring(err)
            assert(err:find('MTP layer model.layers.2.* is incomplete', 1, true) and err:find(c[2], 1, true)
                and err:find(c[1], 1, true), err)
        end
        os.execute(('rm -rf %q'):format(c[1]))
    end
end)

T:test('a checkpoint with its MTP layer still loads it, without a warning', function()
    local lines, model = capture_stderr(function() return lunar.model.load(ROOT .. 'glm5_mtp', {strict = true}) end)
    assert(#lines == 0, 'no warning: ' .. table.concat(lines))
    assert(#model.mtp == 1 and not model.source.mtp_missing)
    assert(model:parameters()['model.layers.2.eh_proj.weight'])
end)

os.exit(T:run())
