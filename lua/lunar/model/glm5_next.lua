-- lunar.model.glm5_next: GLM-5.3-Flash's text tower and LM head (transformers'
-- Glm5NextForConditionalGeneration, text only): forward to logits, log-probabilities or the HF
-- loss, and the backward of every trainable parameter. It shares GLM-5's head, losses, stages
-- and RL interface (lunar.model.glm: a Flash model is a glm.Model whose embedding, decoder
-- layers and the head's input differ); what is its own:
--
--   streams  the embedding is copied into hc_mult residual streams (N, n, H); every layer reads
--            its two blocks' inputs from them and writes their outputs back through its mHC
--            sites (lunar.nn.HyperConnection); the head reads their mean
--   layers   KDA linear attention (lunar.nn.KDA) or NoPE MLA over k-pool DSA selections
--            (lunar.nn.NopeMLA), per cfg.layer_types; a shared DSA layer reuses the selection of
--            the full DSA layer before it; MLPs and MoE with the swiglu_limit clamp
--   batch    rows in segments: each batch row, or each document of a packed row (cu_seqlens),
--            starts the KDA state, the short conv's history and the pools' anchoring afresh
--
--   local m = glm5_next.new(cfg, {seed = 1})     cfg: lunar.model.glm5_next_config's
--   local out = m:forward(batch, {loss = true}); m:backward()
-- batch as lunar.model.glm's (input_ids, labels, attention_mask, cu_seqlens, routing).
-- Parallel: tensor (KDA and MLA heads, the MLPs), expert and expert tensor parallel
-- (lunar.parallel.context); not yet sequence parallel, fp32_residual (refused). Generation:
-- lunar.generate.flash.
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local ops = require 'lunar.ops'
local nn = require 'lunar.nn'
local glm = require 'lunar.model.glm'
local fparams = require 'lunar.model.glm5_next_params'
local context = require 'lunar.parallel.context'
local NopeMLA = require 'lunar.nn.nope_mla'

local M = {}
local Model = setmetatable({}, {__index = glm.Model})
Model.__index = Model
M.Model = Model
-- generation's cache layout, prefill and decode step (lunar.generate.decode asks for them)
Model.decode_module = 'lunar.generate.flash'
-- RL's shared prompts (lunar.rl.batch) give a response its prompt's keys through key lists; a
-- KDA layer would need the prompt's final state instead, so each sample packs its own prompt
Model.no_shared_prompts = 'its KDA layers carry a recurrent state that key lists cannot continue: each sample packs its own prompt'

local fail = tensor.fail
local P = fparams.PREFIX

-- par (lunar.parallel.context): tensor parallel splits KDA's and the NoPE MLA's heads and the
-- MLPs' rows; expert parallel the routed experts (lunar.nn.MoE); the mHC sites, the norms and the
-- k-pool indexer stay whole on every rank
local function build_layer(store, cfg, i, par)
    local p = fparams.layer_prefix(i):sub(1, -2)
    local L = {index = i, name = p, kind = fparams.is_kda(cfg, i) and 'kda' or 'dsa'}
    L.attn_hc = nn.HyperConnection.new(store, p .. '.hc_attn', cfg)
    L.ffn_hc = nn.HyperConnection.new(store, p .. '.hc_ffn', cfg)
    L.input_norm = nn.RMSNorm.new(store, p .. '.input_layernorm', cfg.rms_norm_eps)
    L.post_norm = nn.RMSNorm.new(store, p .. '.post_attention_layernorm', cfg.rms_norm_eps)
    if L.kind == 'kda' then
        L.attn = nn.KDA.new(store, p .. '.self_attn', cfg, {par = par})
    else
        L.attn = NopeMLA.new(store, p .. '.self_attn', cfg, {indexer = cfg.indexer_types[i + 1], par = par})
    end
    L.mlp_type = fparams.mlp_type(cfg, i)
    if L.mlp_type == 'dense' then
        local io = par:block('mlp')
        L.mlp = nn.MLP.new(store, p .. '.mlp', cfg.hidden_act, {limit = cfg.swiglu_limit, input = io.input,
                                                                 output = io.output})
    else
        L.mlp = nn.MoE.new(store, p .. '.mlp', cfg, {par = par})
    end
    return L
end

local function build(cfg, store, opts)
    local m = setmetatable({cfg = cfg, params = store, opts = opts, hooks = {}, layer_backward_hooks = {}}, Model)
    m.dtype = store:get(P .. 'embed_tokens.weight'):dtype()
    if opts.fp32_residual and m.dtype ~= 'f32' then
        fail(('glm5_next (GLM-5.3-Flash) in %s with fp32_residual is not implemented: the mHC sites mix the streams '
            .. 'in f32 but keep them in the parameters\' dtype; set model.fp32_residual=false'):format(m.dtype))
    end
    m.fp32_residual = false
    m.n = cfg.hc_mult
    m.par = context.new(cfg, opts)
    m.vocab, m.sp = m.par.vocab_split, nil
    m.embed = nn.Embedding.new(store, P .. 'embed_tokens', cfg.pad_token_id, {vocab = m.par.vocab})
    m.layers = {}
    for i = 0, cfg.num_hidden_layers - 1 do m.layers[i + 1] = build_layer(store, cfg, i, m.par) end
    m.norm = nn.RMSNorm.new(store, P .. 'norm', cfg.rms_norm_eps)
    m.lm_head = nn.Linear.new(store, cfg.tie_word_embeddings and (P .. 'embed_tokens') or 'lm_head')
    m.mtp = {}
    m.whole = m:stage{embed = true, first = 1, last = #m.layers, head = true}
    return m
end

-- HF's _init_weights: normal(0, initializer_range) for linears and the embedding (its padding
-- row zeroed), N(0, 0.02) for the mHC projections, ones for norms and the mHC scales, zeros for
-- biases, the mHC bases, the router's correction bias and the indexer's ape, ones for its gate;
-- the forget gate as FLA initialises it (A_log 0 with the lower bound, else log U(1, 16);
-- dt_bias the inverse softplus of e^U(ln 1e-3, ln 1e-1)).
function M.new(cfg, opts)
    opts = opts or {}
    local rng = core.rng_new(opts.seed or 0):split('init')
    local store = nn.params.new()
    local std = cfg.initializer_range or 0.02
    -- (a split tensor is drawn whole and cut: every layout starts from the one-rank weights)
    for _, s in ipairs(fparams.spec(cfg, M.spec_opts(cfg, opts))) do
        local shape = s.full_shape or s.shape
        local t = core.empty(shape, s.dtype or opts.dtype or 'f32', opts.device)
        local r = rng:split(s.name)
        if s.init == 'normal' then r:normal_(t, 0, std)
        elseif s.init == 'hc_fn' then r:normal_(t, 0, 0.02)
        elseif s.init == 'ones' then t:fill_(1)
        elseif s.init == 'a_log' then
            if cfg.linear_lower_bound ~= nil then t:fill_(0)
            else ops.log(r:uniform_(t, 1, 16), {out = t}) end
        elseif s.init == 'dt_bias' then
            local dt = ops.maximum(ops.exp(r:uniform_(core.empty(shape, 'f32', opts.device), math.log(1e-3), math.log(1e-1))), 1e-4)
            -- dt + log(-expm1(-dt)) = log(e^dt - 1)
            t:copy_(ops.log(ops.sub(ops.exp(dt), 1)))
        else t:fill_(0) end
        if s.name == P .. 'embed_tokens.weight' and type(cfg.pad_token_id) == 'number' then
            t:select(1, cfg.pad_token_id + 1):fill_(0)
        end
        if s.slice then t = t:narrow(s.slice.dim, s.slice.start + 1, s.slice.len):contiguous() end
        store:add(s.name, t, s.trainable)
    end
    local m = build(cfg, store, opts)
    -- the vision tower of a nested config, initialised as transformers would, for the export only
    if cfg.vision_config then
        m.carried = {}
        local vrng = rng:split('vision')
        local vstd = cfg.vision_config.initializer_range
        if type(vstd) ~= 'number' then vstd = 0.02 end
        for _, s in ipairs(fparams.vision_spec(cfg.vision_config, cfg.source)) do
            local t = core.empty(s.shape, 'f32', 'cpu')
            if s.init == 'normal' then vrng:split(s.name):normal_(t, 0, vstd)
            elseif s.init == 'ones' then t:fill_(1)
            else t:fill_(0) end
            m.carried[s.name] = m.dtype == 'f32' and t or t:to(m.dtype)
        end
    end
    return m
end

-- load(dir, cfg, opts) -> model: an HF checkpoint directory of a glm5_next model (its config
-- already validated). FP8 block-scaled weights are dequantised as they are read
-- (lunar.io.load_checkpoint); fused expert tensors split per expert. The vision tower
-- (model.visual.*), the MTP layer (layers.<num_hidden_layers>.*) and shared_head tensors, which
-- transformers' text model does not read either, are carried untouched for the export
-- (model.carried). opts: dtype (default f32), device, quiet, strict (false: skip tensors
-- the model does not know instead of refusing them), tp / ep / etp (lunar.dist groups: this
-- rank's blocks and experts). dir may also be a sharded model (lunar.parallel.checkpoint: a split
-- run's checkpoint), read into any layout.
local function is_carried(cfg, name)
    local li = name:match('^' .. P:gsub('%.', '%%.') .. 'layers%.(%d+)%.')
    return name:find('^model%.visual%.') or name:find('.shared_head.', 1, true) or (li and tonumber(li) >= cfg.num_hidden_layers)
end

function M.load(dir, cfg, opts)
    opts = opts or {}
    local lio = require 'lunar.io'
    local mparams = require 'lunar.model.params'
    local sharded = require 'lunar.parallel.checkpoint'
    -- expert parallel: this rank's routed experts; tensor parallel: its block of each split tensor
    local so = M.spec_opts(cfg, opts)
    local spec = fparams.spec(cfg, so)
    local function elsewhere(name)   -- a routed expert another ep rank holds
        local e = so.experts and name:match('%.mlp%.experts%.(%d+)%.')
        return e and (tonumber(e) < so.experts.first or tonumber(e) >= so.experts.first + so.experts.count) or false
    end
    local tensors, metadata, fused, file_dtypes, cut
    if sharded.is_sharded(dir) then
        -- this rank's blocks, and the carried tensors whole
        local want = {}
        for _, s in ipairs(spec) do want[#want + 1] = s end
        for name, e in pairs(sharded.entries(dir)) do
            if is_carried(cfg, name) then want[#want + 1] = {name = name, shape = e.shape} end
        end
        local source, _
        tensors, file_dtypes, _, source = sharded.read(dir, want)
        metadata, fused, cut = source.metadata or {}, source.fused or {}, true
    else
        tensors, metadata = lio.load_checkpoint(dir, {quiet = opts.quiet, fp8_block = cfg.fp8_block})
        fused, file_dtypes = mparams.split_all_fused(tensors), {}
    end
    local known, missing = {}, {}
    for _, s in ipairs(spec) do
        known[s.name] = s
        if not tensors[s.name] then missing[#missing + 1] = s.name end
    end
    local function some(list) table.sort(list); return table.concat(list, ', ', 1, math.min(#list, 5)) end
    if #missing > 0 then
        fail(('%s: %d tensor%s missing from the checkpoint, e.g. %s'):format(dir, #missing,
            #missing == 1 and ' is' or 's are', some(missing)))
    end
    local carried, unexpected = {}, {}
    for name, t in pairs(tensors) do
        if not known[name] and not elsewhere(name) then
            if is_carried(cfg, name) then
                carried[name] = t
            else
                unexpected[#unexpected + 1] = name
            end
        end
    end
    if #unexpected > 0 and opts.strict ~= false then
        fail(('%s: %d tensor%s the %s model does not have, e.g. %s'):format(dir, #unexpected,
            #unexpected == 1 and '' or 's', cfg.architecture, some(unexpected)))
    end
    local store = nn.params.new()
    local dtypes = {}
    for _, s in ipairs(spec) do
        local t = tensors[s.name]
        local ts, whole = t:size(), (not cut and s.full_shape) or s.shape
        local same = #ts == #whole
        for k = 1, #whole do same = same and ts[k] == whole[k] end
        if not same then
            fail(('%s: tensor %s has shape (%s), the config says (%s)'):format(dir, s.name, table.concat(ts, ', '),
                table.concat(whole, ', ')))
        end
        dtypes[s.name] = file_dtypes[s.name] or t:dtype()
        if s.slice and not cut then t = t:narrow(s.slice.dim, s.slice.start + 1, s.slice.len):contiguous() end
        store:add(s.name, core.convert(t, s.dtype or opts.dtype or 'f32', opts.device), s.trainable)
    end
    local model = build(cfg, store, opts)
    model.source = {path = dir, dtypes = dtypes, fused = fused, metadata = metadata}
    model.carried = carried
    return model
end

function M.from_params(cfg, store, opts) return build(cfg, store, opts or {}) end

-- the spec options of a model of cfg built with opts (tp, ep, etp groups): this rank's blocks
function M.spec_opts(cfg, opts) return context.new(cfg, opts or {}):spec_opts(false) end

function Model:device() return self.params:get(P .. 'embed_tokens.weight'):device() end

-- ---- batch preparation ----------------------------------------------------------------------

-- the documents of each row, 0-based [first, stop): cu_seqlens' (one tensor for B = 1, or one per
-- row), the rest of a row after its last document being one more; one per row otherwise
local function docs_of(B, T, cu)
    local rows = cu and (tensor.is_tensor(cu) and {cu} or cu) or nil
    if rows and #rows ~= B then
        fail(('forward: cu_seqlens gives %d rows of documents for a batch of %d rows'):format(#rows, B))
    end
    local out = {}
    for r = 1, B do
        local list = {}
        if rows then
            local c = rows[r]:to('cpu'):tolist_flat()
            if c[1] ~= 0 or c[#c] > T then
                fail(('forward: cu_seqlens of row %d runs from %d to %d, expected 0 to at most T = %d'):format(r, c[1],
                    c[#c], T))
            end
            for d = 2, #c do
                if c[d] < c[d - 1] then fail(('forward: cu_seqlens of row %d falls at entry %d'):format(r, d)) end
                if c[d] > c[d - 1] then list[#list + 1] = {c[d - 1], c[d]} end
            end
            if c[#c] < T then list[#list + 1] = {c[#c], T} end
        else
            list[1] = {0, T}
        end
        out[r] = list
    end
    return out
end

function Model:prepare(batch)
    local ids = batch.input_ids
    if not tensor.is_tensor(ids) or ids:dim() ~= 2 then fail('forward: batch.input_ids must be a (B, T) tensor') end
    local B, T = ids:size(1), ids:size(2)
    -- GLM-5.3-Flash has no positions, and its KDA layers a recurrent state: documents come from
    -- cu_seqlens alone. Key lists, and positions that restart without cu_seqlens, would be ignored:
    -- refused instead (positions beside cu_seqlens, as the loader gives them, say nothing more)
    local function refuse(k)
        fail(('forward: batch.%s is not supported by glm5_next (GLM-5.3-Flash has no positions and its KDA layers a '
            .. 'recurrent state): pack documents with batch.cu_seqlens'):format(k))
    end
    if batch.key_lists ~= nil then refuse('key_lists') end
    if batch.position_ids ~= nil and batch.cu_seqlens == nil then
        local pos = batch.position_ids:to('cpu'):tolist_flat()
        for i, p in ipairs(pos) do
            if p ~= (i - 1) % T then refuse('position_ids (restarting without cu_seqlens)') end
        end
    end
    local dev = self:device()
    local function on(t) if t ~= nil and tensor.is_tensor(t) and t:device() ~= dev then return t:to(dev) end return t end
    local am = batch.attention_mask
    local valid_host
    if am ~= nil then
        if not tensor.is_tensor(am) or am:numel() ~= B * T then
            fail(('forward: batch.attention_mask must be a (%d, %d) tensor of 1 (token) and 0 (padding)'):format(B, T))
        end
        valid_host = am:to('cpu'):tolist_flat()
        for i, v in ipairs(valid_host) do valid_host[i] = v ~= 0 and 1 or 0 end
    else
        valid_host = {}
        for i = 1, B * T do valid_host[i] = 1 end
    end
    local all_valid = true
    for _, v in ipairs(valid_host) do if v == 0 then all_valid = false break end end
    local cu = batch.cu_seqlens
    local docs = docs_of(B, T, cu)
    local seg = {0}
    for r = 1, B do
        for _, d in ipairs(docs[r]) do seg[#seg + 1] = (r - 1) * T + d[2] end
    end
    local routing
    if batch.routing then
        routing = {}
        for layer, idx in pairs(batch.routing) do routing[layer] = on(idx) end
    end
    local cu_host = cu
    if tensor.is_tensor(cu) then cu_host = cu:to('cpu')
    elseif type(cu) == 'table' then
        cu_host = {}
        for i, c in ipairs(cu) do cu_host[i] = c:to('cpu') end
    end
    return {
        B = B, T = T, N = B * T, ids = on(ids):contiguous():view(B * T):to('i64'), input_ids = on(ids),
        labels = on(batch.labels), routing = routing, attention_mask = on(am), cu_seqlens = cu_host,
        docs = docs, valid_host = valid_host,
        valid = not all_valid and core.from_flat(valid_host, {B * T, 1}, self.dtype, dev) or nil,
        seg = core.from_flat(seg, {#seg}, 'i64', dev),
    }
end

-- ---- streams, layers, head --------------------------------------------------------------------

function Model:_embed_forward(b, opts)
    local x, s_emb = self.embed:forward(b.ids)
    self:_emit(P .. 'embed_tokens', 'output', x)
    self.par:check_forward(opts)
    local N, H = x:size(1), x:size(2)
    local X = core.empty({N, self.n, H}, x:dtype(), x:device())
    X:copy_(x:view(N, 1, H):expand(N, self.n, H))
    return X, s_emb
end

function Model:_embed_backward(dX, saved)
    self.embed:backward(ops.sum(dX, 2):to(self.dtype), saved.emb)
end

-- one decoder layer on the streams X (N, n, H) -> X3, its saved state, the DSA selection, the
-- routing. dec (generation's decode step, lunar.generate.flash): {attend = function(L, xn,
-- prev_keys) -> a, keys: the layer's attention over the cache; linear: the products' options}
function Model:layer_forward(L, X, b, prev_keys, replay, dec)
    local lo = dec and dec.linear
    local u, s1 = L.attn_hc:read(X, lo)
    local xn, s_in = L.input_norm:forward(u)
    self:_emit(L.name .. '.self_attn', 'input', xn)
    local a, s_attn, keys
    if dec then
        a, keys = dec.attend(L, xn, prev_keys)
    elseif L.kind == 'kda' then
        a, s_attn = L.attn:forward(xn, {seg = b.seg, valid = b.valid, want_state = b.for_cache})
    else
        a, s_attn, keys = L.attn:forward(xn, b, prev_keys)
    end
    self:_emit(L.name .. '.self_attn', 'output', a)
    local X2 = L.attn_hc:write(X, a, s1)
    local u2, s2 = L.ffn_hc:read(X2, lo)
    local hn, s_post = L.post_norm:forward(u2)
    self:_emit(L.name .. '.mlp', 'input', hn)
    local m, s_mlp, routing
    if L.mlp_type == 'dense' then m, s_mlp = L.mlp:forward(hn, lo)
    else m, s_mlp, routing = L.mlp:forward(hn, {replay_idx = replay, row_invariant = lo and lo.row_invariant}) end
    self:_emit(L.name .. '.mlp', 'output', m)
    local X3 = L.ffn_hc:write(X2, m, s2)
    self:_emit(L.name, 'output', X3)
    return X3, {s1 = s1, s_in = s_in, s_attn = s_attn, a = a, s2 = s2, s_post = s_post, s_mlp = s_mlp, m = m}, keys, routing
end

local function layer_backward(L, dX3, s)
    local dX2, dm = L.ffn_hc:write_backward(dX3, s.m, s.s2)
    local du2 = L.post_norm:backward(L.mlp:backward(dm:to(s.m:dtype()), s.s_mlp), s.s_post)
    dX2 = L.ffn_hc:read_backward(du2, s.s2, dX2)
    local dX, da = L.attn_hc:write_backward(dX2, s.a, s.s1)
    local du = L.input_norm:backward(L.attn:backward(da:to(s.a:dtype()), s.s_attn), s.s_in)
    return L.attn_hc:read_backward(du, s.s1, dX)
end

function Model:_layers_forward(X, b, first, last, saved)
    local prev
    for i = first, last do
        local L = self.layers[i]
        local s, keys, r
        X, s, keys, r = self:layer_forward(L, X, b, prev, b.routing and b.routing[i - 1])
        saved.layers[i] = s
        -- a DSA layer's selection goes on to the layer after it (a shared DSA layer's reads it)
        prev = keys
        if keys then saved.topk[i - 1] = keys end
        if r then saved.routing[i - 1] = r end
    end
    return X
end

function Model:_layers_backward(dX, saved, first, last)
    for i = last, first, -1 do
        dX = layer_backward(self.layers[i], dX, saved.layers[i])
        for _, fn in ipairs(self.layer_backward_hooks) do fn(i) end
    end
    return dX:to(self.dtype), 0
end

-- the head reads the streams' mean (HF's Glm5NextTextHyperHead)
function Model:_head_forward(X, b, opts, saved)
    local h = ops.mean(X, 2)
    self:_emit('model.hyper_head', 'output', h)
    return glm.Model._head_forward(self, h, b, opts, saved)
end

function Model:_head_backward(saved, opts)
    local dh = glm.Model._head_backward(self, saved, opts)
    local N, H = dh:size(1), dh:size(2)
    local dX = core.empty({N, self.n, H}, 'f32', dh:device())
    dX:copy_(ops.div(dh:float(), self.n):view(N, 1, H):expand(N, self.n, H))
    return dX
end


return M
