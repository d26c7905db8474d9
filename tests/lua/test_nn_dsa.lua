-- test_nn_dsa.lua: the DSA lightning indexer (lunar.nn.dsa) and its use by lunar.nn.MLA:
--   * the index score I + mask against a plain-Lua reference of glm5-architecture.md 6.2
--     (wq_b, LayerNorm keys, interleaved RoPE on the FIRST Dr dims written half-split, per-head
--     ReLU, signed head weights * Hi^-0.5), and the top-k selection against it;
--   * T > index_topk drops keys (each query with more than k visible keys attends exactly k,
--     the output equals attention under masks.select), T <= index_topk is plain causal MLA;
--   * IndexShare: shared layers reuse the full layer's indices unchanged;
--   * the indexer parameters get no gradient from the LM loss;
--   * the indexer KL loss (sparse and dense targets): its value against a plain-Lua formula and
--     its gradient (indexer parameters only) against central finite differences (f32, eps 2e-4,
--     rtol 2e-2, atol 2e-4), with the selection and the ReLU pattern checked to stay fixed
--     under the perturbation (a score crossing 0 makes the difference quotient meaningless).
local lunar = require 'lunar'
local nn = require 'lunar.nn'
local ops = lunar.ops
local masks = nn.masks
local T = require('lunar.testing').suite('nn.dsa')

lunar.manual_seed(33)

local CFG = {hidden_size = 16, num_attention_heads = 2, q_lora_rank = 8, kv_lora_rank = 8, qk_nope_head_dim = 4,
             qk_rope_head_dim = 4, v_head_dim = 6, index_n_heads = 8, index_head_dim = 8, index_topk = 3}

local function with(extra)
    local c = {}
    for k, v in pairs(CFG) do c[k] = v end
    for k, v in pairs(extra or {}) do c[k] = v end
    return c
end

local function store_for(cfg, name, indexer_trainable)
    local s = nn.params.new()
    local H, NH, Rq, Rkv = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    local Dn, Dr, Dv, Hi, Di = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.index_n_heads, cfg.index_head_dim
    local function w(n, o, i) s:add(name .. '.' .. n .. '.weight', ops.mul(lunar.randn(o, i), 0.4)) end
    local function norm(n, d) s:add(name .. '.' .. n .. '.weight', ops.add(ops.mul(lunar.randn(d), 0.1), 1)) end
    w('q_a_proj', Rq, H); norm('q_a_layernorm', Rq); w('q_b_proj', NH * (Dn + Dr), Rq)
    w('kv_a_proj_with_mqa', Rkv + Dr, H); norm('kv_a_layernorm', Rkv); w('kv_b_proj', NH * (Dn + Dv), Rkv)
    w('o_proj', H, NH * Dv)
    w('indexer.wq_b', Hi * Di, Rq); w('indexer.wk', Di, H); w('indexer.weights_proj', Hi, H)
    norm('indexer.k_norm', Di)
    s:add(name .. '.indexer.k_norm.bias', ops.mul(lunar.randn(Di), 0.1))
    for pname in s:names() do
        if pname:find('indexer', 1, true) then s:set_trainable(pname, indexer_trainable or false) end
    end
    return s
end

local function make_batch(B, Tn, am)
    local pos = {}
    for _ = 1, B do for t = 1, Tn do pos[#pos + 1] = t - 1 end end
    local amt = am and lunar.tensor(am, 'i64') or nil
    return {B = B, T = Tn, positions = lunar.tensor(pos, 'i64'):view({B, Tn}), attention_mask = amt,
            mask = masks.build{B = B, T = Tn, attention_mask = amt}, inv_freq = ops.rope_inv_freq(CFG.qk_rope_head_dim, 10000)}
end

-- plain-Lua reference of the index score I[b][s][t] (without the mask)
local function ref_index_score(s, name, cfg, x, q_resid, batch)
    local H, Rq, Hi, Di, Dr = cfg.hidden_size, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    local B, Tn = batch.B, batch.T
    local xf, qf = x:tolist_flat(), q_resid:tolist_flat()
    local Wq = s:get(name .. '.wq_b.weight'):tolist_flat()
    local Wk = s:get(name .. '.wk.weight'):tolist_flat()
    local Ww = s:get(name .. '.weights_proj.weight'):tolist_flat()
    local lw, lb = s:get(name .. '.k_norm.weight'):tolist_flat(), s:get(name .. '.k_norm.bias'):tolist_flat()
    local freq = batch.inv_freq:tolist_flat()
    local pos = batch.positions:tolist_flat()
    local function matvec(W, rows, cols, v, off)
        local out = {}
        for r = 0, rows - 1 do
            local acc = 0
            for c = 0, cols - 1 do acc = acc + W[r * cols + c + 1] * v[off + c + 1] end
            out[r + 1] = acc
        end
        return out
    end
    local function rope(v, base, p)   -- interleaved pairs of v[base+1 .. base+Dr], written half-split
        local half = Dr / 2
        local e, o = {}, {}
        for i = 1, half do e[i] = v[base + 2 * i - 1]; o[i] = v[base + 2 * i] end
        for i = 1, half do
            local a = lunar.tensor({p * freq[i]}):get(1)   -- f32 angle
            local c, sn = math.cos(a), math.sin(a)
            v[base + i] = e[i] * c - o[i] * sn
            v[base + half + i] = o[i] * c + e[i] * sn
        end
    end
    local qi, ki, wts = {}, {}, {}
    for n = 0, B * Tn - 1 do
        qi[n] = matvec(Wq, Hi * Di, Rq, qf, n * Rq)
        for h = 0, Hi - 1 do rope(qi[n], h * Di, pos[n + 1]) end
        local k = matvec(Wk, Di, H, xf, n * H)
        local mean, var = 0, 0
        for d = 1, Di do mean = mean + k[d] end
        mean = mean / Di
        for d = 1, Di do var = var + (k[d] - mean) ^ 2 end
        var = var / Di
        for d = 1, Di do k[d] = (k[d] - mean) / math.sqrt(var + 1e-6) * lw[d] + lb[d] end
        rope(k, 0, pos[n + 1])
        ki[n] = k
        wts[n] = matvec(Ww, Hi, H, xf, n * H)
    end
    local I = {}
    for b = 0, B - 1 do
        I[b + 1] = {}
        for q = 0, Tn - 1 do
            I[b + 1][q + 1] = {}
            local nq = b * Tn + q
            for t = 0, Tn - 1 do
                local nk = b * Tn + t
                local acc = 0
                for h = 0, Hi - 1 do
                    local dot = 0
                    for d = 1, Di do dot = dot + qi[nq][h * Di + d] * ki[nk][d] end
                    acc = acc + wts[nq][h + 1] * Hi ^ -0.5 * math.max(0, dot * Di ^ -0.5)
                end
                I[b + 1][q + 1][t + 1] = acc
            end
        end
    end
    return I
end

T:test('index score and top-k selection against the plain-Lua reference', function()
    for _, case in ipairs({{B = 2, T = 7, k = 3, am = {{1, 1, 1, 1, 1, 1, 1}, {1, 1, 1, 1, 1, 0, 0}}},
                           {B = 1, T = 17, k = 5}, {B = 1, T = 4, k = 8}}) do
        local cfg = with({index_topk = case.k})
        local s = store_for(cfg, 'a')
        local idx = nn.DSA.new(s, 'a.indexer', cfg)
        local batch = make_batch(case.B, case.T, case.am)
        local N = case.B * case.T
        local x, q_resid = lunar.randn(N, 16), lunar.randn(N, 8)
        local topk, saved = idx:forward(x, q_resid, batch)
        local kk = math.min(case.k, case.T)
        T.equal(topk:size(), {case.B, case.T, kk}, 'topk shape')
        local I = ref_index_score(s, 'a.indexer', cfg, x, q_resid, batch)
        local sc = saved.scores:tolist()
        local tk = topk:tolist()
        for b = 1, case.B do
            for q = 1, case.T do
                local vis = {}
                for t = 1, case.T do
                    if batch.mask:get(b, q, t) == 0 then
                        vis[#vis + 1] = t
                        T.close(sc[b][q][t], I[b][q][t], {rtol = 1e-4, atol = 1e-5, msg = 'score'})
                    else
                        T.equal(sc[b][q][t], masks.FMIN, 'masked score')
                    end
                end
                -- the reference winners among visible keys
                table.sort(vis, function(u, v) return I[b][q][u] > I[b][q][v] end)
                local want = math.min(kk, #vis)
                if want < #vis then
                    assert(I[b][q][vis[want]] - I[b][q][vis[want + 1]] > 1e-4, 'a tie at the top-k boundary: change the seed')
                end
                local chosen = {}
                for _, t in ipairs(tk[b][q]) do chosen[t + 1] = true end
                for j = 1, want do assert(chosen[vis[j]], ('case T %d: row %d query %d misses key %d'):format(case.T, b, q, vis[j])) end
            end
        end
    end
end)

T:test('T > index_topk drops keys: k keys per query, output = attention under the selection', function()
    local cfg = with({index_topk = 3})
    local s = store_for(cfg, 'a')
    local full = nn.MLA.new(s, 'a', cfg)
    local plain = nn.MLA.new(s, 'a', cfg, {indexer = 'none'})
    local shared = nn.MLA.new(s, 'a', cfg, {indexer = 'shared'})
    local batch = make_batch(2, 7)
    local x = lunar.randn(14, 16)
    local out, saved, topk = full:forward(x, batch)
    local P = saved.att.P
    for b = 1, 2 do
        for h = 1, 2 do
            for q = 1, 7 do
                local nz = 0
                for t = 1, 7 do if P:get(b, h, q, t) > 0 then nz = nz + 1 end end
                T.equal(nz, math.min(q, 3), 'attended keys')
            end
        end
    end
    T.equal(out, (shared:forward(x, batch, topk)), 'full layer = shared layer given the same top-k')
    local dense = plain:forward(x, batch)
    assert(ops.max(ops.abs(ops.sub(out, dense))):item() > 1e-3, 'dropping keys changes the output')
end)

T:test('T <= index_topk: every key selected, the layer is plain causal MLA', function()
    for _, k in ipairs({5, 64}) do
        local cfg = with({index_topk = k})
        local s = store_for(cfg, 'a')
        local batch = make_batch(2, 5, {{1, 1, 1, 1, 1}, {0, 1, 1, 1, 1}})
        local x = lunar.randn(10, 16)
        local out, _, topk = nn.MLA.new(s, 'a', cfg):forward(x, batch)
        T.equal(topk:size(), {2, 5, 5}, 'k = min(index_topk, T)')
        T.equal(out, (nn.MLA.new(s, 'a', cfg, {indexer = 'none'}):forward(x, batch)), 'same as plain MLA')
    end
end)

T:test('IndexShare: shared layers reuse the last full layer indices', function()
    local cfg = with({index_topk = 2})
    local s0, s1, s2 = store_for(cfg, 'l0'), store_for(cfg, 'l1'), store_for(cfg, 'l2')
    local l0 = nn.MLA.new(s0, 'l0', cfg)
    local l1 = nn.MLA.new(s1, 'l1', cfg, {indexer = 'shared'})
    local l2 = nn.MLA.new(s2, 'l2', cfg, {indexer = 'shared'})
    assert(l1.indexer == nil and l2.indexer == nil, 'shared layers own no indexer')
    local batch = make_batch(1, 6)
    local x = lunar.randn(6, 16)
    local _, _, t0 = l0:forward(x, batch)
    local y1, _, t1 = l1:forward(x, batch, t0)
    local _, _, t2 = l2:forward(y1, batch, t1)
    assert(t1 == t0 and t2 == t0, 'indices passed on unchanged')
    -- the shared layer's attention uses exactly that selection
    local plain = nn.MLA.new(s1, 'l1', cfg, {indexer = 'none'})
    local b2 = {}
    for k, v in pairs(batch) do b2[k] = v end
    b2.mask = masks.select(batch.mask, t0)
    T.equal(y1, (plain:forward(x, b2)), 'shared layer = plain MLA under the selection mask')
end)

T:test('the indexer gets no gradient from the LM loss (coefficient 0)', function()
    local cfg = with({index_topk = 3})
    local s = store_for(cfg, 'a', true)
    local m = nn.MLA.new(s, 'a', cfg)
    local batch = make_batch(2, 6)
    local x = lunar.randn(12, 16)
    local _, saved = m:forward(x, batch)
    assert(saved.indexer_loss == nil)
    local dx, il = m:backward(lunar.randn(12, 16), saved)
    assert(dx and il == nil)
    for pname in s:names() do
        if pname:find('indexer', 1, true) then assert(s.grads[pname] == nil, pname .. ' got a gradient')
        else assert(s.grads[pname], pname .. ' got none') end
    end
end)

-- plain-Lua KL loss: rows of p and q_hat, valid (B, T) list, coefficient
local function ref_kl(p, qh, valid, coeff)
    local n, total = 0, 0
    for b = 1, #p do
        for q = 1, #p[b] do
            if valid[b][q] ~= 0 then
                n = n + 1
                for t = 1, #p[b][q] do
                    local pv = p[b][q][t]
                    total = total + pv * (math.log(pv + 1e-10) - math.log(qh[b][q][t] + 1e-10))
                end
            end
        end
    end
    return coeff * total / n
end

T:test('indexer KL loss: value and gradient (indexer parameters only), sparse and dense', function()
    for _, variant in ipairs({'sparse', 'dense'}) do
        local cfg = with({index_topk = 3})
        local s = store_for(cfg, 'a', true)
        local coeff = 0.5
        local m = nn.MLA.new(s, 'a', cfg, {indexer_loss_coeff = coeff, indexer_loss = variant})
        local batch = make_batch(2, 6, {{1, 1, 1, 1, 1, 1}, {1, 1, 1, 1, 0, 0}})
        local x = lunar.randn(12, 16)
        s:zero_grad()
        local _, saved, topk = m:forward(x, batch)
        local loss = saved.indexer_loss
        assert(type(loss) == 'number' and loss > 0, 'a positive loss')
        -- value: target from the main attention probabilities
        local isaved = saved.isaved
        local P = saved.att.P
        local p, smask
        if variant == 'sparse' then
            p, smask = P, masks.select(batch.mask, topk)
        else
            local Sc = nn.attention.scores(saved.att.q, saved.att.k, m.scaling)
            p, smask = ops.softmax(ops.add(Sc, batch.mask:unsqueeze(2))), batch.mask
        end
        local pl = ops.sum(p, 2):tolist()
        for b = 1, 2 do for q = 1, 6 do
            local z = 0
            for t = 1, 6 do z = z + pl[b][q][t] end
            for t = 1, 6 do pl[b][q][t] = pl[b][q][t] / z end
        end end
        local qh = ops.softmax(ops.add(isaved.I, smask)):tolist()
        local valid = {{1, 1, 1, 1, 1, 1}, {1, 1, 1, 1, 0, 0}}
        T.close(loss, ref_kl(pl, qh, valid, coeff), {rtol = 1e-5, atol = 1e-7, msg = variant .. ' loss value'})
        -- gradient: dout = 0, so only the KL loss contributes
        local _, il = m:backward(lunar.zeros(12, 16), saved)
        T.equal(il, loss, 'backward returns the loss')
        local inputs, grads = {}, {}
        for pname in s:names() do
            if pname:find('indexer', 1, true) then
                inputs[#inputs + 1] = s:get(pname)
                grads[#grads + 1] = s:grad(pname):clone()
            else
                T.equal(ops.max(ops.abs(s:grad(pname))):item(), 0, pname .. ' gets nothing from the KL loss')
            end
        end
        -- finite differences are valid only while the selection and the ReLU pattern stay fixed
        local ref_topk, ref_relu = topk:tolist_flat(), ops.gt(isaved.A, 0):tolist_flat()
        T.gradcheck{name = 'kl ' .. variant, eps = 2e-4, rtol = 2e-2, atol = 2e-4, max_checks = 24,
            inputs = inputs, grads = grads, f = function()
                local _, sv, tk = m:forward(x, batch)
                T.equal(tk, ref_topk, 'the selection is fixed under the perturbation')
                T.equal(ops.gt(sv.isaved.A, 0), ref_relu, 'no score crosses the ReLU kink')
                return sv.indexer_loss
            end}
    end
end)

os.exit(T:run())
