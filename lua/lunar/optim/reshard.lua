-- lunar.optim.reshard: a checkpoint's optimizer state read into another layout (another dp, tp,
-- ep or etp, or one rank), as Megatron's distributed checkpoints reshard the distributed
-- optimizer.
--
--   local reshard = require 'lunar.optim.reshard'
--   reshard.load(opt, loaded)      -- opt: lunar.optim.distributed / partitioned / AdamW of this
--                                  -- layout; loaded: lunar.train.checkpoint.load's table
--
-- What a checkpoint holds: with the distributed optimizer, each rank's file
-- (optimizer_shards/rank_NNNNN.safetensors) has for every parameter it holds a piece of the state
-- of: exp_avg.<name>, exp_avg_sq.<name>, master.<name> (non-f32 parameters), step.<name>, and
-- place.<name>, the piece in global coordinates (place() below): a flat range of the rank's block
-- of the parameter, that block's shape and where it sits in the whole tensor (the dim tp or etp
-- splits, its start and length), and which gradient buffer it came from (the lowest world rank of
-- the buffer's data-parallel group: the pieces of one buffer cover its blocks exactly). One rank
-- (lunar.optim.AdamW) holds whole tensors in the checkpoint's optimizer part.
--
-- Reading: for each piece this layout's optimizer holds (a flat range of this rank's block of a
-- parameter), every block of the old layout that overlaps this rank's block is put together from
-- the pieces of one buffer holding it, the overlap copied in, and the range taken; exp_avg, exp_avg_sq and the
-- f32 master alike, the update count from any old piece. A parameter with no state in the
-- checkpoint (never updated) has none here either; a block the old pieces do not cover is an
-- error naming it. The AdamW update is elementwise, so the resharded state continues the run as
-- the old layout would, up to the rounding of the other layout's reductions.
--
-- Cost: every rank opens every old rank's file (their headers; the tensors it reads are the
-- ones it needs) and holds, one parameter at a time, its block and the old blocks it overlaps
-- in f32 on the CPU (for a vocabulary-sized embedding that tp does not split, the whole tensor).
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local lio = require 'lunar.io'

local fail = tensor.fail

local M = {}

local KINDS = {'exp_avg', 'exp_avg_sq', 'master'}

-- the id of a gradient buffer: the lowest world rank of the group it is reduced over
function M.buffer_id(group)
    local low
    for _, r in ipairs(group:ranks()) do if not low or r < low then low = r end end
    return low or 0
end

-- place.<name>: (7 + nd) i64 {start, len, dim (0: the block is the whole tensor), block start,
-- block len, buffer id, nd, shape of the block...}
function M.place(start, len, shape, slice, buffer_id)
    local v = {start, len, slice and slice.dim or 0, slice and slice.start or 0, slice and slice.len or 0, buffer_id or 0,
               #shape}
    for _, s in ipairs(shape) do v[#v + 1] = s end
    return core.from_flat(v, {#v}, 'i64', 'cpu')
end

local function parse(t, where)
    local v = t:tolist_flat()
    local nd = v[7]
    if #v < 7 or not nd or #v ~= 7 + nd then fail(('%s: not an optimizer piece\'s place'):format(where)) end
    local shape = {}
    for i = 1, nd do shape[i] = v[7 + i] end
    return {start = v[1], len = v[2], dim = v[3] > 0 and v[3] or nil, bstart = v[4], blen = v[5], buffer = v[6],
            shape = shape}
end

-- whether a saved place is this piece's (the same layout): ok, or false and why not
function M.same_place(t, start, len, slice)
    local p = parse(t, 'place')
    local want = {start = start, len = len, dim = slice and slice.dim, bstart = slice and slice.start or 0,
                  blen = slice and slice.len or 0}
    for _, k in ipairs({'start', 'len', 'dim', 'bstart', 'blen'}) do
        if p[k] ~= want[k] then
            return false, ('the checkpoint\'s piece has %s %s, this layout\'s %s (another layout: it is resharded only '
                .. 'when the checkpoint says so)'):format(k, tostring(p[k]), tostring(want[k]))
        end
    end
    return true
end

-- the old ranks' shard files, opened when a piece is read and at most M.MAX_OPEN at a time (a
-- checkpoint of thousands of ranks would otherwise hold as many files open on every rank)
M.MAX_OPEN = 64
local function file_cache()
    local open, order = {}, {}
    local c = {}
    function c.get(path)
        local f = open[path]
        if f then return f end
        if #order >= M.MAX_OPEN then
            local old = table.remove(order, 1)
            open[old]:close()
            open[old] = nil
        end
        f = lio.safetensors_open(path)
        open[path], order[#order + 1] = f, path
        return f
    end
    function c.close()
        for _, path in ipairs(order) do open[path]:close() end
        open, order = {}, {}
    end
    return c
end

-- one old rank's optimizer shard: each piece's place added to its parameter's entry (with the
-- update count); the tensors are read later, through files
local function read_shard(path, files, add)
    local f = files.get(path)
    local keys = f:keys()
    local has = {}
    for _, key in ipairs(keys) do has[key] = true end
    local placed = {}
    for _, key in ipairs(keys) do
        local name = key:match('^place%.(.+)$')
        if name then
            placed[name] = true
            local e = add(name, {place = parse(f:tensor(key), path .. ': ' .. key), path = path, files = files, has = has})
            if has['step.' .. name] and not e.step then e.step = f:tensor('step.' .. name):item() end
        end
    end
    for _, key in ipairs(keys) do
        local name = key:match('^exp_avg%.(.+)$')
        if name and not placed[name] then
            fail(('%s holds the optimizer state of %s without its place: it was written before the state could '
                .. 'be resharded; resume it in the layout that wrote it, or set checkpoint.resume=none')
                :format(path, name))
        end
    end
end

-- the old layout's pieces by parameter name: {[name] = {pieces = {{place, path or tensors}}, step =}}
local function sources(loaded)
    local by_name, files = {}, file_cache()
    local function add(name, piece) local e = by_name[name] or {pieces = {}}; by_name[name] = e; e.pieces[#e.pieces + 1] = piece; return e end
    if type(loaded.shards) == 'table' then
        -- (a file that fails to open or parse closes the ones opened before it)
        local ok, err = pcall(function()
            for _, rel in ipairs(loaded.shards) do read_shard(loaded.dir .. '/' .. rel, files, add) end
        end)
        if not ok then
            files.close()
            error(err, 0)
        end
    else
        -- one rank: whole tensors
        local opt = loaded.optimizer or {}
        local tensors, sc = opt.tensors or {}, opt.scalars or {}
        local sharded = sc.distributed ~= nil
        for _, part in pairs(type(sc.partitioned) == 'table' and sc.partitioned or {}) do
            sharded = sharded or (type(part) == 'table' and part.distributed ~= nil)
        end
        if sharded then
            fail(('checkpoint %s was written by the distributed optimizer but holds no optimizer shards (%s/): its '
                .. 'state cannot be read'):format(tostring(loaded.dir), 'optimizer_shards'))
        end
        for key, t in pairs(tensors) do
            local name = key:match('^exp_avg%.(.+)$')
            if name then
                local e = add(name, {place = {start = 0, len = t:numel(), bstart = 0, blen = 0, buffer = 0, shape = t:size()},
                    tensors = tensors})
                e.step = (sc.param_steps or {})[name]
            end
        end
    end
    return by_name, files
end

local function read_piece(piece, kind, name)
    local key = kind .. '.' .. name
    -- (a view of the mapped file: the caller copies it before the next read can close the file)
    if piece.path then return piece.has[key] and piece.files.get(piece.path):tensor(key) or nil end
    return piece.tensors[key]
end

local function numel(shape) local n = 1; for _, v in ipairs(shape) do n = n * v end; return n end

-- the old blocks of `name` for `kind` that overlap `want` ({dim =, lo =, hi =}: this rank's
-- block along the split dim; nil: the whole tensor), each put together from the pieces of one
-- buffer that holds it: {{dim, lo, hi, block}, ...} (nil when the old state has no such kind)
local function old_blocks(src, name, kind, want)
    -- pieces by buffer, then by block; blocks of the split dim outside `want` are not read
    local buffers, order = {}, {}
    for _, p in ipairs(src.pieces) do
        local pl = p.place
        local outside = want and pl.dim == want.dim and (pl.bstart >= want.hi or pl.bstart + pl.blen <= want.lo)
        if not outside then
            local b = buffers[pl.buffer]
            if not b then b = {}; buffers[pl.buffer] = b; order[#order + 1] = pl.buffer end
            local key = ('%s/%d/%d'):format(tostring(pl.dim), pl.bstart, pl.blen)
            b[key] = b[key] or {}
            table.insert(b[key], p)
        end
    end
    table.sort(order)
    local out, seen = {}, {}
    for _, id in ipairs(order) do
        local keys = {}
        for key in pairs(buffers[id]) do keys[#keys + 1] = key end
        table.sort(keys)
        for _, key in ipairs(keys) do
            if not seen[key] then
                local list = buffers[id][key]
                local pl = list[1].place
                local block = core.empty(pl.shape, 'f32', 'cpu')
                local flat = block:view(numel(pl.shape))
                local covered, have = 0, 0
                for _, p in ipairs(list) do
                    local t = read_piece(p, kind, name)
                    if t then
                        flat:narrow(1, p.place.start + 1, p.place.len):copy_(t:view(t:numel()))
                        covered, have = covered + p.place.len, have + 1
                    end
                end
                if have == 0 then
                    block:free()
                    for _, o in ipairs(out) do o.block:free() end
                    return nil
                end
                if covered ~= flat:numel() then
                    fail(('the checkpoint\'s optimizer pieces of %s (%s) cover %d of the %d elements of a block'):format(
                        name, kind, covered, flat:numel()))
                end
                seen[key] = true
                local lo = pl.dim and pl.bstart or 0
                out[#out + 1] = {dim = pl.dim, lo = lo, hi = pl.dim and lo + pl.blen or nil, block = block}
            end
        end
    end
    return out
end

-- the flat range [start, start + len) of this layout's block (shape, slice) of `name`, for kind,
-- from the old blocks; nil when the checkpoint has none of that kind
local function assemble(src, name, kind, shape, slice, start, len)
    local want = slice and {dim = slice.dim, lo = slice.start, hi = slice.start + slice.len} or nil
    local blocks = old_blocks(src, name, kind, want)
    if not blocks then return nil end
    local out = core.empty(shape, 'f32', 'cpu')
    local dim = slice and slice.dim
    for _, b in ipairs(blocks) do dim = dim or b.dim end
    local covered = 0
    for _, b in ipairs(blocks) do
        if not dim then
            out:copy_(b.block)
            covered = out:numel()
        else
            local nlo = slice and slice.start or 0
            local nhi = nlo + shape[dim]
            local olo = b.dim and b.lo or 0
            local ohi = b.dim and b.hi or olo + b.block:size(dim)
            local a, z = math.max(nlo, olo), math.min(nhi, ohi)
            if z > a then
                out:narrow(dim, a - nlo + 1, z - a):copy_(b.block:narrow(dim, a - olo + 1, z - a))
                covered = covered + out:numel() / shape[dim] * (z - a)
            end
        end
        b.block:free()
    end
    if covered ~= out:numel() then
        fail(('the checkpoint\'s optimizer state of %s (%s) covers %d of the %d elements this rank holds'):format(name,
            kind, covered, out:numel()))
    end
    local r = out:view(out:numel()):narrow(1, start + 1, len):clone()
    out:free()
    return r
end

-- the state of one target piece, or nil (no state in the checkpoint); out_shape: the shape its
-- tensors take (AdamW's whole parameters; flat for a distributed optimizer's piece)
local function state_of(src, name, param, shape, slice, start, len, default_step, out_shape)
    if not src then return nil end
    local st = {step = src.step or default_step}
    for _, kind in ipairs(KINDS) do
        local t = assemble(src, name, kind, shape, slice, start, len)
        if t then
            if out_shape then t = t:view(out_shape) end
            st[kind] = core.persist(core.convert(t, 'f32', param:device()))
        end
    end
    if not st.exp_avg or not st.exp_avg_sq then
        fail(('the checkpoint\'s optimizer state of %s lacks %s'):format(name, st.exp_avg and 'exp_avg_sq' or 'exp_avg'))
    end
    if param:dtype() ~= 'f32' and not st.master then
        local part = param:view(param:numel()):narrow(1, start + 1, len)
        st.master = core.persist(core.convert(out_shape and part:view(out_shape) or part, 'f32'))
    end
    if param:dtype() == 'f32' then st.master = nil end
    return st
end

-- the counters every part shares, from the checkpoint's scalars (of any of its parts)
local function counters(sd)
    local sc = type(sd) == 'table' and sd.scalars or {}
    if type(sc.partitioned) == 'table' then sc = sc.partitioned.dense or select(2, next(sc.partitioned)) or {} end
    return sc
end

local function set_counters(opt, sc)
    opt.step_count = sc.step or 0
    opt.skipped = sc.skipped or 0
    opt.nonfinite_loss = sc.nonfinite_loss or 0
    opt.nonfinite_grad = sc.nonfinite_grad or 0
end

-- load(opt, loaded): opt's state from the checkpoint `loaded` written in another layout
function M.load(opt, loaded)
    local src, files = sources(loaded)
    local sc = counters(loaded.optimizer)
    local ok, err = pcall(function()
        local parts = opt.parts or {{opt = opt}}
        for _, part in ipairs(parts) do
            local o = part.opt
            local fresh = {}
            if o.pieces then   -- lunar.optim.distributed: this rank's pieces
                for _, pc in ipairs(o.pieces) do
                    fresh[pc.name] = state_of(src[pc.name], pc.name, pc.entry.param, pc.entry.param:size(),
                        o.slices[pc.name], pc.start, pc.len, sc.step or 0)
                end
            else               -- lunar.optim.AdamW on one rank: whole tensors
                for name in o.store:names() do
                    if o.store:is_trainable(name) and (not o.filter or o.filter(name)) then
                        local p = o.store:get(name)
                        fresh[name] = state_of(src[name], name, p, p:size(), nil, 0, p:numel(), sc.step or 0, p:size())
                    end
                end
            end
            o.state = fresh
            set_counters(o, sc)
        end
    end)
    files.close()
    if not ok then error(err, 0) end
    return opt
end

return M
