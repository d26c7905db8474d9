-- lunar.model: GLM-5 (GlmMoeDsaForCausalLM), GLM-4.x MoE (Glm4MoeForCausalLM) and GLM-5.3-Flash
-- (Glm5NextForConditionalGeneration's text tower, lunar.model.glm5_next) models.
--
--   local model = lunar.model.load('/ckpt/GLM-5.2', {dtype = 'f32'})   -- HF checkpoint directory
--   local model = lunar.model.new(config, {seed = 1})                  -- config: table or path
--   local out = model:forward(batch, {loss = true}); model:backward()
--   model:parameters(), model:gradients()                              -- by checkpoint name
--   model:save_hf('/out/dir')                                          -- transformers loads it
--
-- Import followed by export without training gives the same tensors (names, dtypes, shapes,
-- bytes): each tensor is written back in the dtype it was read in, and experts in the layout
-- they were read in (per-expert, as published, or fused).
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local io = require 'lunar.io'
local nn = require 'lunar.nn'
local config = require 'lunar.model.config'
local params = require 'lunar.model.params'
local glm = require 'lunar.model.glm'
local glm5_next = require 'lunar.model.glm5_next'
local sharded = require 'lunar.parallel.checkpoint'

local M = {config = config, glm = glm, glm5_next = glm5_next, params = params}

local fail = tensor.fail

local glm5_next_type = 'glm5_next'

local function cfg_of(c)
    if type(c) == 'string' then
        if c:match('%.json$') then return config.load(c) end
        return config.load(c .. '/config.json')
    end
    if type(c) == 'table' and c.model_type and c.raw then return c end
    return config.from_table(c, 'config table')
end

-- lunar.model.new(config, {seed=, dtype=, device=, indexer_loss_coeff=, fp32_residual=}) -> a model
-- with fresh weights
function M.new(c, opts)
    if type(opts) == 'number' then opts = {seed = opts} end
    local cfg = cfg_of(c)
    if cfg.model_type == glm5_next_type then return glm5_next.new(cfg, opts or {}) end
    return glm.new(cfg, opts or {})
end

local function shape_str(s) return '(' .. table.concat(s, ', ') .. ')' end

local function same_shape(t, s)
    local ts = t:size()
    if #ts ~= #s then return false end
    for i = 1, #s do if ts[i] ~= s[i] then return false end end
    return true
end

-- lunar.model.load(dir, opts) -> model
--   dir: an HF checkpoint directory, or a sharded one (config.json + manifest.json + the ranks'
--   pieces, what a checkpoint of a split run holds; lunar.parallel.checkpoint), read into any layout
--   opts: dtype (compute dtype of the parameters, default f32), device, indexer_loss_coeff,
--   fp32_residual (bf16/f16: keep the residual stream between sub-blocks in f32; default off,
--   which is transformers' numerics), quiet (no warning on stderr), strict:
--     nil (default)  tensors the model does not know are an error; a checkpoint whose config
--                    declares num_nextn_predict_layers but that holds none of the MTP layer's
--                    tensors (what transformers' save_pretrained writes: its models have no
--                    MTP layer) loads with the MTP layer off, and one warning says so
--     true           that checkpoint is an error too: every tensor of the config must be there
--     false          tensors the model does not know are skipped (the MTP rule as for nil)
--   A checkpoint holding some but not all of the MTP layer's tensors is always an error.
--   ep (a lunar.dist group): expert parallel, the model keeps this rank's range of the routed
--   experts (lunar.model.params.expert_range) and leaves the others' tensors. tp (a group):
--   tensor parallel, the model keeps this rank's block of each split tensor; etp (a group):
--   expert tensor parallel, its block of each routed expert's matrices.
--   model.source.mtp_missing is true when the MTP layer was left out.
function M.load(dir, opts)
    opts = opts or {}
    local cfg = cfg_of(dir)
    if cfg.model_type == glm5_next_type then return glm5_next.load(dir, cfg, opts) end

    -- expert parallel (opts.ep, a lunar.dist group): this rank keeps its range of the routed
    -- experts; tensor parallel (opts.tp) and expert tensor parallel (opts.etp): this rank's block
    -- of each split tensor (lunar.parallel.context)
    local so = glm.spec_opts(cfg, opts)
    local experts = so.experts
    local function elsewhere(name)   -- a routed expert another ep rank holds
        local e = experts and name:match('%.mlp%.experts%.(%d+)%.')
        return e and (tonumber(e) < experts.first or tonumber(e) >= experts.first + experts.count) or false
    end
    local spec = params.spec(cfg, so)

    -- tensors: by name, whole (an HF directory) or already this rank's blocks (a sharded model,
    -- lunar.parallel.checkpoint: each block assembled from the pieces it overlaps)
    local tensors, metadata, names, cut
    local fused, file_dtypes = {}, {}
    if sharded.is_sharded(dir) then
        local source
        tensors, file_dtypes, names, source = sharded.read(dir, spec)
        metadata, cut = source.metadata or {}, true
        for name, dt in pairs(source.fused or {}) do fused[name] = dt end
    else
        tensors, metadata = io.load_checkpoint(dir, {quiet = opts.quiet, fp8_block = cfg.fp8_block})
        -- fused expert tensors (HF's in-memory layout) -> per-expert names
        fused = params.split_all_fused(tensors)
        names = tensors
    end
    local known, missing, missing_mtp, n_mtp = {}, {}, {}, 0
    for _, s in ipairs(spec) do
        known[s.name] = s
        if s.mtp then n_mtp = n_mtp + 1 end
        if not tensors[s.name] then
            missing[#missing + 1] = s.name
            if s.mtp then missing_mtp[#missing_mtp + 1] = s.name end
        end
    end
    local function some(list) table.sort(list); return table.concat(list, ', ', 1, math.min(#list, 5)) end
    local L, nmtp = cfg.num_hidden_layers, cfg.num_nextn_predict_layers or 0
    local mtp_where = nmtp > 1 and ('model.layers.%d-%d.*'):format(L, L + nmtp - 1) or ('model.layers.%d.*'):format(L)
    -- a checkpoint without the MTP layer (transformers' models have none, so save_pretrained
    -- writes none) runs without it, as transformers runs it; strict asks for every tensor
    local without_mtp = n_mtp > 0 and #missing_mtp == n_mtp and #missing == n_mtp
    if without_mtp and opts.strict == true then
        fail(('%s: config.json declares num_nextn_predict_layers = %d, but the checkpoint holds no MTP layer '
            .. '(%s, %d tensors, e.g. %s); strict = true requires it'):format(dir, cfg.num_nextn_predict_layers,
            mtp_where, n_mtp, some(missing_mtp)))
    end
    if #missing_mtp > 0 and #missing_mtp < n_mtp then
        fail(('%s: the MTP layer %s is incomplete: %d of its %d tensors are missing from the checkpoint, e.g. %s')
            :format(dir, mtp_where, #missing_mtp, n_mtp, some(missing_mtp)))
    end
    if without_mtp then
        local o = {}
        for k, v in pairs(opts) do o[k] = v end
        o.mtp, opts = false, o
        spec, known, missing = params.spec(cfg, glm.spec_opts(cfg, opts)), {}, {}
        for _, s in ipairs(spec) do known[s.name] = s end
        if not opts.quiet then
            _G.io.stderr:write(('lunar.model.load: %s: config.json declares num_nextn_predict_layers = %d, but the '
                .. 'checkpoint holds no MTP layer (%s); loaded with the MTP layer off (strict = true makes '
                .. 'this an error)\n'):format(dir, cfg.num_nextn_predict_layers, mtp_where))
        end
    end
    if #missing > 0 then
        fail(('%s: %d tensor%s missing from the checkpoint, e.g. %s'):format(dir, #missing,
            #missing == 1 and ' is' or 's are', some(missing)))
    end
    local unexpected = {}
    for name in pairs(names) do
        if not known[name] and not elsewhere(name) then unexpected[#unexpected + 1] = name end
    end
    table.sort(unexpected)
    if #unexpected > 0 and opts.strict ~= false then
        fail(('%s: %d tensor%s the %s model does not have, e.g. %s'):format(dir, #unexpected,
            #unexpected == 1 and '' or 's', cfg.architecture, table.concat(unexpected, ', ', 1, math.min(#unexpected, 5))))
    end

    local store = nn.params.new()
    local source_dtypes = {}
    local indexer_trainable = (opts.indexer_loss_coeff or 0) > 0
    for _, s in ipairs(spec) do
        local t = tensors[s.name]
        local whole = cut and s.shape or (s.full_shape or s.shape)
        if not same_shape(t, whole) then
            fail(('%s: tensor %s has shape %s, the config says %s'):format(dir, s.name, shape_str(t:size()), shape_str(whole)))
        end
        source_dtypes[s.name] = file_dtypes[s.name] or t:dtype()
        if s.slice and not cut then t = t:narrow(s.slice.dim, s.slice.start + 1, s.slice.len):contiguous() end
        local want = s.dtype or opts.dtype or 'f32'
        local p = core.convert(t, want, opts.device)     -- always a new tensor: never a view of the file
        local trainable = s.trainable
        if s.name:find('.indexer.', 1, true) then trainable = indexer_trainable end
        store:add(s.name, p, trainable)
    end
    local model = glm.from_params(cfg, store, opts)
    model.source = {path = dir, dtypes = source_dtypes, fused = fused, metadata = metadata, mtp_missing = without_mtp}
    return model
end

-- What an HF export writes, shared by save_hf and the export of a split model
-- (lunar.train.export): the dtype of parameter `name` (param_dtype: its dtype in memory), the
-- metadata, and the fused expert tensors of the layout the model was read in:
-- {fname = {which = 'gate_up_proj'|'down_proj', parts = {per-expert names in fill order},
-- dtype =, shape =}}; fill_fused(f, t, get) copies get(part) for every part into t.
function M.hf_dtype(src, name, param_dtype, opts)
    if name:find('e_score_correction_bias', 1, true) then return src.dtypes and src.dtypes[name] or 'f32' end
    return opts.dtype or (not opts.keep_dtype and src.dtypes and src.dtypes[name]) or param_dtype
end

function M.hf_metadata(src, opts)
    return opts.metadata or (src.metadata and next(src.metadata) and src.metadata) or {format = 'pt'}
end

function M.fused_layout(cfg, src, shape_of, opts)
    local out = {}
    for fname, fdt in pairs(src.fused or {}) do
        local prefix, which = fname:match('^(.*%.mlp%.experts)%.([%w_]+)$')
        local E, parts = cfg.n_routed_experts, {}
        for e = 0, E - 1 do
            if which == 'gate_up_proj' then
                parts[#parts + 1] = ('%s.%d.gate_proj.weight'):format(prefix, e)
                parts[#parts + 1] = ('%s.%d.up_proj.weight'):format(prefix, e)
            else
                parts[#parts + 1] = ('%s.%d.down_proj.weight'):format(prefix, e)
            end
        end
        local per = shape_of(parts[1])
        out[fname] = {which = which, parts = parts, dtype = opts.dtype or fdt,
                      shape = which == 'gate_up_proj' and {E, 2 * per[1], per[2]} or {E, per[1], per[2]}}
    end
    return out
end

function M.fill_fused(f, t, get)
    local rows = f.shape[2] / (f.which == 'gate_up_proj' and 2 or 1)
    for e = 0, f.shape[1] - 1 do
        local slot = t and t:select(1, e + 1)
        if f.which == 'gate_up_proj' then
            get(f.parts[2 * e + 1], slot and slot:narrow(1, 1, rows))
            get(f.parts[2 * e + 2], slot and slot:narrow(1, rows + 1, rows))
        else
            get(f.parts[e + 1], slot)
        end
    end
end

-- model:save_hf(dir, {dtype=, keep_dtype=, max_shard_bytes=, metadata=}): config.json +
-- safetensors. Without dtype every tensor keeps the dtype it was loaded in (new models: its own
-- dtype); keep_dtype writes every tensor in its dtype in memory (training checkpoints: the
-- weights a resumed run continues from, bit for bit).
function glm.Model:save_hf(dir, opts)
    opts = opts or {}
    local src = self.source or {dtypes = {}, fused = {}}
    local out = {}
    for name in self.params:names() do
        local t = self.params:get(name)
        out[name] = t:to(M.hf_dtype(src, name, t:dtype(), opts), 'cpu')
    end
    -- tensors carried through untouched (glm5_next: the vision tower, the MTP layer)
    for name, t in pairs(self.carried or {}) do out[name] = t end
    -- write fused experts back in the layout they came in
    for fname, f in pairs(M.fused_layout(self.cfg, src, function(n) return out[n]:size() end, opts)) do
        local t = core.empty(f.shape, f.dtype, 'cpu')
        M.fill_fused(f, t, function(part, at) at:copy_(out[part]); out[part] = nil end)
        out[fname] = t
    end
    os.execute(('mkdir -p %q'):format(dir))
    local raw = self.cfg.raw or {}
    io.write_json(dir .. '/config.json', raw)
    io.save_checkpoint(dir, out, {max_shard_bytes = opts.max_shard_bytes, metadata = M.hf_metadata(src, opts)})
    return dir
end

return M
