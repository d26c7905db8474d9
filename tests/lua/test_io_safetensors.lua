-- test_io_safetensors.lua: lunar.io from Lua: the golden safetensors file and index
-- (tests/fixtures, copied from the shared golden data), FP8 dequantisation on import,
-- import -> export -> import bit-identity (every dtype; a sharded checkpoint with >= 3 shards),
-- one test per malformed input (the message names the file and the problem), crash-safe
-- writes, views outliving their file, and JSON read/write.
local lunar = require 'lunar'
local lio = lunar.io
local T = require('lunar.testing').suite('io.safetensors')

lunar.manual_seed(7)

local here = debug.getinfo(1, 'S').source:match('^@(.*)/[^/]*$') or '.'
local FIX = here .. '/../fixtures/'
local GOLDEN = FIX .. 'tiny.safetensors'
local EXPECT = {0.5, -1, 1.5, 2, 0.25, 0.125, -0.5, 3}

local dir = os.tmpname()
os.remove(dir)
assert(os.execute("mkdir -p '" .. dir .. "'") == 0 or true)

-- T.equal for numbers, tables and tensors; plain == for strings, booleans and nil
local function eq(a, b, msg)
    local ta = type(a)
    if ta == 'table' or ta == 'userdata' or ta == 'number' then return T.equal(a, b, msg) end
    if a ~= b then error(('%s: got %s, expected %s'):format(msg, tostring(a), tostring(b)), 2) end
end

local function slurp(p)
    local f = io.open(p, 'rb')
    if not f then return nil end
    local s = f:read('*a')
    f:close()
    return s
end

local function spit(p, s)
    local f = assert(io.open(p, 'wb'))
    f:write(s)
    f:close()
end

local function u64le(n)
    local b = {}
    for i = 0, 7 do b[#b + 1] = string.char(math.floor(n / 2 ^ (8 * i)) % 256) end
    return table.concat(b)
end

-- a safetensors file from header text and data size (hlen overrides the length field)
local function make(name, header, data_len, hlen)
    local p = dir .. '/' .. name
    spit(p, u64le(hlen or #header) .. header .. string.rep('\0', data_len or 0))
    return p
end

local function same_tensor(a, b, msg)
    eq(a:dtype(), b:dtype(), msg .. ' dtype')
    eq(a:size(), b:size(), msg .. ' shape')
    eq(a:tolist_flat(), b:tolist_flat(), msg .. ' values')
end

T:test('golden file: four tensors, names, dtypes, shapes, values, metadata', function()
    local f = lio.safetensors_open(GOLDEN)
    eq(#f:keys(), 4, 'count')
    local keys = f:keys()
    eq(keys[1] == 'model.embed_tokens.weight' and keys[4] == 'model.norm.weight', true, 'sorted keys')
    local info = f:info('model.layers.0.mlp.down_proj.weight')
    eq(info.dtype == 'f8e4m3' and info.file_dtype == 'F8_E4M3', true, 'fp8 dtype')
    eq(info.shape, {2, 4}, 'fp8 shape')
    eq(info.data_offsets, {36, 44}, 'offsets')
    eq(f:info('nope') == nil, true, 'absent tensor info is nil')
    eq(f:metadata().format == 'pt', true, 'metadata')
    local emb = f:tensor('model.embed_tokens.weight')
    eq(emb:name(), 'model.embed_tokens.weight', 'view named after the tensor')
    eq(emb:dtype(), 'bf16', 'bf16')
    eq(emb:to('f32'):tolist_flat(), EXPECT, 'bf16 values')
    eq(f:tensor('model.norm.weight'):tolist_flat(), {1, 1, 1, 1}, 'norm')
    eq(f:tensor('model.layers.0.mlp.down_proj.weight_scale_inv'):tolist_flat(), {0.25}, 'scale')
    T.raises(function() f:tensor('nope') end, "no tensor 'nope'")
    f:close()
    T.raises(function() f:keys() end, 'used after close()')
end)

T:test('views outlive the file object; writes to a view never reach the file', function()
    local before = slurp(GOLDEN)
    local f = lio.safetensors_open(GOLDEN)
    local norm = f:tensor('model.norm.weight')
    f:close()
    collectgarbage()
    eq(norm:tolist_flat(), {1, 1, 1, 1}, 'readable after close')
    norm:fill_(5)                     -- copy-on-write: this process only
    eq(norm:tolist_flat(), {5, 5, 5, 5}, 'written')
    eq(slurp(GOLDEN) == before, true, 'file unchanged')
    norm:free()
end)

T:test('FP8 dequantisation on import equals the formula exactly (f32 and bf16), scale consumed', function()
    for _, dt in ipairs({'f32', 'bf16'}) do
        local w, meta, report = lio.load_checkpoint(GOLDEN, {dtype = dt})
        local q = w['model.layers.0.mlp.down_proj.weight']
        eq(q:dtype(), dt, dt .. ' dtype')
        eq(q:size(), {2, 4}, 'shape')
        eq(q:to('f32'):tolist_flat(), EXPECT, dt .. ' dequantised')
        eq(w['model.layers.0.mlp.down_proj.weight_scale_inv'] == nil, true, 'scale consumed')
        eq(w['model.embed_tokens.weight']:dtype(), dt, 'other floats converted')
        eq(meta.format, 'pt', 'metadata')
        eq(report.dequantized, {'model.layers.0.mlp.down_proj.weight'}, 'report')
    end
    -- default: views as stored, dequantised weights in bf16
    local w = lio.load_checkpoint(GOLDEN)
    eq(w['model.norm.weight']:dtype(), 'f32', 'stored dtype kept')
    eq(w['model.layers.0.mlp.down_proj.weight']:dtype(), 'bf16', 'default dequant dtype')
    -- dequantize_fp8 = false keeps both as stored
    w = lio.load_checkpoint(GOLDEN, {dequantize_fp8 = false})
    eq(w['model.layers.0.mlp.down_proj.weight']:dtype(), 'f8e4m3', 'kept fp8')
    eq(w['model.layers.0.mlp.down_proj.weight_scale_inv']:tolist_flat(), {0.25}, 'kept scale')
end)

T:test('golden index: the sharded form of the same checkpoint', function()
    local w = lio.load_checkpoint(FIX .. 'tiny.safetensors.index.json', {dtype = 'f32'})
    local n = 0
    for _ in pairs(w) do n = n + 1 end
    eq(n, 3, 'three tensors after the scale is consumed')
    eq(w['model.layers.0.mlp.down_proj.weight']:tolist_flat(), EXPECT, 'dequantised through the index')
    local idx = lio.read_json(FIX .. 'tiny.safetensors.index.json')
    eq(idx.metadata.total_size, 44, 'total_size')
end)

T:test('FP8 weights without a scale are kept and reported; a wrong scale shape names both tensors', function()
    local q = lunar.tensor({{1, 2}, {3, 4}}):to('f8e4m3')
    local p = dir .. '/noscale.safetensors'
    lio.save_safetensors(p, {['a.weight'] = q, ['b.weight'] = lunar.ones(3)})
    local w, _, report = lio.load_checkpoint(p, {quiet = true})
    eq(w['a.weight']:dtype(), 'f8e4m3', 'kept as stored')
    eq(report.fp8_without_scale, {'a.weight'}, 'reported')
    local bad = dir .. '/badscale.safetensors'
    lio.save_safetensors(bad, {['a.weight'] = lunar.zeros(300, 200):to('f8e4m3'), ['a.weight_scale_inv'] = lunar.ones(2, 3)})
    local err = T.raises(function() lio.load_checkpoint(bad) end, 'a.weight_scale_inv')
    eq(err:find('a.weight (300, 200)', 1, true) ~= nil and err:find('needs (3, 2)', 1, true) ~= nil
        and err:find(bad, 1, true) ~= nil, true, 'names file, both tensors and shapes: ' .. err)
end)

-- one tensor per dtype with arbitrary contents, plus a scalar, an empty tensor and views
local function every_dtype()
    local t = {}
    for _, dt in ipairs({'f32', 'f64', 'bf16', 'f16'}) do t['x.' .. dt] = (lunar.randn(3, 5) * 100):to(dt) end
    t['x.f8e4m3'] = (lunar.randn(4, 7) * 50):to('f8e4m3')
    t['x.f8e5m2'] = (lunar.randn(4, 7) * 50):to('f8e5m2')
    t['x.i8'] = lunar.randint(-128, 128, {17}, {dtype = 'i8'})
    t['x.u8'] = lunar.randint(0, 256, {2, 9}, {dtype = 'u8'})
    t['x.i32'] = lunar.randint(-2 ^ 31, 2 ^ 31, {5, 3}, {dtype = 'i32'})
    t['x.i64'] = lunar.randint(-2 ^ 40, 2 ^ 40, {1000}, {dtype = 'i64'})
    t['x.bool'] = lunar.randint(0, 2, {3, 3}, {dtype = 'bool'})
    t['scalar'] = lunar.tensor(2.5)
    t['empty'] = lunar.zeros(0, 4, {dtype = 'bf16'})
    t['transposed'] = lunar.randn(4, 6):t()
    t['narrowed'] = lunar.randn(10, 8):narrow(2, 3, 4)
    return t
end

T:test('every dtype: import -> export -> import is bit-identical (names, dtypes, shapes, bytes)', function()
    local src = every_dtype()
    local p1, p2 = dir .. '/all1.safetensors', dir .. '/all2.safetensors'
    lio.save_safetensors(p1, src)
    local a = lio.load_checkpoint(p1, {quiet = true})
    for name, t in pairs(src) do
        eq(a[name] ~= nil, true, name .. ' present')
        same_tensor(a[name], t, name)   -- views are written row-major
    end
    lio.save_safetensors(p2, a)
    eq(slurp(p1) == slurp(p2), true, 'export of the import is the same file, byte for byte')
    local b = lio.load_checkpoint(p2, {quiet = true})
    local n = 0
    for name, t in pairs(a) do
        same_tensor(b[name], t, name)
        n = n + 1
    end
    eq(n, 15, 'tensor count')
    -- the writer reproduces the golden file from its own tensors
    local g = lio.load_checkpoint(GOLDEN, {dequantize_fp8 = false})
    lio.save_safetensors(dir .. '/golden_copy.safetensors', g)
    eq(slurp(dir .. '/golden_copy.safetensors') == slurp(GOLDEN), true, 'golden rewritten byte for byte')
end)

T:test('sharded checkpoint (>= 3 shards): import -> export -> import is bit-identical', function()
    local src = {}
    for i = 0, 11 do
        local dt = ({'bf16', 'f32', 'f16'})[i % 3 + 1]
        src[('model.layers.%d.mlp.weight'):format(i)] = lunar.randn(8 + i, 33):to(dt)
    end
    src['model.embed_tokens.weight'] = lunar.randn(64, 33):to('bf16')
    local d1, d2 = dir .. '/ck1', dir .. '/ck2'
    lio.save_checkpoint(d1, src, {max_shard_bytes = 4000})
    local ck = lio.checkpoint_open(d1)
    local shards = ck:shards()
    eq(#shards >= 3, true, 'at least 3 shards, got ' .. #shards)
    eq(shards[1]:match('model%-00001%-of%-%d%d%d%d%d%.safetensors$') ~= nil, true, 'shard names')
    ck:close()
    local idx = lio.read_json(d1 .. '/model.safetensors.index.json')
    local total = 0
    for _, t in pairs(src) do total = total + t:numel() * ({bf16 = 2, f16 = 2, f32 = 4})[t:dtype()] end
    eq(idx.metadata.total_size, total, 'total_size')
    local a = lio.load_checkpoint(d1)
    for name, t in pairs(src) do same_tensor(a[name], t, name) end
    lio.save_checkpoint(d2, a, {max_shard_bytes = 4000})
    for _, f in ipairs(shards) do
        local base = f:match('[^/]+$')
        eq(slurp(d1 .. '/' .. base) == slurp(d2 .. '/' .. base), true, base .. ' identical')
    end
    eq(slurp(d1 .. '/model.safetensors.index.json') == slurp(d2 .. '/model.safetensors.index.json'), true,
        'index identical')
    local b = lio.load_checkpoint(d2 .. '/model.safetensors.index.json')
    for name, t in pairs(a) do same_tensor(b[name], t, name) end
    -- everything in one file when it fits; the old shards and index go away
    lio.save_checkpoint(d1, a)
    eq(slurp(d1 .. '/model.safetensors') ~= nil, true, 'single file')
    eq(slurp(d1 .. '/model.safetensors.index.json'), nil, 'index removed')
    eq(slurp(shards[1]), nil, 'old shards removed')
    local c = lio.load_checkpoint(d1)
    for name, t in pairs(a) do same_tensor(c[name], t, name) end
end)

-- malformed inputs: each must raise naming the file and the problem
local TENSOR_A = '"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}'
local BAD = {
    {'truncated file', function() local p = dir .. '/trunc.safetensors'; spit(p, slurp(GOLDEN):sub(1, 5)); return p end,
        'too short to hold the 8-byte header length'},
    {'truncated data', function() local p = dir .. '/trunc2.safetensors'; spit(p, slurp(GOLDEN):sub(1, 420)); return p end,
        'go past the end of the data'},
    {'header length past the end', function() return make('hlen.safetensors', '{}', 0, 4000) end,
        'header length 4000 goes past the end of the file'},
    {'header not JSON', function() return make('notjson.safetensors', '{"a": {"dtype": F32}}') end,
        'invalid JSON at line 1, column 17'},
    {'header not an object', function() return make('array.safetensors', '[1, 2]') end, 'not a JSON object'},
    {'overlapping offsets', function()
        return make('overlap.safetensors', '{' .. TENSOR_A .. ',"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}', 12)
    end, "tensor 'b' data_offsets [4, 12] overlap tensor 'a' [0, 8]"},
    {'out-of-bounds offsets', function() return make('oob.safetensors', '{' .. TENSOR_A .. '}', 4) end,
        "tensor 'a' data_offsets [0, 8] go past the end of the data (4 bytes)"},
    {'a hole', function()
        return make('hole.safetensors', '{' .. TENSOR_A .. ',"b":{"dtype":"F32","shape":[1],"data_offsets":[12,16]}}', 16)
    end, "hole in the data: bytes [8, 12) before tensor 'b'"},
    {'trailing bytes', function() return make('trail.safetensors', '{' .. TENSOR_A .. '}', 9) end, 'cover only 8'},
    {'unknown dtype', function()
        return make('dtype.safetensors', '{"a":{"dtype":"Q3","shape":[2],"data_offsets":[0,8]}}', 8)
    end, "tensor 'a' has unknown dtype 'Q3'"},
    {'shape/bytes mismatch', function()
        return make('mismatch.safetensors', '{"a":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,8]}}', 8)
    end, "tensor 'a' is BF16 (2, 3) = 12 bytes but its data_offsets [0, 8] span 8 bytes"},
    {'duplicate keys', function()
        return make('dup.safetensors', '{' .. TENSOR_A .. ',' .. TENSOR_A .. '}', 8)
    end, "duplicate key 'a' in the header"},
    {'metadata not strings', function() return make('meta.safetensors', '{"__metadata__":{"n":3}}') end,
        "__metadata__ must map strings to strings, but 'n' is 3"},
}

for _, case in ipairs(BAD) do
    T:test('bad input: ' .. case[1], function()
        local p = case[2]()
        local err = T.raises(function() lio.safetensors_open(p) end, case[3])
        eq(err:find(p, 1, true) ~= nil, true, 'names the file: ' .. err)
        -- load_checkpoint reports the same
        T.raises(function() lio.load_checkpoint(p) end, case[3])
    end)
end

T:test('bad input: unsupported dtype opens, its tensor names the dtype', function()
    local p = make('u16.safetensors', '{"a":{"dtype":"U16","shape":[2],"data_offsets":[0,4]}}', 4)
    local f = lio.safetensors_open(p)
    eq(f:info('a').supported, false, 'marked unsupported')
    eq(f:info('a').dtype, 'U16', 'dtype string')
    local err = T.raises(function() f:tensor('a') end, "tensor 'a' has unsupported dtype U16")
    eq(err:find(p, 1, true) ~= nil, true, 'names the file')
    f:close()
end)

T:test('bad input: index naming a missing shard; tensor missing from its shard', function()
    local d = dir .. '/broken'
    local src = {}
    for i = 1, 6 do src['w' .. i] = lunar.randn(20, 20) end
    lio.save_checkpoint(d, src, {max_shard_bytes = 3300})
    local idx = d .. '/model.safetensors.index.json'
    local text = slurp(idx)
    -- a tensor the index maps to a shard that does not hold it
    spit(idx, (text:gsub('"weight_map": {', '"weight_map": {\n    "ghost": "model-00001-of-00003.safetensors",', 1)))
    local err = T.raises(function() lio.load_checkpoint(d) end, "tensor 'ghost' is mapped to shard 'model-00001-of-00003.safetensors'")
    eq(err:find(idx, 1, true) ~= nil, true, 'names the index: ' .. err)
    -- a shard that does not exist
    spit(idx, text)
    os.remove(d .. '/model-00002-of-00003.safetensors')
    err = T.raises(function() lio.load_checkpoint(d) end, "shard 'model-00002-of-00003.safetensors'")
    eq(err:find('does not exist', 1, true) ~= nil and err:find(idx, 1, true) ~= nil, true, err)
    -- a directory without a checkpoint, a directory passed to safetensors_open, an index passed to it
    os.execute("mkdir -p '" .. dir .. "/emptydir'")
    T.raises(function() lio.load_checkpoint(dir .. '/emptydir') end, 'no model.safetensors.index.json')
    T.raises(function() lio.safetensors_open(d) end, 'is a directory')
    T.raises(function() lio.safetensors_open(idx) end, 'is an index file')
    T.raises(function() lio.safetensors_open(dir .. '/nothing.safetensors') end, 'cannot open')
end)

T:test('a write that dies midway leaves no file under the final name and the previous file intact', function()
    local big = {w = lunar.randn(300, 300)}
    -- no previous file: nothing appears
    local p = dir .. '/fresh.safetensors'
    T.raises(function() lio.save_safetensors(p, big, {_fail_after_bytes = 5000}) end, 'injected failure')
    eq(slurp(p), nil, 'no file under the final name')
    -- a previous file stays as it was
    local q = dir .. '/previous.safetensors'
    lio.save_safetensors(q, {w = lunar.ones(3)})
    local before = slurp(q)
    T.raises(function() lio.save_safetensors(q, big, {_fail_after_bytes = 5000}) end, q)
    eq(slurp(q) == before, true, 'previous file intact')
    -- a checkpoint save that fails midway: the index is written last, so none appears
    local d = dir .. '/ck_fail'
    T.raises(function() lio.save_checkpoint(d, {a = lunar.randn(100, 100), b = lunar.randn(100, 100)},
        {max_shard_bytes = 40000, _fail_after_bytes = 1000}) end, 'injected failure')
    eq(slurp(d .. '/model.safetensors.index.json'), nil, 'no index')
    eq(slurp(d .. '/model-00001-of-00002.safetensors'), nil, 'no shard')
end)

T:test('save errors: bad table, non-tensor values, metadata types', function()
    T.raises(function() lio.save_safetensors(dir .. '/x.safetensors', {a = 3}) end, 'a is a number, not a tensor')
    T.raises(function() lio.save_safetensors(dir .. '/x.safetensors', {lunar.ones(2)}) end, 'names must be strings')
    T.raises(function() lio.save_safetensors(dir .. '/x.safetensors', {a = lunar.ones(2)}, {metadata = {n = 1}}) end,
        'metadata must map strings to strings')
    local t = lunar.ones(2)
    t:free()
    T.raises(function() lio.save_safetensors(dir .. '/x.safetensors', {a = t}) end, 'free')
end)

T:test('JSON: read, null, arrays, errors with line and column, sorted atomic write', function()
    local p = dir .. '/cfg.json'
    spit(p, '{\n  "b": [1, 2.5, "x", null, true],\n  "a": {"z": {}, "e": []},\n  "n": null, "eps": 1e-05\n}\n')
    local t = lio.read_json(p)
    eq(t.b[1] == 1 and t.b[2] == 2.5 and t.b[3] == 'x' and t.b[4] == lio.null and t.b[5] == true, true, 'array')
    eq(#t.b, 5, 'null keeps its slot')
    eq(t.n == lio.null and lio.is_null(t.n), true, 'null sentinel')
    eq(t.eps, 1e-5, 'number')
    lio.write_json(p .. '.out', t)
    local out = slurp(p .. '.out')
    eq(out, '{\n  "a": {\n    "e": [],\n    "z": {}\n  },\n  "b": [\n    1,\n    2.5,\n    "x",\n    null,\n'
        .. '    true\n  ],\n  "eps": 1e-05,\n  "n": null\n}\n', 'sorted keys, indent 2, [] kept')
    local back = lio.read_json(p .. '.out')
    eq(back.b[2] == 2.5 and back.a.e ~= nil, true, 'round trip')
    spit(p, '{\n  "a": 1,\n  "b": [1, 2,,]\n}')
    local err = T.raises(function() lio.read_json(p) end, 'line 3, column')
    eq(err:find(p, 1, true) ~= nil, true, 'names the file')
    T.raises(function() lio.read_json(dir .. '/missing.json') end, 'cannot open')
    T.raises(function() lio.write_json(p, {a = 0 / 0}) end, 'a: NaN cannot be written')
    T.raises(function() lio.write_json(p, {a = {x = print}}) end, 'a.x: a function cannot be written')
    T.raises(function() lio.write_json(p, {a = {[1] = 1, x = 2}}) end, 'a: a table must be an array')
    eq(lio.encode_json(lio.array()), '[]\n', 'marked empty array')
    eq(lio.encode_json({1, {k = 'v"\n'}}), '[\n  1,\n  {\n    "k": "v\\"\\n"\n  }\n]\n', 'escapes')
    eq(lio.decode_json('{"x": [10000000000, -3]}').x[1], 1e10, 'decode')
    -- float literals stay floats: 1.0 is written back as 1.0, 1 as 1
    local c = lio.decode_json('{"f": 1.0, "i": 1, "l": [2.0, 3, 4.5e3], "s": "1.0", "n": {"e": 1E2}}')
    eq(lio.encode_json(c), '{\n  "f": 1.0,\n  "i": 1,\n  "l": [\n    2.0,\n    3,\n    4500.0\n  ],\n  "n": {\n'
        .. '    "e": 100.0\n  },\n  "s": "1.0"\n}\n', 'float literals kept')
    c.f, c.i = 2, 2
    eq(lio.encode_json(c):match('"f": [^,]*'), '"f": 2.0', 'a float field stays a float')
    eq(lio.encode_json(c):match('"i": [^,]*'), '"i": 2', 'an int field stays an int')
    eq(lio.encode_json(lio.mark_float({x = 3}, 'x')), '{\n  "x": 3.0\n}\n', 'mark_float')
end)

local rc = T:run()
os.execute("rm -rf '" .. dir .. "'")
os.exit(rc)
