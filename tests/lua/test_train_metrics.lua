-- lunar.train.metrics: the TensorBoard golden file reproduced byte for byte (CRC-32C, TFRecord
-- framing, Event/Summary protobuf), the event records of a logged run decoded back by an
-- independent plain-Lua reader (CRCs checked), JSONL lines (one object per step, shortest
-- round-trip numbers, null for non-finite), rates / TFLOP/s / MFU from a fixed clock, skipped and
-- NaN counts, the summary over steps after warm-up, plain progress lines and the bar, resume
-- truncation of the JSONL, peak memory, and argument errors.
local T = require('lunar.testing').suite('train.metrics')
local metrics = require 'lunar.train.metrics'
local lio = require 'lunar.io'
local core = require 'lunar.core'
local fs, tb = core.fs, core.tb
local bit = require 'bit'

local here = debug.getinfo(1, 'S').source:match('^@(.*)/[^/]*$') or '.'
local GOLDEN = here .. '/../fixtures/tb/events.out.tfevents.1700000000.golden'

local base = os.tmpname()
os.remove(base)
fs.mkdir_p(base)

local function slurp(p)
    local f = assert(io.open(p, 'rb'))
    local s = f:read('*a')
    f:close()
    return s
end

-- ---- an independent reader: plain-Lua CRC-32C (bitwise), little-endian decoding, protobuf ------
local function crc32c_ref(s)
    local c = 0xFFFFFFFF
    for i = 1, #s do
        c = bit.bxor(c, s:byte(i))
        for _ = 1, 8 do
            if bit.band(c, 1) ~= 0 then c = bit.bxor(bit.rshift(c, 1), 0x82F63B78) else c = bit.rshift(c, 1) end
        end
    end
    c = bit.bnot(c)
    return c < 0 and c + 2 ^ 32 or c
end
local function masked_ref(c)
    local r = bit.bor(bit.rshift(c, 15), bit.lshift(c, 17))
    if r < 0 then r = r + 2 ^ 32 end
    return (r + 0xA282EAD8) % 2 ^ 32
end
local function le(s, i, n)
    local v = 0
    for k = n, 1, -1 do v = v * 256 + s:byte(i + k - 1) end
    return v
end
local function f64(s, i)   -- IEEE double from 8 LE bytes
    local lo, hi = le(s, i, 4), le(s, i + 4, 4)
    local sign = hi >= 2 ^ 31 and -1 or 1
    local e = math.floor(hi / 2 ^ 20) % 2048
    local m = (hi % 2 ^ 20) * 2 ^ 32 + lo
    if e == 0 then return sign * m * 2 ^ -1074 end
    if e == 2047 then return m == 0 and sign * math.huge or 0 / 0 end
    return sign * (1 + m / 2 ^ 52) * 2 ^ (e - 1023)
end
local function f32(s, i)
    local u = le(s, i, 4)
    local sign = u >= 2 ^ 31 and -1 or 1
    local e = math.floor(u / 2 ^ 23) % 256
    local m = u % 2 ^ 23
    if e == 0 then return sign * m * 2 ^ -149 end
    if e == 255 then return m == 0 and sign * math.huge or 0 / 0 end
    return sign * (1 + m / 2 ^ 23) * 2 ^ (e - 127)
end
local function varint(s, i)
    local v, mul = 0, 1
    while true do
        local b = s:byte(i)
        i = i + 1
        v = v + (b % 128) * mul
        mul = mul * 128
        if b < 128 then return v, i end
    end
end
-- fields of a message: list of {field, wire, value (number or string)}
local function fields(s)
    local out, i = {}, 1
    while i <= #s do
        local key
        key, i = varint(s, i)
        local field, wire = math.floor(key / 8), key % 8
        local v
        if wire == 0 then v, i = varint(s, i)
        elseif wire == 1 then v = s:sub(i, i + 7); i = i + 8
        elseif wire == 5 then v = s:sub(i, i + 3); i = i + 4
        elseif wire == 2 then
            local n
            n, i = varint(s, i)
            v = s:sub(i, i + n - 1)
            i = i + n
        else error('unexpected wire type ' .. wire) end
        out[#out + 1] = {field = field, wire = wire, value = v}
    end
    return out
end
-- events of a file: {wall=, step=, version=, session_status=, scalars = {tag = value}, tags = {in order}}
local function read_events(data)
    local events, i = {}, 1
    while i <= #data do
        local len = le(data, i, 8)
        local hcrc = le(data, i + 8, 4)
        if masked_ref(crc32c_ref(data:sub(i, i + 7))) ~= hcrc then error('length CRC mismatch at byte ' .. i) end
        local body = data:sub(i + 12, i + 12 + len - 1)
        local dcrc = le(data, i + 12 + len, 4)
        if masked_ref(crc32c_ref(body)) ~= dcrc then error('data CRC mismatch at byte ' .. i) end
        i = i + 16 + len
        local ev = {step = 0, scalars = {}, tags = {}}
        for _, f in ipairs(fields(body)) do
            if f.field == 1 then ev.wall = f64(f.value, 1)
            elseif f.field == 2 then ev.step = f.value
            elseif f.field == 3 then ev.version = f.value
            elseif f.field == 7 then
                for _, x in ipairs(fields(f.value)) do if x.field == 1 then ev.session_status = x.value end end
            elseif f.field == 5 then
                for _, vf in ipairs(fields(f.value)) do
                    local tag, val
                    for _, x in ipairs(fields(vf.value)) do
                        if x.field == 1 then tag = x.value elseif x.field == 2 then val = f32(x.value, 1) end
                    end
                    ev.scalars[tag] = val
                    ev.tags[#ev.tags + 1] = tag
                end
            end
        end
        events[#events + 1] = ev
    end
    return events
end

-- round to float32 (what simple_value holds), via the C encoder's bytes decoded by f32
local function to_f32(v)
    local rec = tb.scalars(0, 1, {'x'}, {v})
    return f32(rec, #rec - 7)
end

-- lists of strings
local function same(a, b, msg)
    local sa, sb = table.concat(a, '|'), table.concat(b, '|')
    if sa ~= sb then error(('%s: got %s, expected %s'):format(msg, sa, sb), 2) end
end

local function fake_clock(times)
    local i = 0
    return function()
        i = i + 1
        return times[i] or times[#times]
    end
end

T:test('CRC-32C: check value, C against a bitwise reference on random strings', function()
    T.equal(fs.crc32c('123456789'), 0xE3069283, 'crc32c("123456789")')
    T.equal(fs.crc32c(''), 0, 'empty')
    math.randomseed(5)
    for _, n in ipairs({1, 3, 7, 8, 9, 17, 1000}) do
        local b = {}
        for k = 1, n do b[k] = string.char(math.random(0, 255)) end
        local s = table.concat(b)
        T.equal(fs.crc32c(s), crc32c_ref(s), 'length ' .. n)
        -- continuing a CRC over two pieces equals the whole
        local cut = math.floor(n / 2)
        T.equal(fs.crc32c(s:sub(cut + 1), fs.crc32c(s:sub(1, cut))), crc32c_ref(s), 'continued, length ' .. n)
    end
    local p = base .. '/crc.bin'
    local f = assert(io.open(p, 'wb'))
    f:write(('lunar'):rep(300000))
    f:close()
    local crc, size = fs.crc32c_file(p)
    T.equal({crc, size}, {fs.crc32c(('lunar'):rep(300000)), 1500000}, 'crc32c_file')
end)

T:test('the golden event file is reproduced byte for byte', function()
    local golden = slurp(GOLDEN)
    local p = base .. '/events.out.tfevents.1700000000.golden'
    local w = metrics.tb_writer(p, {wall_time = 1700000000.0})
    for step, loss in ipairs({2.5, 2.25, 2.0}) do w:add_scalars(step, {'train/loss'}, {loss}, 1700000000.0 + step) end
    w:close()
    local mine = slurp(p)
    T.equal(#mine, #golden, 'length')
    if mine ~= golden then
        for i = 1, #golden do
            if mine:byte(i) ~= golden:byte(i) then error(('first difference at byte %d'):format(i - 1)) end
        end
    end
    -- and the independent reader decodes the golden file
    local ev = read_events(golden)
    T.equal(#ev, 4, 'records')
    if ev[1].version ~= 'brain.Event:2' then error('file_version ' .. tostring(ev[1].version)) end
    T.equal(ev[1].wall, 1700000000, 'header wall time')
    for k, loss in ipairs({2.5, 2.25, 2.0}) do
        T.equal({ev[k + 1].step, ev[k + 1].wall, ev[k + 1].scalars['train/loss']}, {k, 1700000000 + k, loss}, 'event ' .. k)
    end
    -- the formats.md example bytes of one value
    local rec = tb.scalars(1700000001.0, 1, {'train/loss'}, {2.5})
    local body = rec:sub(13, #rec - 4)
    local tail = body:sub(10)
    local want = '\16\1\42\19\10\17\10\10train/loss\21\0\0\32\64'
    if tail ~= want then error('event bytes after wall_time differ') end
end)

T:test('flops_devices: TFLOP/s and MFU per device, tokens/s the job\'s', function()
    local m = metrics.new{total_steps = 2, warmup_steps = 0, flops_per_token = 1e9, peak_flops = 1e12,
        flops_devices = 4, progress = false, summary = false, clock = fake_clock({10, 12, 14})}
    m:log(1, {loss = 1, tokens = 8000})
    local rec = m:log(2, {loss = 1, tokens = 8000})
    local s = m:summary()
    T.equal(s.tokens_per_s, 4000, 'tokens/s of the job')
    T.close(s.tflops, 4000 * 1e9 / 4 / 1e12, {rtol = 1e-14, atol = 0})
    T.close(s.mfu, 1.0, {rtol = 1e-14, atol = 0})
    assert(m:summary_text():find('TFLOP/s/device', 1, true), 'the summary says per device')
    m:close()
    T.equal(rec.tokens_per_s, 4000, 'a step\'s tokens/s')
end)

T:test('a logged run: JSONL lines and events (tags, steps, float32 values) agree', function()
    local dir = base .. '/run1'
    local clock = fake_clock({100, 102, 103, 105, 105.5, 106.5, 107.5})
    local sink = {}
    local out = {write = function(_, ...) for _, s in ipairs({...}) do sink[#sink + 1] = s end end, flush = function() end}
    local wall = 1700000000
    local m = metrics.new{dir = dir, total_steps = 5, warmup_steps = 2, flops_per_token = 1e9, peak_flops = 1e12,
        devices = 2, progress = 'lines', out = out, clock = clock,
        wall_time = function() wall = wall + 1; return wall end, tb_filename = 'events.out.tfevents.test'}
    local recs = {
        {loss = 4.0, grad_norm = 2.0, lr = 1e-4, tokens = 1000},
        {loss = 3.0, grad_norm = 1.0 / 3, lr = 2e-4, tokens = 1000},
        {loss = 0 / 0, grad_norm = math.huge, lr = 3e-4, tokens = 1000, skipped = true},
        {loss = 2.0, grad_norm = 0.5, lr = 3e-4, tokens = 1000, extra = {aux_loss = 0.125}},
        {loss = 1.5, grad_norm = 0.25, lr = 3e-4, tokens = 2000},
    }
    for s, r in ipairs(recs) do m:log(s, r) end
    local summary = m:close()
    -- step times from the clock: 2, 1, 2, 0.5, 1
    local dts = {2, 1, 2, 0.5, 1}
    local lines = {}
    for line in io.lines(dir .. '/metrics.jsonl') do lines[#lines + 1] = line end
    T.equal(#lines, 5, 'one line per step')
    for s, line in ipairs(lines) do
        local o = lio.decode_json(line)
        T.equal(o.step, s, 'step')
        T.equal(o.step_time_s, dts[s], 'step time')
        local tps = recs[s].tokens / dts[s] / 2
        T.equal(o.tokens_per_s, tps, 'tokens/s per device')
        T.close(o.tflops, tps * 1e9 / 1e12, {rtol = 1e-14, atol = 0})
        T.close(o.mfu, tps * 1e9 / 1e12, {rtol = 1e-14, atol = 0})
        if s ~= 3 then T.equal(o.loss, recs[s].loss, 'loss exact') end
        if s == 2 then T.equal(o.grad_norm, 1.0 / 3, 'shortest round trip keeps every bit') end
        T.equal(o.skipped_steps, s >= 3 and 1 or 0, 'skipped count')
        T.equal(o.nan_steps, s >= 3 and 1 or 0, 'nan count')
        T.equal(o.time, 1700000000 + s + 1, 'wall time')
        if o.peak_mem_bytes == nil or o.peak_mem_bytes <= 0 then error('no peak memory') end
    end
    if not lines[3]:find('"loss":null', 1, true) or not lines[3]:find('"skipped":true', 1, true) then
        error('non-finite loss is not null: ' .. lines[3])
    end
    if not lines[4]:find(',"aux_loss":0.125}', 1, true) then error('extra missing: ' .. lines[4]) end
    -- events
    local ev = read_events(slurp(dir .. '/tb/events.out.tfevents.test'))
    T.equal(#ev, 7, 'header + restart at step 1 + 5 events')
    if ev[1].version ~= 'brain.Event:2' then error('no header') end
    T.equal({ev[2].session_status, ev[2].step}, {1, 1}, 'SessionLog START at step 1')
    for s = 1, 5 do
        local e = ev[s + 2]
        T.equal(e.step, s, 'event step')
        local o = lio.decode_json(lines[s])
        for _, pair in ipairs({{'train/loss', 'loss'}, {'train/grad_norm', 'grad_norm'}, {'train/lr', 'lr'},
                               {'perf/tokens_per_s', 'tokens_per_s'}, {'perf/mfu', 'mfu'},
                               {'train/skipped_steps', 'skipped_steps'}, {'train/nan_steps', 'nan_steps'}}) do
            local got, want = e.scalars[pair[1]], o[pair[2]]
            if want == nil or lio.is_null(want) then
                want = recs[s][pair[2]]
                if want ~= want then
                    if got == got then error(('step %d %s: %s, expected nan'):format(s, pair[1], tostring(got))) end
                else T.equal(got, want, pair[1] .. ' non-finite') end
            else
                T.equal(got, to_f32(want), ('step %d %s'):format(s, pair[1]))
            end
        end
        T.close(e.scalars['mem/peak_gib'], o.peak_mem_bytes / 2 ^ 30, {rtol = 1e-6, atol = 0})
    end
    T.equal(ev[6].scalars['train/aux_loss'], 0.125, 'extra scalar')
    -- summary: warm-up 2 -> steps 3..5: 4000 tokens in 3.5 s over 2 devices
    T.equal({summary.steps, summary.initial_loss, summary.final_loss, summary.final_grad_norm}, {5, 4, 1.5, 0.25}, 'summary')
    T.equal({summary.skipped_steps, summary.nan_steps, summary.measured_steps, summary.total_tokens}, {1, 1, 3, 6000}, 'counts')
    T.close(summary.mean_step_time_s, 3.5 / 3, {rtol = 1e-15, atol = 0})
    T.close(summary.tokens_per_s, 4000 / 3.5 / 2, {rtol = 1e-15, atol = 0})
    T.close(summary.tflops, 4000 / 3.5 / 2 * 1e9 / 1e12, {rtol = 1e-14, atol = 0})
    T.close(summary.mfu, summary.tflops * 1e12 / 1e12, {rtol = 1e-14, atol = 0})
    -- what the user saw
    local text = table.concat(sink)
    for _, want in ipairs({'step 1/5 | loss 4.0000 | grad norm 2 | lr 1.000e-04 | 250 tok/s | 0.250 TFLOP/s | MFU 25.00%',
                           'step 3/5 | loss nan | grad norm inf', '| SKIPPED | NON-FINITE', 'step 5/5 | loss 1.5000',
                           'Run summary: 5 steps (1-5)', 'Initial loss', 'Final loss', '1.5\n',
                           '1,166.667 ms (mean of steps 3-5, after 2 warm-up steps)',
                           '571.429 tokens/s/device', 'MFU', '57.14% of 1.0 TFLOP/s peak', 'Skipped / NaN steps',
                           '1 / 1', 'Peak memory (process RSS)'}) do
        if not text:find(want, 1, true) then error(('output lacks %q:\n%s'):format(want, text)) end
    end
end)

T:test('progress bar, log_every, no output with progress = false and summary = false, the summary without progress', function()
    local sink = {}
    local out = {write = function(_, ...) for _, s in ipairs({...}) do sink[#sink + 1] = s end end, flush = function() end}
    local m = metrics.new{total_steps = 4, progress = 'bar', out = out, clock = fake_clock({0, 1, 2, 3, 4}), summary = false}
    for s = 1, 4 do m:log(s, {loss = 5 - s, lr = 1e-3, tokens = 100}) end
    m:close()
    local text = table.concat(sink)
    if not text:find('\r\27[Kstep 2/4 [##########..........]  50% | loss 3.0000 | lr 1.00e-03 | 100 tok/s | ETA 0:02', 1, true) then
        error('bar: ' .. text:gsub('\27', 'ESC'))
    end
    if text:sub(-1) ~= '\n' or text:find('Run summary', 1, true) then error('bar end: ' .. text) end
    -- lines every 2 steps (plus the first and the last)
    sink = {}
    m = metrics.new{total_steps = 5, progress = 'lines', log_every = 2, out = out, summary = false}
    for s = 1, 5 do m:log(s, {loss = 1}) end
    m:close()
    local steps = {}
    for s in table.concat(sink):gmatch('step (%d)/5') do steps[#steps + 1] = tonumber(s) end
    T.equal(steps, {1, 2, 4, 5}, 'printed steps')
    sink = {}
    m = metrics.new{progress = false, out = out, summary = false}
    m:log(1, {loss = 1})
    m:note('checkpoint step 1')
    m:close()
    T.equal(#sink, 0, 'silent')
    -- without progress lines (a quiet run) the summary is still printed at the end
    m = metrics.new{progress = false, out = out}
    m:log(1, {loss = 1})
    m:close()
    assert(table.concat(sink):find('Run summary: 1 step', 1, true), 'the summary of a quiet run')
end)

T:test('a resumed run drops the JSONL lines after start_step and appends', function()
    local dir = base .. '/run2'
    local m = metrics.new{dir = dir, progress = false, tensorboard = false}
    for s = 1, 6 do m:log(s, {loss = s}) end
    m:close()
    m = metrics.new{dir = dir, progress = false, tensorboard = false, start_step = 4}
    for s = 5, 7 do m:log(s, {loss = 10 * s}) end
    m:close()
    local got = {}
    for line in io.lines(dir .. '/metrics.jsonl') do
        local o = lio.decode_json(line)
        got[#got + 1] = o.step * 1000 + o.loss
    end
    T.equal(got, {1001, 2002, 3003, 4004, 5050, 6060, 7070}, 'steps and losses')
    if fs.stat(dir .. '/tb') then error('tensorboard = false still made tb/') end
end)

T:test('a resumed run and the skipped/NaN counts it continues; its event file opens with a restart', function()
    local dir = base .. '/run3'
    local m = metrics.new{dir = dir, progress = false, tb_filename = 'events.out.tfevents.1', start_step = 4,
                          counts = {skipped_steps = 2, nan_steps = 1}}
    m:log(5, {loss = 0 / 0, skipped = true})
    m:log(6, {loss = 1})
    T.equal({m:counts().skipped_steps, m:counts().nan_steps}, {3, 2}, 'counts continue')
    local s = m:close()
    T.equal({s.skipped_steps, s.nan_steps}, {3, 2}, 'summary')
    local ev = read_events(slurp(dir .. '/tb/events.out.tfevents.1'))
    assert(ev[1].version == 'brain.Event:2', 'header first')
    -- SessionLog{status = START} at the first resumed step: TensorBoard purges steps >= 5
    T.equal({ev[2].session_status, ev[2].step}, {1, 5}, 'restart event')
    T.equal({ev[3].step, ev[4].step}, {5, 6}, 'then the steps')
    T.raises(function() metrics.new{counts = {skipped_steps = -1}} end, 'counts.skipped_steps')
end)

T:test('peak memory, json numbers, errors', function()
    local p = metrics.process_peak_bytes()
    if not p or p < 1e6 then error('VmHWM: ' .. tostring(p)) end
    same({metrics.json_number(0.1), metrics.json_number(1 / 3), metrics.json_number(1e300), metrics.json_number(-2)},
         {'0.1', '0.3333333333333333', '1e+300', '-2'}, 'json numbers')
    same({metrics.json_number(0 / 0), metrics.json_number(math.huge)}, {'null', 'null'}, 'non-finite')
    same({metrics.commas(1234567.891, 2), metrics.commas(-999.5, 1), metrics.commas(1000)}, {'1,234,567.89', '-999.5', '1,000'}, 'commas')
    T.raises(function() metrics.new{progress = 'fancy'} end, "progress must be 'auto', 'bar', 'lines' or false")
    T.raises(function() metrics.new{peak_flops = 0} end, 'peak_flops must be a positive number')
    local m = metrics.new{progress = false}
    T.raises(function() m:log(1.5, {}) end, 'step must be an integer')
    T.raises(function() m:log(1, {loss = 'x'}) end, 'loss must be a number, got string')
    T.raises(function() m:log(1, {extra = {a = 'b'}}) end, 'extra must map names to numbers')
    T.raises(function() tb.scalars(0, 1, {'a', 'b'}, {1}) end, '2 tags but 1 values')
end)

local rc = T:run()
fs.remove_tree(base)
os.exit(rc)
