-- lunar.train.checkpoint: save/load round trip (tensors of several dtypes and views, scalars,
-- non-finite numbers, nested tables, RNG streams, a real model through save_hf), the layout,
-- keep-last-K, due(), resume('auto') falling back over unsound checkpoints (no marker,
-- truncated, corrupt, unreadable state, temporary directories), and argument errors. The kill
-- during a write is tests/sh/test_ckpt_kill.sh.
local lunar = require 'lunar'
local T = require('lunar.testing').suite('train.checkpoint')
local ckpt = require 'lunar.train.checkpoint'
local lio = require 'lunar.io'
local fs = require('lunar.core').fs

local here = debug.getinfo(1, 'S').source:match('^@(.*)/[^/]*$') or '.'
local FIX = here .. '/../fixtures/'

local base = os.tmpname()
os.remove(base)
fs.mkdir_p(base)
local counter = 0
local function fresh_dir()
    counter = counter + 1
    local d = ('%s/run%d'):format(base, counter)
    fs.remove_tree(d)
    return d
end

local function slurp(p)
    local f = assert(io.open(p, 'rb'))
    local s = f:read('*a')
    f:close()
    return s
end
local function spit(p, s)
    local f = assert(io.open(p, 'wb'))
    f:write(s)
    f:close()
end

local function names(dir)
    local out = {}
    for _, n in ipairs(fs.list(dir) or {}) do out[#out + 1] = n end
    return table.concat(out, ' ')
end

-- a small training state: optimizer moments of two parameters (f32, bf16, a transposed view),
-- an i64 tensor, scalars with inf/nan, arrays and nested tables
local function make_state(step, rng)
    local w1 = lunar.randn(3, 5)
    local m2 = lunar.randn(4, 2):t()            -- a non-contiguous view (2, 4)
    local v2 = lunar.randn(7):to('bf16')
    local state = {
        optimizer = {
            tensors = {['model.layers.0.w'] = {exp_avg = w1, exp_avg_sq = w1:mul(w1)},
                       ['model.norm.weight'] = {exp_avg = m2, exp_avg_sq = v2}},
            scalars = {step = step, lr = 3e-4, betas = {0.9, 0.95}, best = math.huge, worst = -math.huge, odd = 0 / 0},
        },
        scheduler = {kind = 'cosine', warmup = 10, last_lr = 2.5e-4},
        data = {epoch = 2, index = 17, order_seed = 1234, shards = {'a.bin', 'b.bin'}, counts = lunar.tensor({1, 2, 3}, 'i64')},
        metrics = {loss = 2.5, grad_norm = 0.75},
        extra = {note = 'hello', flag = false},
        rng = {data = rng},
        save_model = function(dir)
            lio.save_safetensors(dir .. '/model.safetensors', {w = lunar.ones(2, 2)})
            lio.write_json(dir .. '/config.json', {hidden_size = 2})
        end,
    }
    return state
end

T:test('save/load round trip: tensors, scalars, non-finite numbers, RNG streams, layout', function()
    local root = fresh_dir()
    local rng = lunar.rng(42):split('data')
    rng:uniform_(lunar.empty(10))               -- advance it
    local state = make_state(7, rng)
    local dir = ckpt.save(root, 7, state)
    T.equal(dir == root .. '/step_000007' and 1 or 0, 1, 'directory name')
    -- nothing else in root: no temporary directory left
    if names(root) ~= 'step_000007' then error('root holds: ' .. names(root)) end
    local files = names(dir)
    if files ~= 'COMPLETE.json data.safetensors model optimizer.safetensors trainer_state.json' then
        error('layout: ' .. files)
    end
    if names(dir .. '/model') ~= 'config.json model.safetensors' then error('model dir: ' .. names(dir .. '/model')) end
    local marker = lio.read_json(dir .. '/COMPLETE.json')
    T.equal(marker.step, 7, 'marker step')
    T.equal(marker.files['optimizer.safetensors'].size, fs.stat(dir .. '/optimizer.safetensors').size, 'marker size')
    T.equal(marker.files['model/model.safetensors'].crc32c, (fs.crc32c_file(dir .. '/model/model.safetensors')), 'marker crc')
    if marker.files['COMPLETE.json'] then error('the marker lists itself') end

    -- what comes after the save, from the live stream
    local after = lunar.empty(6)
    rng:uniform_(after)

    local st = ckpt.load(dir)
    T.equal(st.step, 7, 'step')
    T.equal(st.model_dir == dir .. '/model' and 1 or 0, 1, 'model_dir')
    local o, so = state.optimizer, st.optimizer
    T.equal(so.tensors['model.layers.0.w'].exp_avg, o.tensors['model.layers.0.w'].exp_avg, 'exp_avg f32')
    T.equal(so.tensors['model.layers.0.w'].exp_avg_sq, o.tensors['model.layers.0.w'].exp_avg_sq, 'exp_avg_sq f32')
    T.equal(so.tensors['model.norm.weight'].exp_avg, o.tensors['model.norm.weight'].exp_avg, 'transposed view')
    T.equal(so.tensors['model.norm.weight'].exp_avg:size(), {2, 4}, 'view shape')
    T.equal(so.tensors['model.norm.weight'].exp_avg_sq:dtype() == 'bf16' and 1 or 0, 1, 'bf16 kept')
    T.equal(so.tensors['model.norm.weight'].exp_avg_sq:float(), o.tensors['model.norm.weight'].exp_avg_sq:float(), 'bf16 values')
    T.equal(st.data.counts:dtype() == 'i64' and 1 or 0, 1, 'i64 kept')
    T.equal(st.data.counts, {1, 2, 3}, 'i64 values')
    T.equal(so.scalars.step, 7, 'scalar step')
    T.equal(so.scalars.lr, 3e-4, 'lr exact')
    T.equal(so.scalars.betas, {0.9, 0.95}, 'array')
    T.equal(so.scalars.best, math.huge, '+inf')
    T.equal(so.scalars.worst, -math.huge, '-inf')
    if so.scalars.odd == so.scalars.odd then error('nan came back as ' .. tostring(so.scalars.odd)) end
    T.equal(st.scheduler.warmup, 10, 'scheduler')
    if st.scheduler.kind ~= 'cosine' then error('scheduler kind') end
    T.equal(st.data.index, 17, 'data position')
    if st.data.shards[2] ~= 'b.bin' then error('data shards') end
    T.equal(st.metrics.loss, 2.5, 'metrics')
    if st.extra.note ~= 'hello' or st.extra.flag ~= false then error('extra') end

    -- the RNG stream continues exactly where it was saved
    local r2 = lunar.rng(999)
    ckpt.restore_rng(st, {data = r2})
    local again = lunar.empty(6)
    r2:uniform_(again)
    T.equal(again, after, 'rng continues')
    T.raises(function() ckpt.restore_rng(st, {dropout = r2}) end, 'no rng stream "dropout"')

    -- copy_into the live tensors (different values, same shapes)
    local live = {tensors = {['model.layers.0.w'] = {exp_avg = lunar.zeros(3, 5), exp_avg_sq = lunar.zeros(3, 5)},
                             ['model.norm.weight'] = {exp_avg = lunar.zeros(2, 4), exp_avg_sq = lunar.zeros(7)}}}
    ckpt.copy_into(live, so)
    T.equal(live.tensors['model.layers.0.w'].exp_avg, o.tensors['model.layers.0.w'].exp_avg, 'copied')
    T.close(live.tensors['model.norm.weight'].exp_avg_sq, o.tensors['model.norm.weight'].exp_avg_sq:float(), {rtol = 0, atol = 0})
    T.raises(function() ckpt.copy_into({tensors = {['model.layers.0.w'] = {exp_avg = lunar.zeros(5, 3), exp_avg_sq = lunar.zeros(3, 5)}}},
        {tensors = {['model.layers.0.w'] = so.tensors['model.layers.0.w']}}) end, 'has shape (5, 3), the checkpoint (3, 5)')
    T.raises(function() ckpt.copy_into({}, so) end, 'state.tensors is in the checkpoint but not in the target')
    ckpt.free(st)
end)

T:test('a real model: save_hf as save_model, reloaded bit for bit', function()
    local root = fresh_dir()
    local model = lunar.model.load(FIX .. 'models/glm5_dsa')
    local dir = ckpt.save(root, 3, {save_model = function(d) model:save_hf(d) end, optimizer = {step = 3}})
    local st = ckpt.load(dir)
    local m2 = lunar.model.load(st.model_dir)
    local n = 0
    for name in model.params:names() do
        T.equal(m2.params:get(name), model.params:get(name), name)
        n = n + 1
    end
    if n < 10 then error('too few parameters compared: ' .. n) end
    -- unchanged weights export to the same bytes as the fixture
    if slurp(st.model_dir .. '/model.safetensors') ~= slurp(FIX .. 'models/glm5_dsa/model.safetensors') then
        error('model.safetensors differs from the fixture')
    end
end)

T:test('keep_last keeps the newest K complete checkpoints; due() every N and at the end', function()
    local root = fresh_dir()
    local cm = ckpt.manager{dir = root, every = 2, keep_last = 2}
    local rng = lunar.rng(1)
    local saved = {}
    for step = 1, 9 do
        if cm:due(step, step == 9) then
            cm:save(step, {optimizer = {m = lunar.full({3}, step)}, rng = {data = rng}})
            saved[#saved + 1] = step
        end
    end
    T.equal(saved, {2, 4, 6, 8, 9}, 'due steps')
    if names(root) ~= 'step_000008 step_000009' then error('kept: ' .. names(root)) end
    local st = cm:resume('auto')
    T.equal(st.step, 9, 'latest')
    T.equal(st.optimizer.m, {9, 9, 9}, 'latest values')
    ckpt.free(st)
    -- an incomplete directory does not count towards K and is left alone
    fs.mkdir_p(root .. '/step_000010')
    cm:save(11, {optimizer = {m = lunar.full({3}, 11)}})
    if names(root) ~= 'step_000009 step_000010 step_000011' then error('kept: ' .. names(root)) end
    -- keep_last = 0 keeps everything
    local root2 = fresh_dir()
    local all = ckpt.manager{dir = root2, every = 1, keep_last = 0}
    for step = 1, 4 do all:save(step, {metrics = {loss = step}}) end
    if names(root2) ~= 'step_000001 step_000002 step_000003 step_000004' then error('keep all: ' .. names(root2)) end
    -- every = 0: only at the end
    local last = ckpt.manager{dir = root2}
    T.equal({last:due(5, false) and 1 or 0, last:due(6, true) and 1 or 0}, {0, 1}, 'every = 0')
end)

T:test('keep_last never removes the save just written; later or unsound checkpoints are not ranked', function()
    local root = fresh_dir()
    -- an earlier run left later steps behind, one of them corrupt
    ckpt.save(root, 50, {metrics = {loss = 50}})
    ckpt.save(root, 60, {metrics = {loss = 60}})
    local cm = ckpt.manager{dir = root, every = 1, keep_last = 2, quiet = true}
    for step = 1, 4 do cm:save(step, {metrics = {loss = step}, optimizer = {m = lunar.full({8}, step)}}) end
    if names(root) ~= 'step_000003 step_000004 step_000050 step_000060' then error('kept: ' .. names(root)) end
    -- a marked but truncated checkpoint does not count towards K and is not removed
    local bad = root .. '/step_000004/' .. ckpt.STATE
    spit(bad, slurp(bad):sub(1, 10))
    cm:save(5, {metrics = {loss = 5}})
    if names(root) ~= 'step_000003 step_000004 step_000005 step_000050 step_000060' then error('kept: ' .. names(root)) end
    cm:save(6, {metrics = {loss = 6}})
    if names(root) ~= 'step_000004 step_000005 step_000006 step_000050 step_000060' then error('kept: ' .. names(root)) end
    T.equal(ckpt.load(root .. '/step_000006').metrics.loss, 6, 'the save just written')
end)

T:test('saving the same step again replaces it atomically', function()
    local root = fresh_dir()
    ckpt.save(root, 4, {metrics = {loss = 1}})
    ckpt.save(root, 4, {metrics = {loss = 2}})
    if names(root) ~= 'step_000004' then error('root: ' .. names(root)) end
    T.equal(ckpt.load(root .. '/step_000004').metrics.loss, 2, 'the new one')
end)

T:test("resume('auto') falls back over unsound checkpoints and reports them", function()
    local root = fresh_dir()
    local cm = ckpt.manager{dir = root, every = 1, keep_last = 0, quiet = true}
    T.equal(cm:resume('auto') == nil and 1 or 0, 1, 'nothing yet: nil')
    for step = 1, 6 do
        cm:save(step, {optimizer = {m = lunar.full({1000}, step)}, metrics = {loss = step},
                       save_model = function(d) spit(d .. '/weights.bin', ('x'):rep(100 + step)) end})
    end
    local function latest()
        local st, skipped = cm:resume('auto')
        local reasons = {}
        for _, s in ipairs(skipped) do reasons[#reasons + 1] = s.dir:match('[^/]+$') .. ': ' .. s.reason end
        return st, table.concat(reasons, '\n')
    end
    -- 6: marker missing (killed before the marker)
    os.remove(root .. '/step_000006/COMPLETE.json')
    -- 5: optimizer file truncated
    local opt5 = root .. '/step_000005/optimizer.safetensors'
    local bytes = slurp(opt5)
    spit(opt5, bytes:sub(1, #bytes - 100))
    -- 4: one byte of the model changed (same size)
    local w4 = root .. '/step_000004/model/weights.bin'
    spit(w4, 'y' .. slurp(w4):sub(2))
    -- 3: trainer_state.json replaced by garbage of the same size
    local s3 = root .. '/step_000003/trainer_state.json'
    spit(s3, ('{'):rep(#slurp(s3)))
    -- a temporary directory of a live writer (our own pid is alive) and one of a dead one
    fs.mkdir_p(('%s/.tmp.step_000007.%d/model'):format(root, fs.getpid()))
    local st, why = latest()
    T.equal(st.step, 2, 'fell back to step 2')
    T.equal(st.optimizer.m:get(1), 2, 'its values')
    for _, want in ipairs({'step_000006: no COMPLETE.json marker', 'step_000005: optimizer.safetensors has',
                           'step_000004: model/weights.bin is corrupt (CRC-32C', 'step_000003: trainer_state.json is corrupt',
                           '.tmp.step_000007.'}) do
        if not why:find(want, 1, true) then error(('reasons lack %q:\n%s'):format(want, why)) end
    end
    -- with checksums off the same-size corruptions are found only when a file is read
    local loose = ckpt.manager{dir = root, checksums = false, quiet = true}
    local st2, why2 = loose:resume('auto')
    T.equal(st2.step, 4, 'without checksums the changed model byte goes unnoticed')
    if not why2[1] then error('expected reports') end
    -- a named checkpoint must be sound
    T.raises(function() cm:resume(root .. '/step_000005') end, 'optimizer.safetensors has')
    T.raises(function() ckpt.load(root .. '/step_000006') end, 'no COMPLETE.json marker')
    -- a corrupt safetensors header with a matching size and no checksum is caught by the reader
    local root2 = fresh_dir()
    ckpt.save(root2, 1, {optimizer = {m = lunar.ones(4)}})
    ckpt.save(root2, 2, {optimizer = {m = lunar.ones(4)}}, {checksum_max_bytes = 0})
    local p = root2 .. '/step_000002/optimizer.safetensors'
    local b = slurp(p)
    spit(p, b:sub(1, 8) .. '#' .. b:sub(10))
    local st3, why3 = ckpt.latest(root2, {quiet = true})
    T.equal(st3.step, 1, 'bad header: fell back')
    if not why3[1].reason:find('optimizer.safetensors', 1, true) then error(why3[1].reason) end
end)

T:test('temporary directories of dead writers are removed on resume', function()
    local root = fresh_dir()
    ckpt.save(root, 1, {metrics = {loss = 1}})
    -- pid 2^22 + 12345 is above the usual pid_max; if it exists the test cannot tell
    local dead = 4194304 + 12345
    if fs.pid_alive(dead) then return end
    fs.mkdir_p(('%s/.tmp.step_000002.%d/model'):format(root, dead))
    local st = ckpt.manager{dir = root, quiet = true}:resume('auto')
    T.equal(st.step, 1, 'resumed')
    if names(root) ~= 'step_000001' then error('left: ' .. names(root)) end
end)

T:test('errors name the problem', function()
    local root = fresh_dir()
    T.raises(function() ckpt.save(root, 1, {optimiser = {}}) end, 'unknown state field "optimiser"')
    T.raises(function() ckpt.save(root, -1, {}) end, 'step must be a non-negative integer')
    T.raises(function() ckpt.save(root, 1, {save_model = 'x'}) end, 'save_model must be a function')
    T.raises(function() ckpt.save(root, 1, {rng = {data = 5}}) end, 'rng.data must be a lunar.rng stream')
    T.raises(function() ckpt.save(root, 1, {optimizer = {f = print}}) end, 'optimizer.f: a function cannot be saved')
    T.raises(function() ckpt.save(root, 1, {optimizer = {1, 2, x = 3}}) end, 'array or have string keys, not both')
    local loop = {}
    loop.self = loop
    T.raises(function() ckpt.save(root, 1, {extra = loop}) end, 'the table contains itself')
    -- a failing save_model leaves nothing behind
    T.raises(function() ckpt.save(root, 1, {save_model = function() error('disk full') end}) end, 'disk full')
    if names(root) ~= '' then error('left behind: ' .. names(root)) end
    T.raises(function() ckpt.manager{dir = root, every = -1} end, 'every must be a non-negative integer')
    T.raises(function() ckpt.manager{} end, 'expected {dir = <directory>')
end)

local rc = T:run()
fs.remove_tree(base)
os.exit(rc)
