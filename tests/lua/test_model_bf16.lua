-- test_model_bf16.lua: GLM-5 in bf16 on the CPU against transformers' f32 logits, on the fixture
-- made for it (tests/fixtures/models/glm5_bf16: 4 x 64 scored positions, vocab 256, H 64, 3 layers,
-- DSA index_topk 48 of 64, E 8 / K 2, briefly trained on a learnable token task so its top-1s have
-- clear margins; the inputs come from that task). The CPU kernels compute in f32 and round each op's output
-- to bf16, so this emulates a bf16 run on a device.
--   f32 first: logits max error / max logit < 1e-5 and loss < 1e-6 relative (so what the bf16
--        test measures is rounding, not a model difference);
--   bf16 with fp32_residual (the residual stream kept in f32): logits and every gradient much
--        closer to f32 than plain bf16 (numbers printed), and a no-op on an f32 model;
--   bf16: top-1 agreement with HF-f32 >= 99% over the 256 positions (issue 3's acceptance; NeMo
--        AutoModel reports 96.61% and 0.639% logits relative L2 for its bf16 parity). Printed next
--        to transformers' own bf16 run of the same weights (the fixture's metadata hf_bf16: its
--        top-1 agreement and logits relative L2 against HF-f32), which is the baseline, and to
--        HF-f32's own logits rounded to bf16 (what the final rounding alone costs). See the
--        fixtures README (glm5_bf16) for why the model is trained (on random weights even HF's
--        own bf16 agreed on only 95.7% of the top-1s) and for the numbers.
local lunar = require 'lunar'
local io_ = require 'lunar.io'
local ops = lunar.ops
local T = require('lunar.testing').suite('model.bf16')

local DIR = 'tests/fixtures/models/glm5_bf16'

local function load(dtype, opts)
    local ref, meta = io_.load_checkpoint(DIR .. '/reference.safetensors')
    local model = lunar.model.load(DIR, {dtype = dtype, fp32_residual = opts and opts.fp32_residual})
    local batch = {input_ids = ref.input_ids, labels = ref.labels, position_ids = ref.position_ids}
    return model, ref, batch, io_.decode_json(meta.lunar, 'glm5_bf16 metadata')
end

-- top-1 agreement (count, positions) and logits relative L2 of l against r, both (B, S, V)
local function agreement(l, r)
    local _, la = ops.max(l, 3)
    local _, ra = ops.max(r, 3)
    local a, b = la:tolist_flat(), ra:tolist_flat()
    local agree = 0
    for i = 1, #a do if a[i] == b[i] then agree = agree + 1 end end
    local rel = ops.norm(ops.sub(l, r)):item() / ops.norm(r):item()
    return agree, #a, rel
end

T:test('glm5_bf16 f32: logits and loss match transformers', function()
    local model, ref, batch = load('f32')
    local out = model:forward(batch, {loss = true, keep = false})
    local err = ops.max(ops.abs(ops.sub(out.logits, ref.logits))):item() / ops.max(ops.abs(ref.logits)):item()
    assert(err < 1e-5, ('logits error %.3g'):format(err))
    local lerr = math.abs(out.loss - ref.loss:item()) / ref.loss:item()
    assert(lerr < 1e-6, ('loss relative error %.3g'):format(lerr))
    local agree, n = agreement(out.logits, ref.logits)
    assert(agree == n, 'f32 top-1 must agree everywhere')
end)

T:test('glm5_bf16 bf16 on cpu: top-1 agreement with HF-f32 >= 99%', function()
    local model, ref, batch, meta = load('bf16')
    assert(model:parameters()['model.layers.1.self_attn.q_a_proj.weight']:dtype() == 'bf16', 'bf16 parameters')
    local out = model:forward(batch, {keep = false})
    assert(out.logits:dtype() == 'bf16', 'bf16 logits')
    local agree, n, rel = agreement(out.logits:float(), ref.logits)
    local hf = meta.hf_bf16
    local hagree, hn, hrel = agreement(ref.logits_hf_bf16, ref.logits)
    assert(hn == n and math.abs(hagree / hn - hf.top1_agreement) < 1e-12, 'metadata hf_bf16 vs logits_hf_bf16')
    assert(math.abs(hrel - hf.logits_rel_l2) < 1e-6, 'metadata hf_bf16 logits_rel_l2 vs logits_hf_bf16')
    print(('      lunar bf16 (cpu): top-1 %.2f%% (%d/%d), logits rel L2 %.3f%%'):format(100 * agree / n, agree, n, 100 * rel))
    print(('      HF bf16 baseline: top-1 %.2f%% (%d/%d), logits rel L2 %.3f%%'):format(100 * hagree / n, hagree, n, 100 * hrel))
    print(('      HF-f32 logits rounded to bf16: top-1 %.2f%%'):format(100 * hf.f32_logits_rounded_to_bf16_top1_agreement))
    assert(agree / n >= 0.99, ('top-1 agreement %.2f%% is below 99%%'):format(100 * agree / n))
end)

-- relative L2 of every gradient of m against the f32 model's: mean and worst over the parameters
local function grad_errors(m, ref_grads)
    local sum, n, worst = 0, 0, 0
    for name, g in pairs(m:gradients()) do
        local r = ref_grads[name]
        local e = ops.norm(ops.sub(g:float(), r)):item() / math.max(ops.norm(r):item(), 1e-30)
        sum, n, worst = sum + e, n + 1, math.max(worst, e)
    end
    return sum / n, worst
end

T:test('glm5_bf16 with fp32_residual: logits and gradients much closer to f32', function()
    local m32, ref, batch = load('f32')
    local f32_out = m32:forward(batch, {loss = true})
    m32:backward()
    -- on an f32 model the option changes nothing, bit for bit
    local m32r = load('f32', {fp32_residual = true})
    local same = m32r:forward(batch, {loss = true})
    T.equal(same.logits, f32_out.logits, 'f32 logits with fp32_residual')
    local g32 = m32:gradients()
    local res = {}
    for _, f in ipairs({false, true}) do
        local m = load('bf16', {fp32_residual = f})
        local out = m:forward(batch, {loss = true})
        m:backward()
        local agree, n, rel = agreement(out.logits:float(), ref.logits)
        local gmean, gworst = grad_errors(m, g32)
        res[f] = {agree = agree / n, rel = rel, gmean = gmean, gworst = gworst}
        print(('      bf16, fp32_residual=%s: top-1 %.2f%%, logits rel L2 %.3f%%, gradients rel L2 mean %.2f%% worst %.2f%%'):format(
            tostring(f), 100 * agree / n, 100 * rel, 100 * gmean, 100 * gworst))
    end
    local r = res[true]
    assert(r.agree >= 0.99, 'top-1 agreement')
    -- measured: logits 0.83% (2.61% without), gradients mean 1.5% / worst 2.4% (9.8% / 47%)
    assert(r.rel < 0.5 * res[false].rel and r.rel < 0.012, ('logits rel L2 %.3f%%'):format(100 * r.rel))
    assert(r.gmean < 0.03 and r.gworst < 0.05, ('gradients rel L2 mean %.3f%% worst %.3f%%'):format(100 * r.gmean,
        100 * r.gworst))
end)

os.exit(T:run())
