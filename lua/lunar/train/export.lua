-- lunar.train.export: the HF checkpoint of a model split by tensor, expert or expert tensor
-- parallel, gathered as it is written (collective: every rank calls it; world rank 0 writes).
--
--   export.write_hf(dp, model, dir[, {max_shard_bytes = 5e9, dtype =, keep_dtype =, metadata =}])
--
-- The files are the ones model:save_hf writes for the same weights on one rank, byte for byte:
-- the same names, dtypes (the dtype each tensor was read in, or opts.dtype / keep_dtype), the
-- fused expert layout the model was read in, the metadata, and the same shards (names sorted, a
-- new shard before the tensor that would overflow max_shard_bytes; model.safetensors when one
-- holds everything, else model-NNNNN-of-NNNNN.safetensors and model.safetensors.index.json).
-- The ranks walk the sorted names together: a split tensor is all-gathered over tp (etp), a
-- spread expert over its ep group (one gather brings that local expert of every member, kept
-- until each has been written), and rank 0 holds one shard's tensors at a time, so no rank
-- holds the whole model.
local core = require 'lunar.core'
local dist = require 'lunar.dist'
local io = require 'lunar.io'
local model_mod = require 'lunar.model'
local mspec = require 'lunar.model.spec'
local grad_buffer = require 'lunar.optim.grad_buffer'
local unsplit = require('lunar.train.data_parallel').unsplit

local fs = core.fs

local M = {}

function M.write_hf(dp, model, dir, opts)
    opts = opts or {}
    local max_shard = opts.max_shard_bytes or 5e9
    local cfg, store = model.cfg, model.params
    local src = model.source or {dtypes = {}, fused = {}}
    local writer = dist.rank() == 0
    local ep = dp.ep and dp.ep:size() or 1
    local El = (cfg.n_routed_experts or 0) / ep
    local tp_slices = dp.tp and model:tp_slices('tp') or {}
    local etp_slices = dp.etp and model:tp_slices('etp') or {}

    -- the output tensors: every parameter, except the experts the fused tensors take in
    local spec = mspec.of(cfg, {mtp = #model.mtp > 0})
    local shape_of, out_dtype = {}, {}
    for _, s in ipairs(spec) do
        shape_of[s.name] = s.shape
        out_dtype[s.name] = model_mod.hf_dtype(src, s.name,
            (store:has(s.name) and store:get(s.name):dtype()) or s.dtype or model.dtype, opts)
    end
    -- tensors carried through untouched (GLM-5.3-Flash: the vision tower, the MTP layer), the
    -- same on every rank: written as they are
    local carried = model.carried or {}
    for name, t in pairs(carried) do
        spec[#spec + 1] = {name = name}
        shape_of[name], out_dtype[name] = t:size(), t:dtype()
    end
    local fused, taken = model_mod.fused_layout(cfg, src, function(n) return shape_of[n] end, opts), {}
    for _, f in pairs(fused) do for _, p in ipairs(f.parts) do taken[p] = true end end
    local names = {}
    for _, s in ipairs(spec) do if not taken[s.name] then names[#names + 1] = s.name end end
    for fname in pairs(fused) do names[#names + 1] = fname end
    table.sort(names)

    -- the shards, as lunar.io.save_checkpoint plans them
    local shard_of, ns, cur, total = {}, 0, 0, 0
    for i, name in ipairs(names) do
        local f = fused[name]
        local shape, dt = f and f.shape or shape_of[name], f and f.dtype or out_dtype[name]
        local b = grad_buffer.dtype_bytes(dt)
        for _, v in ipairs(shape) do b = b * v end
        if ns == 0 or (cur > 0 and cur + b > max_shard) then ns, cur = ns + 1, 0 end
        shard_of[i], cur, total = ns, cur + b, total + b
    end
    if ns == 0 then ns = 1 end

    -- one parameter whole (on the writer, in its output dtype; nil elsewhere), collectively, and
    -- whether it is a tensor of its own (not the parameter itself or a view of a gather kept for
    -- the other experts): those are freed once written
    local cache = {}   -- spread experts: prefix/local index/rest -> {tensors by ep member, uses left}
    local function whole(name)
        local prefix, e, rest = name:match('^(.*%.mlp%.experts%.)(%d+)(%..*)$')
        local t, owned = nil, false
        if prefix and dp.ep then
            e = tonumber(e)
            local key = ('%s%d%s'):format(prefix, e % El, rest)
            local c = cache[key]
            if not c then
                local mine = store:get(prefix .. (dp.ep:rank() * El + e % El) .. rest)
                local sl = etp_slices[prefix .. (dp.ep:rank() * El + e % El) .. rest]
                if sl then mine = unsplit(mine, sl.dim, dp.etp) end
                local all = dist.all_gather(mine:contiguous(), {group = dp.ep})
                c = {all = all, rows = mine:size(1), left = ep}
                cache[key] = c
            end
            t = c.all:narrow(1, math.floor(e / El) * c.rows + 1, c.rows)
            c.left = c.left - 1
            if c.left == 0 then cache[key] = nil end
        elseif tp_slices[name] then
            t, owned = unsplit(store:get(name), tp_slices[name].dim, dp.tp), true
        elseif carried[name] then
            t = carried[name]
        else
            t = store:get(name)
        end
        if not writer then
            if owned then t:free() end
            return nil, false
        end
        local out = t:to(out_dtype[name], 'cpu')
        if out ~= t and owned then t:free() end
        return out, out ~= t or owned
    end
    local function tensor_of(name)
        local f = fused[name]
        if not f then return whole(name) end
        local out = writer and core.empty(f.shape, f.dtype, 'cpu') or nil
        model_mod.fill_fused(f, out, function(part, at)   -- every rank gathers; the writer copies
            local t, owned = whole(part)
            if out then
                at:copy_(t)
                if owned then t:free() end
            end
        end)
        return out, true
    end

    local md = model_mod.hf_metadata(src, opts)
    if writer then
        os.execute(('mkdir -p %q'):format(dir))
        io.write_json(dir .. '/config.json', cfg.raw or {})
    end
    local i = 1
    for s = 1, ns do
        local group, own = {}, {}
        while i <= #names and shard_of[i] == s do
            local t, owned = tensor_of(names[i])
            if writer then
                group[names[i]] = t
                if owned then own[#own + 1] = t end
            end
            i = i + 1
        end
        if writer then
            if ns == 1 then
                io.save_checkpoint(dir, group, {max_shard_bytes = max_shard, metadata = md})
            else
                io.save_safetensors(('%s/model-%05d-of-%05d.safetensors'):format(dir, s, ns), group, {metadata = md})
            end
            for _, t in ipairs(own) do t:free() end
        end
    end
    if writer and ns > 1 then
        -- the index as lunar.io.save_checkpoint writes it (keys sorted, 2-space indent)
        local lines = {}
        for k, name in ipairs(names) do
            lines[k] = ('%s: "model-%05d-of-%05d.safetensors"'):format((io.encode_json(name):gsub('\n$', '')), shard_of[k], ns)
        end
        io.write_file(dir .. '/model.safetensors.index.json', ('{\n  "metadata": {\n    "total_size": %d\n  },\n'
            .. '  "weight_map": {\n    %s\n  }\n}\n'):format(total, table.concat(lines, ',\n    ')))
        -- what an earlier save left that this one does not use
        for _, f in ipairs(fs.list(dir) or {}) do
            local n = f:match('^model%-%d%d%d%d%d%-of%-(%d%d%d%d%d)%.safetensors$')
            if f == 'model.safetensors' or (n and tonumber(n) ~= ns) then os.remove(dir .. '/' .. f) end
        end
    end
    dist.barrier({group = dist.world()})
    return dir
end

return M
