-- lunar.parallel.checkpoint: a model written as the pieces its ranks hold (distributed checkpoints),
-- read back into any layout.
--
--   <dir>/config.json              the model's config, as save_hf writes it
--   <dir>/manifest.json            {format = 'lunar.sharded_model', version = 1, layout = {tp =, ep =,
--                                  etp =, dp =, world =}, tensors = {{name =, shape = {...}, dtype =,
--                                  source_dtype =, pieces = {{file =, dim =, start =, len =}, ...}}, ...},
--                                  source = {fused = {name = dtype}, metadata = {...}}}
--   (source: what the model was read from, so that its final HF output keeps the dtypes, the fused
--   expert layout and the metadata it came in, as save_hf does for a model loaded whole)
--   <dir>/rank_NNNNN.safetensors   the pieces world rank NNNNN holds and writes, by tensor name
--
-- A piece is a whole tensor (no dim) or the block [start, start + len) along dim (1-based; start
-- 0-based) of a tensor split by tensor or expert tensor parallel. Every tensor is written once:
-- a split block by the rank of dp (or, for experts spread by ep / etp, edp) index 0 that holds it,
-- a whole tensor by the rank of index 0 in every group that replicates it. The pieces of a tensor
-- cover it exactly (the manifest is checked when written and when read).
--
--   sharded.pieces_of(cfg, plan, q, {mtp =, dtype =}) -- what world rank q writes (plan: lunar.dist.plan)
--   sharded.shard_tensors(model, plan, rank)           -- {name = tensor} this rank writes
--   sharded.write_manifest(model, dir, plan)           -- config.json + manifest.json (one rank)
--   sharded.is_sharded(dir)
--   sharded.entries(dir) -> {name = {shape =, dtype =}}  -- the manifest's tensors
--   sharded.read(dir, spec) -> tensors, dtypes, names, source -- the blocks a spec
--       (lunar.model.params.spec with this rank's experts, tp and etp) asks for, each assembled
--       from the pieces it overlaps; each tensor's source dtype; the manifest's tensor names, for
--       the caller's checks; the manifest's source table
--
-- lunar.model.load reads such a directory like an HF one (lunar.model.load(dir, {tp =, ep =, etp
-- =})): every layout reads the pieces it needs, so a checkpoint written at tp=2 x ep=2 loads at
-- one rank, at ep=4 or at tp=4.
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local io = require 'lunar.io'
local params = require 'lunar.model.params'

local fail = tensor.fail
local fs = core.fs

local M = {}

M.FORMAT = 'lunar.sharded_model'
M.VERSION = 1
M.MANIFEST = 'manifest.json'

function M.file_name(rank) return ('rank_%05d.safetensors'):format(rank) end

function M.is_sharded(dir) return type(dir) == 'string' and fs.stat(dir .. '/' .. M.MANIFEST) ~= nil end

-- the pieces world rank q writes: {{name =, shape = (whole), slice = nil | {dim =, start =, len =},
-- dtype =}, ...}; o.mtp: the model has its MTP layer, o.dtype: the parameters' dtype,
-- o.split_indexer: the indexer's heads split over tp
function M.pieces_of(cfg, plan, q, o)
    local c = plan.coords(q)
    local so = {mtp = o.mtp, split_indexer = plan.tp > 1 and o.split_indexer or nil}
    if plan.tp > 1 then so.tp = {rank = c.tp, size = plan.tp} end
    if plan.etp > 1 then so.etp = {rank = c.etp, size = plan.etp} end
    if plan.ep > 1 then so.experts = params.expert_range(cfg, c.ep, plan.ep) end
    local spread = plan.ep > 1 or plan.etp > 1
    local first_replica = c.dp == 0 and c.cp == 0 and c.pp == 0
    local out = {}
    for _, s in ipairs(require('lunar.model.spec').of(cfg, so)) do
        local writes
        if spread and s.name:find('.mlp.experts.', 1, true) then writes = c.edp == 0 and c.pp == 0
        elseif s.slice then writes = first_replica
        else writes = first_replica and c.tp == 0 end
        if writes then
            out[#out + 1] = {name = s.name, shape = s.full_shape or s.shape, slice = s.slice, dtype = s.dtype or o.dtype}
        end
    end
    -- tensors the model carries untouched (GLM-5.3-Flash: the vision tower, the MTP layer), the
    -- same on every rank: written whole by world rank 0
    if o.carried and q == 0 then
        local names = {}
        for name in pairs(o.carried) do names[#names + 1] = name end
        table.sort(names)
        for _, name in ipairs(names) do
            local t = o.carried[name]
            out[#out + 1] = {name = name, shape = t:size(), dtype = t:dtype(), carried = true}
        end
    end
    return out
end

local function opts_of(model)
    return {mtp = #model.mtp > 0, dtype = model.dtype, split_indexer = model.opts.split_indexer, carried = model.carried}
end

-- {name = CPU tensor} of the pieces world rank `rank` writes, from the model it holds
function M.shard_tensors(model, plan, rank)
    local out = {}
    for _, p in ipairs(M.pieces_of(model.cfg, plan, rank, opts_of(model))) do
        if p.carried then
            local t = model.carried[p.name]
            out[p.name] = t:to(t:dtype(), 'cpu'):contiguous()
        else
            if not model.params:has(p.name) then
                fail(('sharded model: rank %d should hold %s but does not (another layout?)'):format(rank, p.name))
            end
            out[p.name] = model.params:get(p.name):to(model.params:get(p.name):dtype(), 'cpu'):contiguous()
        end
    end
    return out
end

local function is_int(v, lo) return type(v) == 'number' and v == math.floor(v) and v >= lo end

-- a manifest entry {name, shape, dtype, pieces} checked: the fields there and of their types, and
-- the pieces tiling the tensor exactly (one whole piece, or blocks along one dim, each row once)
local function check_entry(t, where)
    if type(t) ~= 'table' or type(t.name) ~= 'string' then fail(('%s: a tensor entry without a name'):format(where)) end
    local what = ('%s: tensor %s'):format(where, t.name)
    if type(t.shape) ~= 'table' or #t.shape == 0 then fail(what .. ': no shape') end
    for _, v in ipairs(t.shape) do if not is_int(v, 1) then fail(what .. ': the shape is not a list of sizes') end end
    if type(t.dtype) ~= 'string' then fail(what .. ': no dtype') end
    if type(t.pieces) ~= 'table' or #t.pieces == 0 then fail(what .. ': no pieces') end
    local dim
    for k, p in ipairs(t.pieces) do
        if type(p) ~= 'table' or type(p.file) ~= 'string' then fail(('%s: piece %d has no file'):format(what, k)) end
        if p.dim == nil then
            if p.start ~= nil or p.len ~= nil or #t.pieces > 1 then
                fail(('%s: piece %d (%s) is the whole tensor, but the tensor has %d pieces'):format(what, k, p.file,
                    #t.pieces))
            end
        else
            if not (is_int(p.dim, 1) and p.dim <= #t.shape and is_int(p.start, 0) and is_int(p.len, 1)
                    and p.start + p.len <= t.shape[p.dim]) then
                fail(('%s: piece %d (%s): dim %s, start %s, len %s is not a block of shape (%s)'):format(what, k, p.file,
                    tostring(p.dim), tostring(p.start), tostring(p.len), table.concat(t.shape, ', ')))
            end
            if dim and p.dim ~= dim then fail(('%s: pieces split along dims %d and %d'):format(what, dim, p.dim)) end
            dim = p.dim
        end
    end
    if not dim then return end
    local order = {}
    for k, p in ipairs(t.pieces) do order[k] = p end
    table.sort(order, function(a, b) return a.start < b.start end)
    local at = 0
    for _, p in ipairs(order) do
        if p.start < at then
            fail(('%s: pieces overlap along dim %d at %d..%d (%s)'):format(what, dim, p.start, at, p.file))
        elseif p.start > at then
            fail(('%s: no piece holds %d..%d along dim %d'):format(what, at, p.start, dim))
        end
        at = p.start + p.len
    end
    if at ~= t.shape[dim] then fail(('%s: no piece holds %d..%d along dim %d'):format(what, at, t.shape[dim], dim)) end
end

-- config.json and manifest.json into dir (made by the caller), for the pieces every rank of the
-- plan writes
function M.write_manifest(model, dir, plan)
    local o = opts_of(model)
    local by_name, order = {}, {}
    for q = 0, plan.world - 1 do
        for _, p in ipairs(M.pieces_of(model.cfg, plan, q, o)) do
            local t = by_name[p.name]
            if not t then
                local src = model.source and model.source.dtypes and model.source.dtypes[p.name]
                t = {name = p.name, shape = io.array(p.shape), dtype = p.dtype, source_dtype = src,
                     pieces = io.array({})}
                by_name[p.name] = t
                order[#order + 1] = p.name
            end
            local piece = {file = M.file_name(q)}
            if p.slice then piece.dim, piece.start, piece.len = p.slice.dim, p.slice.start, p.slice.len end
            t.pieces[#t.pieces + 1] = piece
        end
    end
    local list = io.array({})
    for _, name in ipairs(order) do
        local t = by_name[name]
        check_entry(t, 'sharded model')
        list[#list + 1] = t
    end
    io.write_json(dir .. '/config.json', model.cfg.raw or {})
    local src = model.source or {}
    io.write_json(dir .. '/' .. M.MANIFEST, {format = M.FORMAT, version = M.VERSION, tensors = list,
        layout = {tp = plan.tp, ep = plan.ep, etp = plan.etp, dp = plan.dp, world = plan.world},
        source = {fused = src.fused or {}, metadata = src.metadata or {}}})
end

-- the manifest of dir, checked
local function manifest_of(dir)
    local path = dir .. '/' .. M.MANIFEST
    local man = io.read_json(path)
    if type(man) ~= 'table' or man.format ~= M.FORMAT then
        fail(('%s: not a lunar sharded model manifest (format %s)'):format(path, tostring(type(man) == 'table' and man.format)))
    end
    if man.version ~= M.VERSION then
        fail(('%s: version %s, this lunar reads version %d'):format(path, tostring(man.version), M.VERSION))
    end
    if type(man.tensors) ~= 'table' then fail(path .. ': no tensors list') end
    for _, t in ipairs(man.tensors) do check_entry(t, path) end
    return man, path
end

-- the box of a piece or a block: lo[i], hi[i] per dim (0-based, hi exclusive)
local function box(shape, dim, start, len)
    local lo, hi = {}, {}
    for i, v in ipairs(shape) do lo[i], hi[i] = 0, v end
    if dim then lo[dim], hi[dim] = start, start + len end
    return lo, hi
end

-- entries(dir) -> {name = {shape =, dtype =}} of the manifest's tensors (checked)
function M.entries(dir)
    local out = {}
    for _, t in ipairs((manifest_of(dir)).tensors) do out[t.name] = {shape = t.shape, dtype = t.dtype} end
    return out
end

-- tensors = {name = the block spec entry s asks for}, dtypes = {name = the file's dtype}, names =
-- the manifest's tensor names (set); spec entries whose tensor the manifest lacks are left out
function M.read(dir, spec)
    local man, mpath = manifest_of(dir)
    local by_name, names = {}, {}
    for _, t in ipairs(man.tensors) do by_name[t.name], names[t.name] = t, true end
    local files = {}
    local function file(name)
        if not files[name] then
            local path = dir .. '/' .. name
            if not fs.stat(path) then fail(('%s: %s lists %s, which is missing'):format(dir, M.MANIFEST, name)) end
            files[name] = io.safetensors_open(path)
        end
        return files[name]
    end
    local tensors, dtypes = {}, {}
    local ok, err = pcall(function()
        for _, s in ipairs(spec) do
            local entry = by_name[s.name]
            if entry then
                local whole = s.full_shape or s.shape
                for i, v in ipairs(whole) do
                    if entry.shape[i] ~= v or #entry.shape ~= #whole then
                        fail(('%s: tensor %s has shape (%s), the config says (%s)'):format(mpath, s.name,
                            table.concat(entry.shape, ', '), table.concat(whole, ', ')))
                    end
                end
                local sl = s.slice
                local nlo, nhi = box(whole, sl and sl.dim, sl and sl.start, sl and sl.len)
                local out = core.empty(s.shape, entry.dtype, 'cpu')
                local covered = 0
                for _, p in ipairs(entry.pieces) do
                    local plo, phi = box(whole, p.dim, p.start, p.len)
                    local lo, hi, n = {}, {}, 1
                    for i = 1, #whole do
                        lo[i], hi[i] = math.max(nlo[i], plo[i]), math.min(nhi[i], phi[i])
                        n = n * math.max(0, hi[i] - lo[i])
                    end
                    if n > 0 then
                        local src = file(p.file):tensor(s.name)
                        if not src then fail(('%s/%s holds no tensor %s'):format(dir, p.file, s.name)) end
                        -- the stored block is the one the manifest describes
                        local want = {}
                        for i = 1, #whole do want[i] = phi[i] - plo[i] end
                        local got = src:size()
                        local same = #got == #want and src:dtype() == entry.dtype
                        for i = 1, #want do same = same and got[i] == want[i] end
                        if not same then
                            fail(('%s/%s: %s is %s (%s), %s says %s (%s)'):format(dir, p.file, s.name, src:dtype(),
                                table.concat(got, ', '), M.MANIFEST, entry.dtype, table.concat(want, ', ')))
                        end
                        local dst = out
                        for i = 1, #whole do
                            src = src:narrow(i, lo[i] - plo[i] + 1, hi[i] - lo[i])
                            dst = dst:narrow(i, lo[i] - nlo[i] + 1, hi[i] - lo[i])
                        end
                        dst:copy_(src)
                        covered = covered + n
                    end
                end
                if covered ~= out:numel() then
                    fail(('%s: the pieces of %s cover %d of the %d elements this rank needs'):format(mpath, s.name,
                        covered, out:numel()))
                end
                tensors[s.name], dtypes[s.name] = out, entry.source_dtype or entry.dtype
            end
        end
    end)
    for _, f in pairs(files) do f:close() end
    if not ok then error(err, 0) end
    return tensors, dtypes, names, type(man.source) == 'table' and man.source or {}
end

return M
