-- lunar.train.checkpoint: training checkpoints that survive a kill at any moment.
--
--   local ckpt = require 'lunar.train.checkpoint'
--   local cm = ckpt.manager{dir = 'runs/sft/checkpoints', every = 100, keep_last = 3}
--   local st = cm:resume('auto')            -- nil: start fresh; else the loaded checkpoint
--   if st then
--       ckpt.copy_into(opt_state, st.optimizer)  -- tensors copied into the live ones
--       ckpt.restore_rng(st, {data = data_rng})  -- rng:set_state for each stream
--       step = st.step
--   end
--   for step = step + 1, total do
--       ...
--       if cm:due(step, step == total) then
--           cm:save(step, {
--               save_model = function(dir) model:save_hf(dir) end,   -- or the adapters' save
--               optimizer = {tensors = {...}, scalars = {...}},      -- tensors anywhere in the table
--               scheduler = sched_state, rng = {data = data_rng}, data = loader_state,
--               metrics = {loss = loss}, extra = {...}})
--       end
--   end
--
-- Layout of <dir>/step_000100/ (docs/training.md): model/ (what save_model wrote),
-- <part>.safetensors for each part holding tensors (optimizer, scheduler, data, metrics, extra),
-- trainer_state.json (step, the parts' tables with every tensor replaced by a reference, RNG
-- states) and COMPLETE.json, the marker, written last: the size of every file and a CRC-32C of
-- those up to checksum_max_bytes. Everything is written into <dir>/.tmp.step_000100.<pid>/,
-- each file and directory fsynced, then the directory is renamed into place and <dir> fsynced.
--
-- Data parallel (save with opts.group, the data-parallel group, and opts.shard, this rank's
-- optimizer tensors): every rank calls save; rank 0 of the group names and makes the temporary
-- directory (its pid), each rank writes optimizer_shards/rank_NNNNN.safetensors into it and
-- fsyncs it, and after a barrier rank 0 writes everything else (the replicated weights, the
-- parts, trainer_state.json listing the shard files) and the marker over all files, and renames
-- the directory into place; a last barrier lets no rank go on before the checkpoint exists.
-- load_shard(loaded, rank) reads a rank's file back.
--
-- resume('auto') takes the newest step_* directory whose marker, sizes, checksums and files
-- check out; others (no marker, a truncated or corrupt file) are reported on stderr and skipped,
-- and temporary directories are ignored (removed when the process that wrote them is gone).
-- Test hook: LUNAR_CKPT_TEST_SLEEP=<seconds> sleeps after each file of a save, so a test can
-- kill the process in the middle of one.
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local lio = require 'lunar.io'

local fs = core.fs
local fail = tensor.fail
local strip_where = require('lunar.config').strip_where
local is_tensor = tensor.is_tensor

local M = {}

M.FORMAT = 'lunar.checkpoint'
M.VERSION = 1
M.MARKER = 'COMPLETE.json'
M.STATE = 'trainer_state.json'
-- the parts of a state table that are saved (besides save_model, rng and step)
M.PARTS = {'optimizer', 'scheduler', 'data', 'metrics', 'extra'}
local PART_SET = {}
for _, p in ipairs(M.PARTS) do PART_SET[p] = true end

local function is_rng(x) return type(x) == 'userdata' and getmetatable(x) == core.rng_mt end

function M.step_name(step) return ('step_%06d'):format(step) end

local function join(a, b) return a .. '/' .. b end

local function report(msg) io.stderr:write('lunar.checkpoint: ' .. msg .. '\n') end

local function test_pause()
    local s = tonumber(os.getenv('LUNAR_CKPT_TEST_SLEEP') or '')
    if s and s > 0 then fs.sleep(s) end
end

-- ---- state tables <-> JSON skeleton + tensors ---------------------------------------------------

local function finite(v) return v == v and v ~= math.huge and v ~= -math.huge end

-- A copy of value for JSON: tensors become {__tensor__ = key} (the key joins the path with '/'
-- and is collected in tensors[key]), non-finite numbers {__number__ = 'nan' | 'inf' | '-inf'},
-- RNG streams their state string. where names the spot in errors.
local function encode(value, path, tensors, where, seen)
    local tv = type(value)
    if is_tensor(value) then
        local key = #path > 0 and table.concat(path, '/') or 'value'
        if tensors[key] then fail(('checkpoint: %s: two tensors would be stored as %q'):format(where, key)) end
        tensors[key] = value
        return {__tensor__ = key}
    elseif is_rng(value) then
        return {__rng__ = value:state()}
    elseif tv == 'number' then
        if finite(value) then return value end
        return {__number__ = value ~= value and 'nan' or (value > 0 and 'inf' or '-inf')}
    elseif tv == 'string' or tv == 'boolean' or lio.is_null(value) then
        return value
    elseif tv == 'table' then
        if seen[value] then fail(('checkpoint: %s.%s: the table contains itself'):format(where, table.concat(path, '.'))) end
        seen[value] = true
        local out = {}
        local n = #value
        local is_array = getmetatable(value) == getmetatable(lio.array())
        local count, strings = 0, 0
        for k, v in pairs(value) do
            count = count + 1
            local tk = type(k)
            if tk == 'string' then strings = strings + 1 end
            if tk ~= 'string' and not (tk == 'number' and k == math.floor(k) and k >= 1 and k <= n) then
                fail(('checkpoint: %s.%s: key %s: a table must be an array or have string keys')
                    :format(where, table.concat(path, '.'), tostring(k)))
            end
            path[#path + 1] = tostring(k)
            out[k] = encode(v, path, tensors, where, seen)
            path[#path] = nil
        end
        seen[value] = nil
        if strings > 0 and count > strings then
            fail(('checkpoint: %s.%s: a table must be an array or have string keys, not both')
                :format(where, table.concat(path, '.')))
        end
        if is_array then lio.array(out) end
        return out
    end
    fail(('checkpoint: %s.%s: a %s cannot be saved'):format(where, table.concat(path, '.'), tv))
end

-- the inverse: references replaced by the tensors of file (a safetensors object) or rng states
local function decode(value, file, where)
    if type(value) ~= 'table' then return value end
    if value.__tensor__ then
        if not file then fail(('%s: refers to tensor %q but there is no tensor file'):format(where, value.__tensor__)) end
        if not file:info(value.__tensor__) then
            fail(('%s: tensor %q is missing from %s'):format(where, value.__tensor__, file:path()))
        end
        return file:tensor(value.__tensor__)
    elseif value.__number__ then
        local s = value.__number__
        return s == 'nan' and 0 / 0 or (s == 'inf' and math.huge or -math.huge)
    elseif value.__rng__ then
        return value.__rng__
    end
    local out = {}
    for k, v in pairs(value) do out[k] = decode(v, file, where) end
    if getmetatable(value) then setmetatable(out, getmetatable(value)) end
    return out
end

-- ---- writing ------------------------------------------------------------------------------------

-- every regular file under dir: {rel = path relative to dir, path = full path}, sorted;
-- fsyncs each file and each directory on the way (deepest first)
local function sync_tree(dir, rel, out)
    local names = assert(fs.list(dir))
    for _, name in ipairs(names) do
        local p, r = join(dir, name), rel and join(rel, name) or name
        local st = fs.stat(p)
        if st and st.type == 'dir' then
            sync_tree(p, r, out)
        elseif st and st.type == 'file' then
            fs.fsync(p)
            out[#out + 1] = {rel = r, path = p, size = st.size}
        elseif st then
            fail(('checkpoint: %s is a %s; a checkpoint holds files and directories only'):format(p, st.type))
        end
    end
    fs.fsync(dir)
    return out
end

local function check_state(state)
    if type(state) ~= 'table' then fail('checkpoint.save: expected a state table, got ' .. type(state)) end
    for k in pairs(state) do
        if not (PART_SET[k] or k == 'save_model' or k == 'rng') then
            fail(('checkpoint.save: unknown state field %q (expected save_model, rng, %s)')
                :format(tostring(k), table.concat(M.PARTS, ', ')))
        end
    end
    if state.save_model ~= nil and type(state.save_model) ~= 'function' then
        fail('checkpoint.save: save_model must be a function(dir), got a ' .. type(state.save_model))
    end
    if state.rng ~= nil then
        if type(state.rng) ~= 'table' then fail('checkpoint.save: rng must be a table {name = rng}') end
        for k, r in pairs(state.rng) do
            if type(k) ~= 'string' or not (is_rng(r) or type(r) == 'string') then
                fail(('checkpoint.save: rng.%s must be a lunar.rng stream (or its state string)'):format(tostring(k)))
            end
        end
    end
end

-- Removes temporary directories of dead writers in root (the current process's own too when
-- `own` is set: a failed save of ours).
local function clean_temps(root, own)
    local names = fs.list(root)
    if not names then return end
    local me = fs.getpid()
    for _, name in ipairs(names) do
        local pid = name:match('^%.tmp%.step_%d+%.(%d+)$') or name:match('^%.old%.step_%d+%.(%d+)$')
        pid = tonumber(pid)
        if pid and ((pid == me and own) or (pid ~= me and not fs.pid_alive(pid))) then
            fs.remove_tree(join(root, name))
        end
    end
end

M.SHARD_DIR = 'optimizer_shards'
function M.shard_name(rank) return ('%s/rank_%05d.safetensors'):format(M.SHARD_DIR, rank) end

-- every rank of `group` writes its shard into tmp (made by rank 0, whose pid names it), and with
-- model_shard (a table, given on every rank: the model's pieces this rank writes, maybe none) its
-- model pieces into tmp/model (lunar.parallel.checkpoint)
local function write_shards(root, name, group, shard, model_shard)
    local dist = require 'lunar.dist'
    local rank = group:rank()
    local pid = dist.broadcast(core.from_flat({fs.getpid()}, {1}, 'i64', 'cpu'), {group = group, root = 0}):item()
    local tmp = join(root, ('.tmp.%s.%d'):format(name, pid))
    if rank == 0 then
        fs.mkdir_p(root)
        fs.remove_tree(tmp)
        assert(fs.mkdir(tmp))
        if shard then assert(fs.mkdir(join(tmp, M.SHARD_DIR))) end
        if model_shard then assert(fs.mkdir(join(tmp, 'model'))) end
    end
    dist.barrier({group = group})
    if model_shard and next(model_shard) then
        local path = join(tmp, 'model/' .. require('lunar.parallel.checkpoint').file_name(dist.rank()))
        lio.save_safetensors(path, model_shard, {metadata = {format = M.FORMAT, part = 'model', rank = tostring(rank),
            ranks = tostring(group:size())}})
        fs.fsync(path)
        test_pause()
    end
    if shard then
        local path = join(tmp, M.shard_name(rank))
        lio.save_safetensors(path, shard, {metadata = {format = M.FORMAT, part = 'optimizer', rank = tostring(rank),
            ranks = tostring(group:size())}})
        fs.fsync(path)
        test_pause()
    end
    dist.barrier({group = group})
    return tmp
end

-- save(root, step, state, {checksum_max_bytes = 256 MiB, group =, shard =, model_shard =}) -> the
-- checkpoint's directory, {bytes = the size of its files}. With group (several ranks), every rank
-- calls it (see the header); ranks other than 0 return the directory and {bytes = 0}. model_shard
-- (group only): each rank's model pieces, written as model/rank_NNNNN.safetensors before rank 0's
-- save_model adds the manifest beside them.
function M.save(root, step, state, opts)
    opts = opts or {}
    if type(root) ~= 'string' then fail('checkpoint.save: expected a directory, got ' .. type(root)) end
    if type(step) ~= 'number' or step < 0 or step ~= math.floor(step) then
        fail('checkpoint.save: step must be a non-negative integer, got ' .. tostring(step))
    end
    check_state(state)
    local max_crc = opts.checksum_max_bytes or 256 * 2 ^ 20
    local name = M.step_name(step)
    local final = join(root, name)
    local group = opts.group and opts.group:size() > 1 and opts.group or nil
    local tmp
    if group then
        tmp = write_shards(root, name, group, opts.shard, opts.model_shard)
        if group:rank() ~= 0 then
            require('lunar.dist').barrier({group = group})
            return final, {bytes = 0}
        end
    else
        fs.mkdir_p(root)
        tmp = join(root, ('.tmp.%s.%d'):format(name, fs.getpid()))
        fs.remove_tree(tmp)
        assert(fs.mkdir(tmp))
    end
    local bytes = 0
    local ok, err = pcall(function()
        local doc = {format = M.FORMAT, version = M.VERSION, step = step, parts = {}, rng = {}}
        if group and opts.shard then
            doc.shards = {}
            for r = 0, group:size() - 1 do doc.shards[r + 1] = M.shard_name(r) end
        end
        if state.save_model then
            local mdir = join(tmp, 'model')
            if not fs.stat(mdir) then assert(fs.mkdir(mdir)) end
            state.save_model(mdir)
            doc.model = 'model'
            test_pause()
        end
        for _, part in ipairs(M.PARTS) do
            if state[part] ~= nil then
                local tensors = {}
                local skel = encode(state[part], {}, tensors, part, {})
                local entry = {value = skel}
                if next(tensors) then
                    entry.file = part .. '.safetensors'
                    lio.save_safetensors(join(tmp, entry.file), tensors, {metadata = {format = M.FORMAT, part = part}})
                    test_pause()
                end
                doc.parts[part] = entry
            end
        end
        for k, r in pairs(state.rng or {}) do doc.rng[k] = is_rng(r) and r:state() or r end
        lio.write_json(join(tmp, M.STATE), doc)
        test_pause()
        local files = sync_tree(tmp, nil, {})
        local manifest = {}
        for _, f in ipairs(files) do
            bytes = bytes + f.size
            local m = {size = f.size}
            if f.size <= max_crc then m.crc32c = (fs.crc32c_file(f.path)) end
            manifest[f.rel] = m
        end
        lio.write_json(join(tmp, M.MARKER), {format = M.FORMAT, version = M.VERSION, step = step,
            time = fs.wall_time(), files = manifest})
        fs.fsync(tmp)
        -- into place: an existing checkpoint of the same step is swapped out atomically
        if fs.stat(final) then
            local swapped = fs.exchange(tmp, final)
            if not swapped then
                local old = join(root, ('.old.%s.%d'):format(name, fs.getpid()))
                fs.rename(final, old)
                fs.rename(tmp, final)
                tmp = old
            end
            fs.fsync(root)
            fs.remove_tree(tmp)
        else
            fs.rename(tmp, final)
        end
        fs.fsync(root)
    end)
    if not ok then
        pcall(fs.remove_tree, tmp)
        error(err, 0)
    end
    if group then require('lunar.dist').barrier({group = group}) end
    return final, {bytes = bytes}
end

-- ---- reading ------------------------------------------------------------------------------------

-- list(root) -> {{step=, name=, dir=, complete=bool}, ...} for the step_* directories, newest
-- first (complete = the marker exists; check() tells whether it is sound), plus the names of
-- temporary directories.
function M.list(root)
    local names = fs.list(root)
    local out, temps = {}, {}
    if not names then return out, temps end
    for _, name in ipairs(names) do
        local s = name:match('^step_(%d+)$')
        local p = join(root, name)
        if s then
            local st = fs.stat(p)
            if st and st.type == 'dir' then
                local m = fs.stat(join(p, M.MARKER))
                out[#out + 1] = {step = tonumber(s), name = name, dir = p, complete = m ~= nil and m.type == 'file'}
            end
        elseif name:match('^%.tmp%.step_') or name:match('^%.old%.step_') then
            temps[#temps + 1] = name
        end
    end
    table.sort(out, function(a, b) return a.step > b.step end)
    return out, temps
end

-- check(dir, {checksums = true}) -> marker, state document | nil, reason. Verifies the marker,
-- that every file it lists has its size (and CRC-32C, when recorded and checksums ~= false),
-- and that trainer_state.json parses and names this step.
function M.check(dir, opts)
    opts = opts or {}
    local mpath = join(dir, M.MARKER)
    if not fs.stat(mpath) then return nil, 'no ' .. M.MARKER .. ' marker (the write did not finish)' end
    local ok, marker = pcall(lio.read_json, mpath)
    if not ok then return nil, 'unreadable marker: ' .. strip_where(marker) end
    if type(marker) ~= 'table' or marker.format ~= M.FORMAT or type(marker.files) ~= 'table' then
        return nil, M.MARKER .. ' is not a lunar checkpoint marker'
    end
    if (marker.version or 0) > M.VERSION then
        return nil, ('written by a newer lunar (format version %s, this one reads %d)'):format(tostring(marker.version), M.VERSION)
    end
    local rels = {}
    for rel in pairs(marker.files) do rels[#rels + 1] = rel end
    table.sort(rels)
    for _, rel in ipairs(rels) do
        local m = marker.files[rel]
        local st = fs.stat(join(dir, rel))
        if not st or st.type ~= 'file' then return nil, rel .. ' is missing' end
        if st.size ~= m.size then return nil, ('%s has %d bytes, the marker says %d'):format(rel, st.size, m.size) end
        if m.crc32c and opts.checksums ~= false then
            local crc = fs.crc32c_file(join(dir, rel))
            if crc ~= m.crc32c then return nil, ('%s is corrupt (CRC-32C %08x, the marker says %08x)'):format(rel, crc, m.crc32c) end
        end
    end
    if not marker.files[M.STATE] then return nil, 'the marker does not list ' .. M.STATE end
    local ok2, doc = pcall(lio.read_json, join(dir, M.STATE))
    if not ok2 then return nil, strip_where(doc) end
    if type(doc) ~= 'table' or doc.format ~= M.FORMAT or type(doc.parts) ~= 'table' then
        return nil, M.STATE .. ' is not a lunar trainer state'
    end
    if doc.step ~= marker.step then
        return nil, ('%s says step %s but the marker says %s'):format(M.STATE, tostring(doc.step), tostring(marker.step))
    end
    return marker, doc
end

-- the loaded checkpoint, or nil and the reason
local function try_load(dir, opts)
    local marker, doc = M.check(dir, opts)
    if not marker then return nil, doc end
    local out = {step = doc.step, dir = dir, rng = {}, time = marker.time, shards = doc.shards}
    if doc.model then out.model_dir = join(dir, doc.model) end
    local opened, read = {}, {}
    local ok, err = pcall(function()
        for _, part in ipairs(M.PARTS) do
            local e = doc.parts[part]
            if e ~= nil then
                local file
                if e.file then
                    file = lio.safetensors_open(join(dir, e.file))
                    opened[#opened + 1], read[e.file] = file, true
                end
                out[part] = decode(e.value, file, part)
            end
        end
        -- the other safetensors files it lists (the optimizer shards, a split model's pieces:
        -- read later, by every rank) have readable headers: large files carry no CRC in the
        -- marker, and a damaged one makes the checkpoint unsound now, not after resuming
        local rels = {}
        for rel in pairs(marker.files) do
            if rel:match('%.safetensors$') and not read[rel] then rels[#rels + 1] = rel end
        end
        table.sort(rels)
        for _, rel in ipairs(rels) do
            local f = lio.safetensors_open(join(dir, rel))
            f:close()
        end
    end)
    for _, f in ipairs(opened) do f:close() end
    if not ok then
        M.free(out)
        return nil, strip_where(err)
    end
    for k, s in pairs(doc.rng or {}) do out.rng[k] = s end
    return out
end

-- load(dir, {checksums = true}) -> {step=, dir=, model_dir=, optimizer=, scheduler=, data=,
-- metrics=, extra=, rng = {name = state}}. Tensors are zero-copy CPU views of the files (copy
-- them with copy_into; free them with free()). Raises naming the problem if the checkpoint is
-- incomplete or corrupt.
function M.load(dir, opts)
    if type(dir) ~= 'string' then fail('checkpoint.load: expected a directory, got ' .. type(dir)) end
    local out, why = try_load(dir, opts)
    if not out then fail(('checkpoint.load: %s: %s'):format(dir, why)) end
    return out
end

-- latest(root, {checksums = true, quiet = false}) -> the newest sound checkpoint loaded, or nil.
-- Unsound ones (no marker, truncated, corrupt, unreadable) are reported on stderr (unless quiet)
-- and in the second result {{dir=, reason=}, ...}; the search falls back to older ones.
function M.latest(root, opts)
    opts = opts or {}
    local list, temps = M.list(root)
    local skipped = {}
    for _, t in ipairs(temps) do
        skipped[#skipped + 1] = {dir = join(root, t), reason = 'a temporary directory (an interrupted save)'}
    end
    for _, c in ipairs(list) do
        local res, why = try_load(c.dir, opts)
        if res then
            res.skipped = skipped
            if not opts.quiet then
                for _, s in ipairs(skipped) do report(('ignoring %s: %s'):format(s.dir, s.reason)) end
            end
            return res, skipped
        end
        skipped[#skipped + 1] = {dir = c.dir, reason = why}
    end
    if not opts.quiet then
        for _, s in ipairs(skipped) do report(('ignoring %s: %s'):format(s.dir, s.reason)) end
    end
    return nil, skipped
end

-- load_shard(loaded, rank) -> the tensors of rank's optimizer shard (CPU copies), by name. Fails
-- naming the checkpoint when it has no shard for that rank (another number of ranks wrote it).
function M.load_shard(loaded, rank)
    local list = loaded.shards
    if type(list) ~= 'table' then
        fail(('checkpoint %s holds no optimizer shards (it was written by one rank, or without the distributed '
            .. 'optimizer)'):format(loaded.dir))
    end
    if not list[rank + 1] then
        fail(('checkpoint %s was written by %d ranks and has no optimizer shard for rank %d'):format(loaded.dir,
            #list, rank))
    end
    local f = lio.safetensors_open(join(loaded.dir, list[rank + 1]))
    local out = {}
    local ok, err = pcall(function()
        for _, key in ipairs(f:keys()) do out[key] = f:tensor(key):clone() end
    end)
    f:close()
    if not ok then error(err, 0) end
    return out
end

-- ---- restoring ----------------------------------------------------------------------------------

local function has_tensor(x)
    if is_tensor(x) then return true end
    if type(x) ~= 'table' then return false end
    for _, v in pairs(x) do if has_tensor(v) then return true end end
    return false
end

-- copy_into(dst, src): every tensor of src copied into the tensor at the same place in dst
-- (shapes must match; dtypes and devices may differ); numbers and strings are not touched.
-- Missing places raise, naming the path.
function M.copy_into(dst, src, where)
    where = where or 'state'
    if is_tensor(src) then
        if not is_tensor(dst) then fail(('checkpoint.copy_into: %s is a tensor in the checkpoint but not in the target'):format(where)) end
        local a, b = dst:size(), src:size()
        if #a ~= #b then fail(('checkpoint.copy_into: %s has shape (%s), the checkpoint (%s)'):format(where, table.concat(a, ', '), table.concat(b, ', '))) end
        for i = 1, #a do
            if a[i] ~= b[i] then fail(('checkpoint.copy_into: %s has shape (%s), the checkpoint (%s)'):format(where, table.concat(a, ', '), table.concat(b, ', '))) end
        end
        dst:copy_(src)
        return
    end
    if type(src) ~= 'table' then return end
    if type(dst) ~= 'table' then fail(('checkpoint.copy_into: %s is a table in the checkpoint but a %s in the target'):format(where, type(dst))) end
    for k, v in pairs(src) do
        if has_tensor(v) then
            if dst[k] == nil then fail(('checkpoint.copy_into: %s.%s is in the checkpoint but not in the target'):format(where, tostring(k))) end
            M.copy_into(dst[k], v, where .. '.' .. tostring(k))
        end
    end
end

-- restore_rng(loaded, {name = rng}): set_state on each stream from the checkpoint
function M.restore_rng(loaded, rngs)
    for k, r in pairs(rngs) do
        local s = loaded.rng and loaded.rng[k]
        if not s then fail(('checkpoint.restore_rng: the checkpoint has no rng stream %q'):format(tostring(k))) end
        r:set_state(s)
    end
end

-- free(loaded): frees every tensor the load created
function M.free(x)
    if is_tensor(x) then x:free() return end
    if type(x) == 'table' then for _, v in pairs(x) do M.free(v) end end
end

-- ---- the manager --------------------------------------------------------------------------------

local Manager = {}
Manager.__index = Manager

-- manager{dir=, every = 0 (0: only at the end), keep_last = 3 (0 keeps all), at_end = true,
--         checksum_max_bytes = 256 MiB, checksums = true (verify them on resume), quiet = false,
--         group = the data-parallel group (several ranks: see save)}
function M.manager(o)
    if type(o) ~= 'table' or type(o.dir) ~= 'string' then fail('checkpoint.manager: expected {dir = <directory>, ...}') end
    local every, keep = o.every or 0, o.keep_last or 3
    if type(every) ~= 'number' or every < 0 or every ~= math.floor(every) then fail('checkpoint.manager: every must be a non-negative integer') end
    if type(keep) ~= 'number' or keep < 0 or keep ~= math.floor(keep) then fail('checkpoint.manager: keep_last must be a non-negative integer') end
    return setmetatable({dir = o.dir, every = every, keep_last = keep, at_end = o.at_end ~= false,
        checksum_max_bytes = o.checksum_max_bytes, checksums = o.checksums, quiet = o.quiet,
        group = o.group, writer = o.group == nil or o.group:rank() == 0}, Manager)
end

-- due(step, is_last): a checkpoint belongs here (every N steps, and at the end)
function Manager:due(step, is_last)
    if self.every > 0 and step % self.every == 0 then return true end
    return (is_last and self.at_end) and true or false
end

-- prune(saved_step): keeps the newest keep_last sound checkpoints at or before saved_step (the
-- one just written always among them) and removes older ones. Only our own history is ranked:
-- a checkpoint with a later step (an earlier run's, or the timeline abandoned by resuming an
-- older step) is left in place with a warning, since deleting it could lose the only copy of
-- someone's work, and an unsound one (no marker, wrong sizes, unreadable state) is neither
-- counted nor removed, so a corrupt directory never pushes a good one out.
function Manager:prune(saved_step)
    if self.keep_last == 0 then return {} end
    local list = M.list(self.dir)
    local kept, removed = 0, {}
    for _, c in ipairs(list) do
        if saved_step and c.step > saved_step then
            self.warned = self.warned or {}
            if c.complete and not self.quiet and not self.warned[c.dir] then
                self.warned[c.dir] = true
                report(('%s has a later step than the save just written (%d); left in place, but '
                    .. 'resume=auto would choose it'):format(c.dir, saved_step))
            end
        -- (the save just written was checked as it was written)
        elseif c.complete and (c.step == saved_step or M.check(c.dir, {checksums = false})) then
            kept = kept + 1
            if kept > self.keep_last and c.step ~= saved_step then
                fs.remove_tree(c.dir)
                removed[#removed + 1] = c.dir
            end
        end
    end
    if #removed > 0 then fs.fsync(self.dir) end
    return removed
end

-- save(step, state[, shard[, model_shard]]) -> the checkpoint's directory, {bytes =}; older ones
-- are pruned. A manager made with group (data parallel): every rank calls it with its optimizer
-- shard (and its model pieces, when the model is split); rank 0 of the group alone cleans up and
-- prunes.
function Manager:save(step, state, shard, model_shard)
    if self.writer then clean_temps(self.dir, true) end
    local dir, info = M.save(self.dir, step, state, {checksum_max_bytes = self.checksum_max_bytes, group = self.group,
                                                     shard = shard, model_shard = model_shard})
    if self.writer then self:prune(step) end
    self.last_saved = step
    return dir, info
end

-- resume('auto' | <checkpoint directory> | 'none' | false | nil) -> loaded checkpoint or nil.
-- 'auto' falls back over unsound checkpoints; a named directory must be sound.
function Manager:resume(mode)
    if mode == nil or mode == false or mode == 'none' then return nil end
    if self.writer and fs.stat(self.dir) then clean_temps(self.dir, false) end
    local opts = {checksums = self.checksums, quiet = self.quiet}
    if mode == 'auto' then return M.latest(self.dir, opts) end
    if type(mode) ~= 'string' then fail("checkpoint.resume: expected 'auto', 'none' or a directory, got " .. type(mode)) end
    return M.load(mode, opts)
end

return M
