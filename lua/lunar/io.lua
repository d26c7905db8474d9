-- lunar.io: safetensors files, Hugging Face checkpoints (one file or sharded), FP8 block
-- dequantisation on import, and JSON files.
--
--   local io = require('lunar').io
--   local f = io.safetensors_open('model.safetensors')
--   f:keys()                      -- sorted names
--   f:info(name)                  -- {dtype='bf16', file_dtype='BF16', shape={...}, nbytes=, file=} or nil
--   f:tensor(name)                -- zero-copy CPU view (copy-on-write), named after the tensor
--   f:metadata()                  -- __metadata__ as {str = str}
--   f:close()                     -- views stay valid; the file is unmapped when the last one goes
--
--   local w, meta, report = io.load_checkpoint(dir_or_file, {dtype=, device=, dequantize_fp8=true})
--   io.save_safetensors(path, {name = tensor}, {metadata = {format = 'pt'}})
--   io.save_checkpoint(dir, {name = tensor}, {max_shard_bytes = 5e9, metadata = {format = 'pt'}})
--   io.read_json(path), io.write_json(path, value), io.null, io.array(t)
--
-- Every error names the file and the problem; the C side (host/io) validates the whole header
-- before anything is returned. Writes are atomic (temporary file, fsync, rename).
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'

local C = core.io
local fail = tensor.fail
local is_tensor = tensor.is_tensor

local M = {}

-- JSON null as read by read_json (write_json writes it, and nil, as null)
M.null = C.null
function M.is_null(v) return v == C.null end
-- mark a table as a JSON array, so that an empty one is written as [] rather than {}
function M.array(t) return setmetatable(t or {}, C.array_mt) end

-- mark t[key] as a float, so that write_json writes 1 as 1.0 (read_json marks the numbers the
-- file wrote as floats this way; transformers' strict configs reject 1 where a float is due)
function M.mark_float(t, key)
    local mt = getmetatable(t)
    if mt == nil then
        mt = {}
        setmetatable(t, mt)
    elseif mt == C.array_mt then
        fail('mark_float: an empty JSON array has no members to mark')
    end
    mt.__json_floats = mt.__json_floats or {}
    mt.__json_floats[key] = true
    return t
end

M.read_json = C.read_json
M.write_json = C.write_json
M.write_file = C.write_file
-- decode_json(text[, what]) -> value; encode_json(value) -> text (sorted keys, indent 2)
M.decode_json = C.decode_json
M.encode_json = C.encode_json

-- One .safetensors file.
function M.safetensors_open(path)
    if type(path) ~= 'string' then fail('safetensors_open: expected a path, got ' .. type(path)) end
    return C.open(path, 'file')
end

-- A file, an index .json, or a directory (model.safetensors.index.json, else model.safetensors,
-- else its only .safetensors file); the same methods as safetensors_open's object, plus shards().
function M.checkpoint_open(path)
    if type(path) ~= 'string' then fail('checkpoint_open: expected a path, got ' .. type(path)) end
    return C.open(path, 'any')
end

-- {name = tensor} -> sorted names, tensors
local function collect(what, tensors)
    if type(tensors) ~= 'table' then fail(what .. ': expected a table {name = tensor}, got ' .. type(tensors)) end
    local names = {}
    for k, v in pairs(tensors) do
        if type(k) ~= 'string' then fail(('%s: tensor names must be strings, got a %s key'):format(what, type(k))) end
        if not is_tensor(v) then fail(('%s: %s is a %s, not a tensor'):format(what, k, type(v))) end
        names[#names + 1] = k
    end
    table.sort(names)
    local list = {}
    for i, k in ipairs(names) do list[i] = tensors[k] end
    return names, list
end

local DEFAULT_META = {format = 'pt'}   -- what transformers writes and checks for

-- save_safetensors(path, {name = tensor}, {metadata = {str = str}}): any dtype, any device, any
-- view (written row-major). opts._fail_after_bytes / _fail_kill are the crash tests' hooks.
function M.save_safetensors(path, tensors, opts)
    opts = opts or {}
    local names, list = collect('save_safetensors', tensors)
    C.save_safetensors(path, names, list, opts.metadata or DEFAULT_META, opts._fail_after_bytes, opts._fail_kill)
end

-- save_checkpoint(dir, {name = tensor}, {max_shard_bytes = 5e9, metadata = {format = 'pt'}}):
-- model.safetensors, or model-NNNNN-of-NNNNN.safetensors shards (in name order, split before the
-- tensor that would overflow a shard) plus model.safetensors.index.json.
function M.save_checkpoint(dir, tensors, opts)
    opts = opts or {}
    local names, list = collect('save_checkpoint', tensors)
    C.save_checkpoint(dir, names, list, opts.max_shard_bytes or 5e9, opts.metadata or DEFAULT_META,
        opts._fail_after_bytes, opts._fail_kill)
end

local FLOAT = {f32 = true, f64 = true, bf16 = true, f16 = true}
local FP8 = {f8e4m3 = true, f8e5m2 = true}

local function load_all(ck, opts)
    local ops = require('lunar.ops')
    local names = ck:keys()
    local info, out = {}, {}
    for _, name in ipairs(names) do info[name] = ck:info(name) end
    local report = {dequantized = {}, fp8_without_scale = {}}
    local dequantize = opts.dequantize_fp8 ~= false
    local fp8_dtype = opts.dtype or 'bf16'
    if not FLOAT[fp8_dtype] then fail(('load_checkpoint: dtype %s is not a float dtype'):format(tostring(fp8_dtype))) end
    local consumed = {}
    local bm, bn = 128, 128
    if opts.fp8_block ~= nil then
        local b = opts.fp8_block
        if type(b) ~= 'table' or type(b[1]) ~= 'number' or type(b[2]) ~= 'number' or b[1] < 1 or b[2] < 1
            or b[1] ~= math.floor(b[1]) or b[2] ~= math.floor(b[2]) then
            fail('load_checkpoint: fp8_block must be two positive integers {rows, cols}')
        end
        bm, bn = b[1], b[2]
    end
    -- FP8 weights: a 1-byte float with a sibling <name>_scale_inv (DeepSeek's rule)
    for _, name in ipairs(names) do
        if FP8[info[name].dtype] then
            local sname = name .. '_scale_inv'
            if not info[sname] then
                report.fp8_without_scale[#report.fp8_without_scale + 1] = name
            elseif dequantize then
                local qi, si = info[name], info[sname]
                local want1, want2 = math.ceil((qi.shape[1] or 0) / bm), math.ceil((qi.shape[2] or 0) / bn)
                if #qi.shape ~= 2 or #si.shape ~= 2 or si.shape[1] ~= want1 or si.shape[2] ~= want2 then
                    fail(('load_checkpoint: %s: scale %s has shape (%s) but FP8 weight %s (%s) with %dx%d blocks '
                        .. 'needs (%d, %d)'):format(si.file, sname, table.concat(si.shape, ', '), name,
                        table.concat(qi.shape, ', '), bm, bn, want1, want2))
                end
                local q, s = ck:tensor(name), ck:tensor(sname)
                local qd, sd = q, s
                if opts.device then qd, sd = q:to(opts.device), s:to(opts.device) end
                out[name] = ops.fp8_block_dequant(qd, sd, {dtype = fp8_dtype, block = {bm, bn}})
                q:free()
                s:free()
                consumed[sname] = true
                report.dequantized[#report.dequantized + 1] = name
            end
        end
    end
    for _, name in ipairs(names) do
        if not out[name] and not consumed[name] then
            local t = ck:tensor(name)
            local want = {}
            if opts.dtype and FLOAT[t:dtype()] and t:dtype() ~= opts.dtype then want.dtype = opts.dtype end
            if opts.device and t:device() ~= opts.device then want.device = opts.device end
            if want.dtype or want.device then
                local c = t:to(want)
                c:set_name(name)
                t:free()
                t = c
            end
            out[name] = t
        end
    end
    if #report.fp8_without_scale > 0 and not opts.quiet then
        io.stderr:write(('lunar.io.load_checkpoint: %s: %d FP8 tensor(s) have no _scale_inv and were kept as they '
            .. 'are (e.g. %s); see the report (third result)\n'):format(ck:path(), #report.fp8_without_scale,
            report.fp8_without_scale[1]))
    end
    return out, ck:metadata(), report
end

-- load_checkpoint(path, {dtype=, device=, dequantize_fp8=true, fp8_block={128, 128}, quiet=false})
--   -> {name = tensor}, metadata ({str = str} of the shards), report
-- path: a .safetensors file, an index .json, or a directory. Without dtype/device the tensors are
-- zero-copy views of the files; with dtype, floating tensors (not FP8 ones) are converted.
-- FP8 weights with a <name>_scale_inv sibling are dequantised in fp8_block blocks (the config's
-- quantization_config.weight_block_size; 128x128 by default) into dtype (bf16
-- when no dtype is given) and the scale tensors are consumed; FP8 weights without a scale are
-- kept as stored and listed in report.fp8_without_scale (and on stderr unless quiet). report.
-- dequantized lists the dequantised names. dequantize_fp8=false keeps weights and scales as
-- stored.
function M.load_checkpoint(path, opts)
    opts = opts or {}
    if type(path) ~= 'string' then fail('load_checkpoint: expected a path, got ' .. type(path)) end
    local ck = C.open(path, 'any')
    local res = {pcall(load_all, ck, opts)}
    ck:close()
    if not res[1] then error(res[2], 0) end
    return res[2], res[3], res[4]
end

return M
