-- lunar.model.glm: GLM-5 (GlmMoeDsaForCausalLM) and GLM-4.x MoE (Glm4MoeForCausalLM) causal
-- language models: forward to logits, log-probabilities or the HF loss, and the backward of
-- every trainable parameter, with explicit modules (lunar.nn) over C ops.
--
--   local m = glm.new(cfg, {seed = 1})                 -- cfg: validated (lunar.model.config)
--   local out = m:forward(batch, {loss = true})        -- out.logits (B, T, V), out.loss (number)
--   m:backward()                                       -- gradients of out.loss into m.params
--   local out = m:forward(batch, {logprobs = true, entropy = true, temperature = 0.7})   -- RL
--   m:backward{dlogprobs = (B, T), dentropy = (B, T)}  -- gradients of sum(dlogprobs * logprobs
--                                                      -- + dentropy * entropy)
--
-- batch = {input_ids = (B, T) i64, labels = (B, T) i64 (HF convention: shifted inside, -100
-- ignored), attention_mask = (B, T) (1 = token, 0 = padding), position_ids = (B, T),
-- cu_seqlens = (S+1) for one packed row of S documents (positions restart per document and
-- attention is block-diagonal), routing = {[layer] = (B*T, K) i64} to replay expert choices (R3)}.
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local ops = require 'lunar.ops'
local nn = require 'lunar.nn'
local params = require 'lunar.model.params'
local lora = require 'lunar.nn.lora'
local context = require 'lunar.parallel.context'

local M = {}
local Model = {}
Model.__index = Model
M.Model = Model

local function fail(msg) tensor.fail(msg) end

local function rope_theta(cfg)
    local rp = cfg.rope_parameters
    if type(rp) == 'table' then
        if (rp.rope_type or 'default') ~= 'default' then
            fail(('rope_type %q is not supported yet (GLM-5.x and GLM-4.x use "default")'):format(rp.rope_type))
        end
        return rp.rope_theta or 10000
    end
    return cfg.rope_theta or 10000
end

-- Builds the modules of decoder layer i over the parameter store, split as the parallel
-- context par says (lunar.parallel.context).
local function build_layer(store, cfg, i, opts, par)
    local p = ('model.layers.%d'):format(i)
    local L = {index = i, name = p}
    L.input_norm = nn.RMSNorm.new(store, p .. '.input_layernorm', cfg.rms_norm_eps)
    L.post_norm = nn.RMSNorm.new(store, p .. '.post_attention_layernorm', cfg.rms_norm_eps)
    if cfg.model_type == 'glm_moe_dsa' then
        -- MTP layers (i >= num_hidden_layers) run their own indexer
        local kind = (i >= cfg.num_hidden_layers or params.has_indexer(cfg, i)) and 'full' or 'shared'
        L.attn = nn.MLA.new(store, p .. '.self_attn', cfg, {indexer = kind, par = par,
            indexer_loss_coeff = opts.indexer_loss_coeff or 0, indexer_loss = opts.indexer_loss})
    else
        L.attn = nn.GQA.new(store, p .. '.self_attn', cfg, {par = par})
    end
    L.mlp_type = i < cfg.num_hidden_layers and params.mlp_type(cfg, i) or 'sparse'
    if L.mlp_type == 'dense' then
        local io = par:block('mlp')
        L.mlp = nn.MLP.new(store, p .. '.mlp', cfg.hidden_act, {input = io.input, output = io.output})
    else
        L.mlp = nn.MoE.new(store, p .. '.mlp', cfg, {par = par})
    end
    return L
end

local function build(cfg, store, opts)
    local m = setmetatable({cfg = cfg, params = store, opts = opts, hooks = {}, layer_backward_hooks = {}}, Model)
    -- fp32_residual (Megatron's --fp32-residual-connection): with low-precision parameters the
    -- residual stream between the layers stays f32; each sub-block reads it cast to the
    -- parameters' dtype and its output is added back in f32, so small updates to a large
    -- residual are not rounded away
    m.dtype = store:get('model.embed_tokens.weight'):dtype()
    m.fp32_residual = (opts.fp32_residual and m.dtype ~= 'f32') and true or false
    -- how the model is split over ranks (tensor, sequence, expert parallel): the mappings and
    -- strategies its modules compose. The vocabulary splits over tp when tp divides it
    -- (lunar.parallel.vocab): the embedding's and the LM head's rows, the logits' columns, a
    -- cross-entropy without whole logits
    local par = context.new(cfg, opts)
    m.par = par
    m.vocab = par.vocab_split   -- (nil when whole)
    m.sp = par.sp_group   -- (sequence parallel: each tp rank holds its share of the rows between the blocks)
    m.embed = nn.Embedding.new(store, 'model.embed_tokens', cfg.pad_token_id, {vocab = par.vocab})
    m.layers = {}
    for i = 0, cfg.num_hidden_layers - 1 do m.layers[i + 1] = build_layer(store, cfg, i, opts, par) end
    m.norm = nn.RMSNorm.new(store, 'model.norm', cfg.rms_norm_eps)
    m.lm_head = nn.Linear.new(store, cfg.tie_word_embeddings and 'model.embed_tokens' or 'lm_head')
    m.mtp = {}
    for d = 0, params.mtp_layers(cfg, opts) - 1 do
        local i = cfg.num_hidden_layers + d
        local p = ('model.layers.%d'):format(i)
        m.mtp[d + 1] = {
            layer = build_layer(store, cfg, i, opts, par),
            enorm = nn.RMSNorm.new(store, p .. '.enorm', cfg.rms_norm_eps),
            hnorm = nn.RMSNorm.new(store, p .. '.hnorm', cfg.rms_norm_eps),
            eh_proj = nn.Linear.new(store, p .. '.eh_proj'),
            head_norm = nn.RMSNorm.new(store, p .. '.shared_head.norm', cfg.rms_norm_eps),
        }
    end
    if cfg.model_type == 'glm_moe_dsa' then
        m.rot_dim = cfg.qk_rope_head_dim
    else
        m.rot_dim = m.layers[1].attn.rot_dim
    end
    -- on the parameters' device, like every tensor the model makes (prepare moves it if the
    -- parameters move later)
    m.inv_freq = ops.rope_inv_freq(m.rot_dim, rope_theta(cfg), {device = m:device()})
    -- the whole model as one stage (Model:forward and backward run it)
    m.whole = m:stage{embed = true, first = 1, last = #m.layers, head = true}
    return m
end

-- A model with freshly initialised weights (HF's _init_weights: normal(0, initializer_range) for
-- linear and embedding weights, the padding row zeroed, ones for norms, zeros for biases and the
-- router's correction bias). opts: seed, dtype (default f32), device, indexer_loss_coeff,
-- fp32_residual (keep the residual stream in f32 when dtype is bf16/f16; see build()), mtp
-- (false: no MTP layer even when the config declares num_nextn_predict_layers), ep (a lunar.dist
-- group: expert parallel, this rank holds and runs its range of the routed experts; see
-- lunar.nn.MoE), tp (a lunar.dist group: tensor parallel), etp (a lunar.dist group: expert tensor
-- parallel, each routed expert's matrices split over it).
function M.new(cfg, opts)
    opts = opts or {}
    local rng = core.rng_new(opts.seed or 0):split('init')
    local store = nn.params.new()
    local std = cfg.initializer_range or 0.02
    local indexer_trainable = (opts.indexer_loss_coeff or 0) > 0
    for _, s in ipairs(params.spec(cfg, M.spec_opts(cfg, opts))) do
        -- a tensor-parallel block is drawn as the whole tensor and cut, so every layout starts
        -- from the one-rank weights
        local t = core.empty(s.full_shape or s.shape, s.dtype or opts.dtype or 'f32', opts.device)
        if s.init == 'normal' then rng:split(s.name):normal_(t, 0, std)
        elseif s.init == 'ones' then t:fill_(1)
        else t:fill_(0) end
        if s.name == 'model.embed_tokens.weight' and type(cfg.pad_token_id) == 'number' then
            t:select(1, cfg.pad_token_id + 1):fill_(0)   -- before the cut: the id is a whole-vocabulary row
        end
        if s.slice then t = t:narrow(s.slice.dim, s.slice.start + 1, s.slice.len):contiguous() end
        local trainable = s.trainable
        if s.name:find('.indexer.', 1, true) then trainable = indexer_trainable end
        store:add(s.name, t, trainable)
    end
    return build(cfg, store, opts)
end

-- the lunar.model.params.spec options of a model built with opts (mtp, the experts this rank
-- holds, its tp and etp blocks: lunar.parallel.context, which also refuses what a layout cannot
-- do with cfg). opts.tp, opts.ep, opts.etp: lunar.dist groups. Tensor parallel splits the
-- attention heads (MLA, GQA) and the dense and shared-expert MLPs; with opts.ep as well, each tp
-- rank sends its share of the tokens to the experts (lunar.nn.MoE); expert tensor parallel
-- splits each routed expert's gate/up by rows and down by columns.
function M.spec_opts(cfg, opts)
    return context.new(cfg, opts):spec_opts(opts.mtp)
end

-- A model over an existing parameter store (the loader fills it).
function M.from_params(cfg, store, opts)
    return build(cfg, store, opts or {})
end

-- ---- hooks: look at any module's input or output from the REPL ----------------------------

-- m:capture(pattern, fn): fn(name, 'input'|'output', tensor) for every module whose name matches
-- the Lua pattern (e.g. 'model.layers.3.mlp', 'self_attn$'); returns a function that removes it.
function Model:capture(pattern, fn)
    local h = {pattern = pattern, fn = fn}
    self.hooks[#self.hooks + 1] = h
    return function()
        for i, x in ipairs(self.hooks) do if x == h then table.remove(self.hooks, i) break end end
    end
end

-- m:record(pattern) -> table name -> {input=, output=} filled by the next forward passes
function Model:record(pattern)
    local rec = {}
    self:capture(pattern, function(name, kind, t)
        rec[name] = rec[name] or {}
        rec[name][kind] = t
    end)
    return rec
end

function Model:_emit(name, kind, t)
    for _, h in ipairs(self.hooks) do
        if name:find(h.pattern) then h.fn(name, kind, t) end
    end
end

-- ---- batch preparation ------------------------------------------------------------------------

-- the device of the parameters, where forward runs and every activation lives
function Model:device() return self.params:get('model.embed_tokens.weight'):device() end

local function default_positions(B, T, device)
    local pos = core.empty({B, T}, 'i64', device)
    for b = 1, B do pos:select(1, b):arange_(0, 1) end
    return pos
end

local function on(t, dev)
    if t ~= nil and tensor.is_tensor(t) and t:device() ~= dev then return t:to(dev) end
    return t
end

-- prepare(batch) -> the per-step table every layer reads. The batch's tensors move to the
-- model's device (a data loader makes them on the host: one deliberate host->device copy per
-- tensor and step). cu_seqlens is metadata read on the host (positions, masks, targets): it may
-- stay there, and a device copy is read back once here (b.cu_seqlens is the host copy).
function Model:prepare(batch)
    local ids = batch.input_ids
    if not tensor.is_tensor(ids) or ids:dim() ~= 2 then fail('forward: batch.input_ids must be a (B, T) tensor') end
    local B, T = ids:size(1), ids:size(2)
    local dev = self:device()
    ids = on(ids, dev)
    local cu = batch.cu_seqlens
    if tensor.is_tensor(cu) then
        cu = on(cu, 'cpu')
    elseif type(cu) == 'table' then
        local rows = {}
        for i, c in ipairs(cu) do rows[i] = on(c, 'cpu') end
        cu = rows
    end
    local positions = on(batch.position_ids, dev)
    if not positions then
        positions = cu and nn.masks.packed_positions(cu, {device = dev}):view(B, T) or default_positions(B, T, dev)
    end
    local am = on(batch.attention_mask, dev)
    local routing
    if batch.routing then
        routing = {}
        for layer, idx in pairs(batch.routing) do routing[layer] = on(idx, dev) end
    end
    if self.inv_freq:device() ~= dev then self.inv_freq = self.inv_freq:to(dev) end
    -- the longest packed document: a DSA layer whose documents all fit in index_topk selects
    -- every visible key, whatever the row's length
    local longest_doc
    if cu then
        longest_doc = 0
        for _, row in ipairs(tensor.is_tensor(cu) and {cu} or cu) do
            local c = row:tolist_flat()
            for d = 2, #c do longest_doc = math.max(longest_doc, c[d] - c[d - 1]) end
        end
    end
    local mask = batch.block_mask
    if mask ~= nil then
        if not tensor.is_tensor(mask) or mask:dim() ~= 3 or mask:size(1) ~= B or mask:size(2) ~= T or mask:size(3) ~= T then
            fail(('forward: batch.block_mask must be the (%d, %d, %d) mask nn.masks.build makes for this batch'):format(B, T, T))
        end
        mask = on(mask, dev)
    else
        mask = nn.masks.build{B = B, T = T, attention_mask = am, cu_seqlens = cu, device = dev}
    end
    local key_lists = batch.key_lists
    if key_lists ~= nil then
        if not tensor.is_tensor(key_lists) or key_lists:dim() ~= 3 or key_lists:size(1) ~= B or key_lists:size(2) ~= T
            or type(batch.max_visible) ~= 'number' then
            fail(('forward: batch.key_lists must be a (%d, %d, K) i64 tensor, with batch.max_visible'):format(B, T))
        end
        key_lists = on(key_lists, dev)
    end
    return {
        key_lists = key_lists, max_visible = batch.max_visible, key_lists_exact = key_lists ~= nil and batch.key_lists_exact == true,
        B = B, T = T, N = B * T, ids = ids:contiguous():view(B * T):to('i64'), input_ids = ids,
        labels = on(batch.labels, dev), routing = routing,
        positions = positions:to('i64'), attention_mask = am, cu_seqlens = cu,
        mask = mask, longest_doc = longest_doc,
        inv_freq = self.inv_freq, rope_scale = 1,
    }
end

-- HF ForCausalLMLoss targets: target[b, s] = labels[b, s+1], the last position of each row
-- ignored (and, for packed rows, the last position of each document).
function Model:targets(batch, b, shift)
    shift = shift or 1
    local labels = b.labels or batch.labels
    if not labels then return nil end
    local B, T = b.B, b.T
    local tg = core.empty({B, T}, 'i64', labels:device()):fill_(-100)
    if T > shift then
        tg:narrow(2, 1, T - shift):copy_(labels:narrow(2, 1 + shift, T - shift))
    end
    if b.cu_seqlens then
        -- one tensor (B = 1) or a list of B tensors, one per row (as masks.build takes them), on
        -- the host (prepare); the last `shift` targets of each document are filled on the device
        -- (a fill per document, no host round trip)
        local rows = tensor.is_tensor(b.cu_seqlens) and {b.cu_seqlens} or b.cu_seqlens
        for r, row_cu in ipairs(rows) do
            local cu = row_cu:to('cpu'):tolist_flat()
            local row = tg:select(1, r)
            for d = 2, #cu do
                local first = math.max(cu[d] - shift, cu[d - 1])   -- 0-based; targets past the doc end
                if cu[d] > first then row:narrow(1, first + 1, cu[d] - first):fill_(-100) end
            end
        end
    end
    return tg:view(B * T)
end

-- ---- entropy of the token distributions -------------------------------------------------------

-- Elements per chunk of the entropy's (rows, V) temporaries: about 4M (16 MiB in f32), so the
-- extra memory stays small next to the (N, V) logits whatever N is (a field, so tests can make
-- chunks of a few rows).
M.entropy_chunk_elems = 4194304

local function entropy_chunks(N, V, fn)
    local rows = math.max(1, math.floor(M.entropy_chunk_elems / math.max(V, 1)))
    for first = 1, N, rows do fn(first, math.min(rows, N - first + 1)) end
end

-- entropy(z, lse) -> H (N) f32: H = -sum_v p log p of softmax(z) per row, with log p = z - lse
-- (lse from ops.cross_entropy on the same z (N, V)): ops.entropy, one pass, no (N, V) temporary.
function M.entropy(z, lse)
    return ops.entropy(z, lse:float())
end

-- entropy_backward_(dz, z, lse, H, dH): dz (N, V) += dH * dH/dz, where dH/dz_v = -p_v (log p_v
-- + H) for each row (the softmax backward of -(log p + 1)); dH (N).
function M.entropy_backward_(dz, z, lse, H, dH)
    local N, V = z:size(1), z:size(2)
    entropy_chunks(N, V, function(first, n)
        local logp = ops.sub(z:narrow(1, first, n), lse:narrow(1, first, n):float():view(n, 1))   -- (n, V) f32
        local p = ops.exp(logp)
        ops.add_(logp, H:narrow(1, first, n):view(n, 1))            -- log p + H
        ops.mul_(logp, p)
        ops.mul_(logp, ops.neg(dH:narrow(1, first, n)):view(n, 1))
        ops.add_(dz:narrow(1, first, n), logp)
        logp:free()
        p:free()
    end)
    return dz
end

-- ---- forward / backward -----------------------------------------------------------------------

-- the f32 residual stream's view of a sub-block: its input in the compute dtype, its output in f32
local function to_compute(self, x) return self.fp32_residual and x:to(self.dtype) or x end
local function to_residual(self, y) return self.fp32_residual and y:float() or y end

-- A decoder layer: x + attn(input_norm(x)), then h + mlp(post_norm(h)). The parallel context's
-- layer mappings sit around each block (sequence parallel: every rank's rows gathered before it,
-- its partial sums reduce-scattered after; the identity otherwise).
local function layer_forward(self, L, x, b, prev_topk, replay)
    local par = self.par
    local xn, s_in = L.input_norm:forward(to_compute(self, x))
    xn = par.layer_in:forward(xn)
    self:_emit(L.name .. '.self_attn', 'input', xn)
    local a, s_attn, topk = L.attn:forward(xn, b, prev_topk)
    a = par.layer_out:forward(a)
    self:_emit(L.name .. '.self_attn', 'output', a)
    local h = ops.add(x, to_residual(self, a))
    local hn, s_post = L.post_norm:forward(to_compute(self, h))
    hn = par.layer_in:forward(hn)
    self:_emit(L.name .. '.mlp', 'input', hn)
    local m, s_mlp, routing
    if L.mlp_type == 'dense' then
        m, s_mlp = L.mlp:forward(hn)
    else
        m, s_mlp, routing = L.mlp:forward(hn, {replay_idx = replay})
    end
    m = par.layer_out:forward(m)
    self:_emit(L.name .. '.mlp', 'output', m)
    local out = ops.add(h, to_residual(self, m))   -- h is saved by post_norm: no in-place add
    self:_emit(L.name, 'output', out)
    return out, {s_in = s_in, s_attn = s_attn, s_post = s_post, s_mlp = s_mlp}, topk, routing
end

-- gradient of the layer output -> gradient of its input (in the residual stream's dtype; the
-- casts of the forward pass are casts of the gradient here)
local function layer_backward(self, L, dout, s)
    local par = self.par
    local dm = par.layer_out:backward(to_compute(self, dout))
    local dh = par.layer_in:backward(L.mlp:backward(dm, s.s_mlp))
    dh = to_residual(self, L.post_norm:backward(dh, s.s_post))
    dh = ops.add_(dh, dout)
    local da = par.layer_out:backward(to_compute(self, dh))
    local dx, ixloss = L.attn:backward(da, s.s_attn)
    dx = par.layer_in:backward(dx)
    dx = to_residual(self, L.input_norm:backward(dx, s.s_in))
    return ops.add_(dx, dh), ixloss
end

-- opts.head_positions as an i64 vector on `device`, or nil: each a flat position in [0, N)
local function head_positions(at, N, device)
    if at == nil then return nil end
    if not tensor.is_tensor(at) or at:dim() ~= 1 or at:dtype() ~= 'i64' then
        fail('forward: opts.head_positions must be an i64 vector of flat positions, got '
            .. (tensor.is_tensor(at) and ('a ' .. at:dtype() .. ' tensor of ' .. at:dim() .. ' dims') or ('a ' .. type(at))))
    end
    if at:numel() == 0 then fail('forward: opts.head_positions is empty') end
    for _, p in ipairs(at:to('cpu'):tolist_flat()) do
        if p < 0 or p >= N then
            fail(('forward: opts.head_positions holds %d, outside the batch\'s %d positions'):format(p, N))
        end
    end
    return on(at, device)
end

-- forward(batch, opts) -> out
--   opts.loss: compute the HF loss (needs batch.labels); opts.logprobs: per-token log-probs of
--   the targets (B, T) (0 where ignored); opts.temperature (default 1): the logits are divided
--   by it in place before the log-softmax (RL trainers recompute log-probs at the rollout's
--   temperature), so out.logits, the loss and the log-probs are those of the scaled logits;
--   opts.entropy: out.entropy (B, T) f32, the entropy of each position's (scaled) token
--   distribution, at every position; opts.mtp: also the MTP loss (out.mtp_loss);
--   opts.head_positions: an i64 vector of P flat positions (b * T + t, 0-based): the head runs on
--   those rows only, and out.logits (P, V), out.logprobs (P), out.entropy (P) and the loss are
--   theirs (backward's dlogprobs and dentropy are then (P) too); opts.head_targets (P) i64: the
--   target of each of those rows instead of batch.labels' (a position may repeat with other
--   targets: a shared prompt's last token predicts each sample's first);
--   opts.num_items_in_batch: loss = sum / this (HF's convention for gradient accumulation)
--   instead of the mean over valid targets; opts.keep (default true when loss): keep what
--   backward() needs.
-- out = {logits = (B, T, V), loss =, logprobs =, entropy =, routing = {[layer] = {idx=, weights=}},
--        topk = {[layer] = (B, T, k)}, hidden = (N, H) final hidden state before the norm}
function Model:forward(batch, opts)
    opts = opts or {}
    local out, saved = self.whole:forward(self:prepare(batch), nil, opts)
    if opts.keep ~= false then self.saved = saved else self.saved, saved = nil, nil end
    return out, saved
end

-- ---- stages ---------------------------------------------------------------------------------------
--
-- A stage is the part of the model one pipeline rank runs, a forward that returns what its
-- backward needs to the caller (so that several micro-batches can be in flight) and a backward
-- that takes it back:
--   local st = model:stage{embed = true, first = 1, last = L, head = true}   -- model.whole
--   local output, saved = st:forward(b, input, opts)      b = model:prepare(batch); input: nil on
--                                                         the stage with the embedding, else the
--                                                         hidden rows the stage before gave
--   local dinput, indexer_loss = st:backward(doutput, saved, opts)   doutput: nil on the stage
--                                                         with the head (it starts from the loss)
-- first..last are decoder layers (1-based in model.layers; last < first: none). The head (the
-- final norm, the LM head, the losses and the MTP layer) gives forward's out table (as
-- Model:forward's); a stage without it gives the hidden rows (N, H), its saved.routing and
-- saved.topk the routes and selections of its layers. A shared (IndexShare) layer reuses the
-- selection of the full layer before it in the same stage.
local Stage = {}
Stage.__index = Stage
M.Stage = Stage

function Model:stage(spec)
    local first, last = spec.first or 1, spec.last or #self.layers
    if first < 1 or last > #self.layers then
        fail(('stage: layers %d..%d outside the model\'s %d decoder layers'):format(first, last, #self.layers))
    end
    return setmetatable({model = self, embed = spec.embed and true or false, head = spec.head and true or false,
                         first = first, last = last}, Stage)
end

function Stage:forward(b, x, opts)
    opts = opts or {}
    local m = self.model
    local saved = {layers = {}, N = b.N, routing = {}, topk = {}}
    if self.embed then x, saved.emb = m:_embed_forward(b, opts) end
    x = m:_layers_forward(x, b, self.first, self.last, saved)
    if not self.head then return x, saved end
    local out = m:_head_forward(x, b, opts, saved)
    return out, saved
end

function Stage:backward(dy, saved, opts)
    opts = opts or {}
    local m = self.model
    local dx = self.head and m:_head_backward(saved, opts) or dy
    local ixloss
    dx, ixloss = m:_layers_backward(dx, saved, self.first, self.last)
    if not self.embed then return dx, ixloss end
    m:_embed_backward(dx, saved)
    return nil, ixloss
end

-- the embedding of the batch's tokens into the residual stream (sequence parallel: this rank's rows)
function Model:_embed_forward(b, opts)
    local x, s_emb = self.embed:forward(b.ids)
    self:_emit('model.embed_tokens', 'output', x)
    self.par:check_forward(opts)
    return to_residual(self, self.par.embed_out:forward(x, b)), s_emb
end

function Model:_embed_backward(dx, saved)
    dx = self.par.embed_out:backward(dx)   -- the embedding's rows are whole
    self.embed:backward(to_compute(self, dx), saved.emb)
end

-- decoder layers first..last on x; their saved state, routes and selections into saved
function Model:_layers_forward(x, b, first, last, saved)
    local prev_topk
    for i = first, last do
        local L = self.layers[i]
        local replay = b.routing and b.routing[i - 1]
        local s, topk, r
        x, s, topk, r = layer_forward(self, L, x, b, prev_topk, replay)
        saved.layers[i] = s
        if topk then prev_topk = topk; saved.topk[i - 1] = topk end
        if r then saved.routing[i - 1] = r end
    end
    return x
end

function Model:_layers_backward(dx, saved, first, last)
    local ixloss = 0
    for i = last, first, -1 do
        local l
        dx, l = layer_backward(self, self.layers[i], dx, saved.layers[i])
        ixloss = ixloss + (l or 0)
        for _, fn in ipairs(self.layer_backward_hooks) do fn(i) end
    end
    return dx, ixloss
end

-- on_layer_backward(fn): fn(i) when the backward of decoder layer i (1-based in model.layers) is
-- done: its parameters' gradients are complete for this backward (a gradient buffer starts
-- reducing them; lunar.optim.grad_buffer)
function Model:on_layer_backward(fn)
    self.layer_backward_hooks[#self.layer_backward_hooks + 1] = fn
end

-- the final norm, the LM head at the rows asked for, the losses and log-probabilities, the
-- entropy, the MTP loss -> out (Model:forward's); what the backward needs into saved
function Model:_head_forward(x, b, opts, saved)
    local xf, s_norm = self.norm:forward(to_compute(self, x))
    xf = self.par.head_in:forward(xf)   -- the head reads every row
    self:_emit('model.norm', 'output', xf)
    -- the head only where its outputs are read (RL: the positions that predict a response token)
    local at = head_positions(opts.head_positions, b.N, xf:device())
    if at and opts.mtp then fail('forward: opts.head_positions and opts.mtp cannot be combined') end
    local logits, s_head = self.lm_head:forward(at and ops.index_select(xf, 1, at) or xf)
    self:_emit('lm_head', 'output', logits)
    saved.norm, saved.head = s_norm, s_head
    local temperature = opts.temperature or 1
    if type(temperature) ~= 'number' or not (temperature > 0) or temperature == math.huge then
        fail(('forward: opts.temperature must be a number > 0, got %s'):format(tostring(opts.temperature)))
    end
    -- in place: no second (N, V) tensor; at 1 the logits are untouched (the SFT path's bits)
    if temperature ~= 1 then ops.div_(logits, temperature) end
    local shape = at and {at:numel()} or {b.B, b.T}
    local out = {logits = at and logits or logits:view(b.B, b.T, logits:size(2)), routing = saved.routing, topk = saved.topk,
                 hidden = x}
    saved.head_positions = at
    local want_loss = opts.loss or opts.logprobs
    if want_loss then
        local tg = opts.head_targets
        if tg ~= nil then
            if not at or not tensor.is_tensor(tg) or tg:numel() ~= at:numel() then
                fail('forward: opts.head_targets must be an i64 vector, one target per opts.head_positions entry')
            end
            tg = on(tg, logits:device())
        else
            tg = self:targets(b, b)
            if not tg then fail('forward: the loss and log-probs need batch.labels') end
        end
        if at and not opts.head_targets then
            -- (index_select takes float sources: the P targets are picked on the host)
            local all, pick = tg:to('cpu'):tolist_flat(), {}
            for i, p in ipairs(at:to('cpu'):tolist_flat()) do pick[i] = all[p + 1] end
            tg = core.from_flat(pick, {#pick}, 'i64', tg:device())
        end
        local loss, lp, lse, vctx = self:_cross_entropy(logits, tg)
        -- the loss value is read back once per forward (a deliberate sync), the count of valid
        -- targets only when the caller does not give num_items_in_batch
        local denom = opts.num_items_in_batch or math.max(ops.sum(ops.ne(tg, -100):float()):item(), 1)
        out.loss = ops.sum(loss):item() / denom
        out.logprobs = lp:view(shape)
        saved.ce = {logits = logits, lse = lse, targets = tg, denom = denom, temperature = temperature, vp = vctx}
    end
    if opts.entropy then
        local lse = saved.ce and saved.ce.lse
        if not lse then
            -- no labels asked for: the log-sum-exp of each row through any valid target (the
            -- whole row's with the vocabulary split: every target ignored)
            local n = logits:size(1)
            local _, _, l = self:_cross_entropy(logits, core.empty({n}, 'i64', logits:device()):fill_(self.par.vocab.no_target))
            lse = l
            saved.ce = {logits = logits, lse = lse, temperature = temperature}
        end
        -- with the vocabulary split each member's columns give their terms of -sum p log p (p
        -- through the whole row's lse), summed over tp; the backward is then local
        local H = self.par.vocab:sum_columns(M.entropy(logits, lse))
        out.entropy = H:view(shape)
        saved.entropy = H
    end
    if opts.mtp and #self.mtp > 0 then
        out.mtp_loss = self:_mtp_forward(b, xf, saved)
    end
    -- the forward's check point (lunar.sync_check): reading the loss synchronised the device
    -- anyway, so one more small read makes a bad token id or routing index fail the forward
    -- that met it
    if want_loss then core.sync_check(self:device()) end
    return out
end

-- MTP (DeepSeek-V3 style, depth 1): for position s, h' = eh_proj([enorm(embed(t_{s+1})),
-- hnorm(h_s)]) runs through the MTP decoder layer; shared_head.norm then lm_head predict
-- t_{s+2}. h_s is the main model's last hidden state after its final norm (as vLLM and SGLang
-- feed it), not detached. The last position has no next token (id 0 is fed) and no target; the
-- attention is causal, so it changes nothing at the other positions.
function Model:_mtp_forward(b, hidden, saved)
    local d = self.mtp[1]
    local B, T, H = b.B, b.T, self.cfg.hidden_size
    local ids = b.input_ids
    local next_ids = core.empty({B, T}, 'i64', ids:device()):fill_(0)
    if T > 1 then next_ids:narrow(2, 1, T - 1):copy_(ids:narrow(2, 2, T - 1)) end
    local e, s_e = self.embed:forward(next_ids:view(B * T))
    local en, s_en = d.enorm:forward(e)
    local hn, s_hn = d.hnorm:forward(hidden)
    local cat = core.empty({B * T, 2 * H}, en:dtype(), en:device())
    cat:narrow(2, 1, H):copy_(en)
    cat:narrow(2, H + 1, H):copy_(hn)
    local z, s_eh = d.eh_proj:forward(cat)
    local zl, s_layer = layer_forward(self, d.layer, to_residual(self, z), b, nil, nil)
    local zn, s_head_norm = d.head_norm:forward(to_compute(self, zl))
    local logits, s_head = self.lm_head:forward(zn)
    local tg = self:targets(b, b, 2)
    local loss, _, lse, vctx = self:_cross_entropy(logits, tg)
    local valid = ops.sum(ops.ne(tg, -100):float()):item()
    local denom = math.max(valid, 1)
    saved.mtp = {s_e = s_e, s_en = s_en, s_hn = s_hn, s_eh = s_eh, s_layer = s_layer, s_head_norm = s_head_norm,
                 s_head = s_head, ce = {logits = logits, lse = lse, targets = tg, denom = denom, vp = vctx}, H = H}
    return ops.sum(loss):item() / denom
end

-- the cross-entropy of the head's logits: lunar.ops.cross_entropy, or with the vocabulary split
-- over tp its vocab-parallel form (the logits are this rank's columns); returns loss, logprobs,
-- lse and the vocab-parallel context (nil when whole)
function Model:_cross_entropy(logits, targets)
    return self.par.vocab:cross_entropy(logits, targets)
end

local function ce_grad(self, dloss, ce)
    return self.par.vocab:cross_entropy_backward(dloss, ce.logits, ce.lse, ce.targets, ce.vp)
end

local function ce_backward(self, ce, scale)
    local n = ce.targets:numel()
    local dloss = core.empty({n}, 'f32', ce.logits:device()):fill_(scale / ce.denom)
    return ce_grad(self, dloss, ce)
end

-- the LM head's backward; through the head's input mapping (the vocabulary split: each rank's
-- input gradient is its columns' share, summed over tp; sequence parallel: this rank's rows)
local function head_backward(self, dlogits, saved_head)
    return self.par.head_in:backward(self.lm_head:backward(dlogits, saved_head))
end

-- (B, T) or (B*T) gradient of a per-position output as an f32 (N) vector
local function per_position(name, g, N)
    if not tensor.is_tensor(g) or g:numel() ~= N then
        fail(('backward: %s must be a (B, T) tensor (or (P) with head_positions) of %d elements, got %s'):format(name, N,
            tensor.is_tensor(g) and ('(' .. table.concat(g:size(), ', ') .. ')') or ('a ' .. type(g))))
    end
    return g:contiguous():view(N):float()
end

-- d(sum dlogprobs * logprobs + dentropy * entropy) / d(logits): the log-probs' part through the
-- cross-entropy backward (d logp / dz = onehot - p, so dloss = -dlogprobs; ignored targets get
-- 0), the entropy's part added chunk by chunk, then the temperature's 1/T
local function rl_dlogits(self, saved, opts)
    local ce = saved.ce
    local N = ce.logits:size(1)
    local dz
    if opts.dlogprobs ~= nil then
        if not ce.targets then fail('backward: dlogprobs needs forward(batch, {logprobs = true}) first') end
        local dlp = per_position('dlogprobs', opts.dlogprobs, N)
        dz = ce_grad(self, ops.neg(dlp), ce)
    else
        dz = core.empty(ce.logits:size(), ce.logits:dtype(), ce.logits:device()):fill_(0)
    end
    if opts.dentropy ~= nil then
        if not saved.entropy then fail('backward: dentropy needs forward(batch, {entropy = true}) first') end
        M.entropy_backward_(dz, ce.logits, ce.lse, saved.entropy, per_position('dentropy', opts.dentropy, N))
    end
    return dz
end

-- backward({loss_scale = 1, mtp_scale = 0}): accumulates d(loss_scale * loss + mtp_scale *
-- mtp_loss) into the parameter gradients. backward({dlogprobs = (B, T), dentropy = (B, T)}) (RL;
-- either may be nil, mtp_scale allowed) accumulates d(sum dlogprobs * logprobs + dentropy *
-- entropy) instead, for the log-probs and entropy of the last forward (at its temperature).
-- Returns the sum of the indexer losses (0 when off).
function Model:backward(opts, saved)
    saved = saved or self.saved
    local _, ixloss = self.whole:backward(nil, saved, opts)
    if saved == self.saved then self.saved = nil end
    return ixloss
end

-- the head's backward (from the loss, or RL's gradients of the log-probs and entropy) -> the
-- gradient of the last decoder layer's output
function Model:_head_backward(saved, opts)
    local rl = opts.dlogprobs ~= nil or opts.dentropy ~= nil
    if not saved or not saved.ce then
        fail(rl and 'backward: call forward(batch, {logprobs = true, entropy = ...}) first'
            or 'backward: call forward(batch, {loss = true}) first')
    end
    local dlogits
    if rl then
        if opts.loss_scale ~= nil then
            fail('backward: give either loss_scale (the loss) or dlogprobs / dentropy (RL), not both')
        end
        dlogits = rl_dlogits(self, saved, opts)
    else
        if not saved.ce.targets then fail('backward: call forward(batch, {loss = true}) first') end
        dlogits = ce_backward(self, saved.ce, opts.loss_scale or 1)
    end
    if saved.ce.temperature ~= 1 then ops.div_(dlogits, saved.ce.temperature) end
    local dx = head_backward(self, dlogits, saved.head)       -- gradient of the final norm's output
    if saved.head_positions then
        -- rows the head did not read get no gradient
        local full = core.empty({saved.N, dx:size(2)}, dx:dtype(), dx:device()):fill_(0)
        dx = ops.index_add_(full, 1, saved.head_positions, dx)
    end
    if saved.mtp and (opts.mtp_scale or 0) ~= 0 then
        local s = saved.mtp
        local d = self.mtp[1]
        local dl = ce_backward(self, s.ce, opts.mtp_scale)
        local dz = head_backward(self, dl, s.s_head)
        dz = to_residual(self, d.head_norm:backward(dz, s.s_head_norm))
        dz = layer_backward(self, d.layer, dz, s.s_layer)
        local dcat = d.eh_proj:backward(to_compute(self, dz), s.s_eh)
        local H = s.H
        local de = d.enorm:backward(dcat:narrow(2, 1, H):contiguous(), s.s_en)
        self.embed:backward(de, s.s_e)
        ops.add_(dx, d.hnorm:backward(dcat:narrow(2, H + 1, H):contiguous(), s.s_hn))
    end
    return to_residual(self, self.norm:backward(dx, saved.norm))
end

function Model:zero_grad() self.params:zero_grad() end

-- ---- MoE load -----------------------------------------------------------------------------------

-- moe_load_reset(): every MoE decoder layer (not the MTP layer) counts from now the (token,
-- expert) routes of the rows this rank routes, per expert; moe_load() -> {{layer =, counts =
-- {E numbers}}, ...} in layer order (nil before the first reset). Under tp x ep each tp rank
-- routes its share of the tokens (moe_load_group says over which groups the counts add up).
function Model:moe_load_reset()
    for _, L in ipairs(self.layers) do
        if L.mlp.rc then
            local z = {}
            for e = 1, L.mlp.rc.E do z[e] = 0 end
            L.mlp.load = z
        end
    end
end

function Model:moe_load()
    local out
    for i, L in ipairs(self.layers) do
        if L.mlp.load then
            out = out or {}
            out[#out + 1] = {layer = i - 1, counts = L.mlp.load}
        end
    end
    return out
end

-- true when the tp ranks route different tokens (tp x ep), so the load adds up over tp as well
-- as over dp; otherwise every tp rank counts the same routes
function Model:moe_load_over_tp()
    for _, L in ipairs(self.layers) do if L.mlp.tokens and L.mlp.tokens.shares_rows then return true end end
    return false
end

-- Tensor parallel: the parameters whose gradient each tp rank holds only a part of though the
-- parameter is whole on every rank (GQA's per-head q_norm / k_norm, applied to this rank's heads;
-- MLA's low-rank q_a / kv_a projections and their norms, which feed this rank's heads; under tp x
-- ep the MoE router, which each tp rank runs on its share of the tokens).
-- reduce_tp_grads() all-reduces them over tp: once a step, after the last backward.
function Model:tp_partial_grads()
    local names = {}
    for _, n in ipairs(self:tp_partial_params()) do
        if self.params:is_trainable(n) then names[#names + 1] = n end
    end
    -- LoRA: the adapters' tensors whose gradient is this rank's share (lunar.nn.lora.tp_partial)
    local set = self.params.lora
    if set then
        for _, n in ipairs(lora.tp_partial(set)) do names[#names + 1] = n end
    end
    return names
end

-- the parameters whose gradient is tp-partial (above), trainable or not
function Model:tp_partial_params()
    local names = {}
    local layers = {}
    for _, L in ipairs(self.layers) do layers[#layers + 1] = L end
    for _, m in ipairs(self.mtp) do layers[#layers + 1] = m.layer end
    for _, L in ipairs(layers) do
        local list = L.attn:tp_partial()
        -- tp x ep: each tp member routes its share of the tokens
        for _, n in ipairs(L.mlp.tp_partial and L.mlp:tp_partial() or {}) do list[#list + 1] = n end
        -- sequence parallel: the norms between the blocks see this rank's rows
        for _, n in ipairs(self.par:norms_partial({L.name .. '.input_layernorm.weight',
                                                    L.name .. '.post_attention_layernorm.weight'})) do
            list[#list + 1] = n
        end
        for _, n in ipairs(list) do
            if self.params:has(n) then names[#names + 1] = n end
        end
    end
    for _, n in ipairs(self.par:norms_partial({'model.norm.weight'})) do names[#names + 1] = n end
    return names
end

-- tensor parallel: {name = {dim =, start =, len =}} of the parameters split over tp (this rank's
-- block of each), empty without tp; axis 'etp': the routed experts' blocks over etp
function Model:tp_slices(axis)
    axis = axis or 'tp'
    local out = {}
    for _, s in ipairs(require('lunar.model.spec').of(self.cfg, M.spec_opts(self.cfg, self.opts))) do
        if s.slice and s.slice.group == axis and self.params:has(s.name) then out[s.name] = s.slice end
    end
    return out
end

function Model:reduce_tp_grads()
    local set = self.params.lora
    for _, n in ipairs(self:tp_partial_grads()) do
        local g = self.params.grads[n] or (set and set.params.grads[n])
        if g then self.par:sum_partial(g) end
    end
end

-- name -> tensor of every parameter (checkpoint names)
function Model:parameters() return self.params.tensors end

-- name -> gradient tensor of every trainable parameter that received one
function Model:gradients() return self.params.grads end

return M
