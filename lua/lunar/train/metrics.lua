-- lunar.train.metrics: per-step training metrics as JSONL and TensorBoard event files, a
-- progress bar (or plain lines), and the end-of-run summary.
--
--   local metrics = require 'lunar.train.metrics'
--   local flops = require 'lunar.model.flops'
--   local m = metrics.new{dir = 'runs/sft', total_steps = 100, warmup_steps = 10,
--       flops_per_token = flops.training_per_token(cfg, seq_len), peak_flops = 989e12}
--   for step = 1, 100 do
--       ... forward, backward, optimizer ...
--       m:log(step, {loss = loss, grad_norm = gn, lr = lr, tokens = B * T, skipped = not ok})
--   end
--   m:close()                     -- prints the summary; m:summary() returns it as a table
--
-- new{} options:
--   dir            where metrics.jsonl and tb/ go (nil: no files unless jsonl / tensorboard say)
--   jsonl          path of the JSONL file (default <dir>/metrics.jsonl; false: none)
--   tensorboard    directory of the event file (default <dir>/tb; false: none)
--   total_steps    for the progress bar, the ETA and the summary
--   start_step     the step a resumed run starts after: JSONL lines of later steps (written by
--                  the run that was interrupted) are dropped before appending
--   counts         {skipped_steps =, nan_steps =} the counters continue from (a resumed run
--                  passes what m:counts() returned when its checkpoint was written)
--   warmup_steps   steps left out of the summary's means (default min(10, total_steps / 5))
--   flops_per_token  model FLOPs per token of one training step (forward + backward), e.g.
--                  lunar.model.flops.training_per_token(cfg, T); enables TFLOP/s and MFU
--   peak_flops     peak FLOP/s of one device (989e12: H100 dense BF16); enables MFU
--   devices        devices the step's tokens are spread over (default 1): rates are per device
--   flops_devices  devices the model FLOPs are spread over (default devices): TFLOP/s and MFU
--                  are per device of them while tokens/s stays the job's (a data-parallel run:
--                  its tokens summed over the ranks, each rank's device measured for MFU)
--   memory         'process' (peak resident memory, VmHWM of /proc/self/status; default) or a
--                  device ('cuda:0': the peak of lunar's pool on it)
--   progress       'auto' (a bar on a terminal, plain lines otherwise; default), 'bar', 'lines'
--                  or false; log_every (default 1): plain lines every N steps
--   out            where the progress and the summary go (default io.stdout)
--   clock, wall_time  functions returning seconds (tests; default lunar's monotonic clock and
--                  the wall clock)
--
-- m:log(step, rec): rec = {loss=, grad_norm=, lr=, tokens=, skipped = bool, time = seconds of
-- the step (default: since the previous log or new()), extra = {name = number}, show = {{name,
-- number}, ...} (shown in the progress line after the loss), peak_mem_bytes = the peak memory to
-- report instead of this process's (data parallel: the largest of any rank's)}. A step whose
-- loss or grad norm is not finite counts as a NaN step; skipped = true (the optimizer did not
-- apply it) counts as a skipped step. Returns the record as written.
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'

local fs, tb = core.fs, core.tb
local fail = tensor.fail

local M = {}

local function finite(v) return type(v) == 'number' and v == v and v ~= math.huge and v ~= -math.huge end

-- ---- number formatting ------------------------------------------------------------------------

-- the shortest decimal that reads back as v (JSON); non-finite numbers become null
local function json_number(v)
    if not finite(v) then return 'null' end
    if v == math.floor(v) and math.abs(v) < 2 ^ 53 then return ('%d'):format(v) end
    for p = 15, 17 do
        local s = ('%.' .. p .. 'g'):format(v)
        if tonumber(s) == v then return s end
    end
    return ('%.17g'):format(v)
end
M.json_number = json_number

local function json_string(s)
    return '"' .. s:gsub('[%c"\\]', function(c)
        local map = {['"'] = '\\"', ['\\'] = '\\\\', ['\n'] = '\\n', ['\t'] = '\\t', ['\r'] = '\\r'}
        return map[c] or ('\\u%04x'):format(c:byte())
    end) .. '"'
end

-- 1234567.891 -> "1,234,567.891" (decimals digits)
local function commas(v, decimals)
    if not finite(v) then return tostring(v) end
    local s = ('%.' .. (decimals or 0) .. 'f'):format(v)
    local sign, int, frac = s:match('^(-?)(%d+)(.*)$')
    int = int:reverse():gsub('(%d%d%d)', '%1,'):reverse():gsub('^,', '')
    return sign .. int .. frac
end
M.commas = commas

local function duration(s)
    if not finite(s) or s < 0 then return '?' end
    s = math.floor(s + 0.5)
    local h, mi, se = math.floor(s / 3600), math.floor(s / 60) % 60, s % 60
    if h > 0 then return ('%d:%02d:%02d'):format(h, mi, se) end
    return ('%d:%02d'):format(mi, se)
end

local function short(v)   -- 1234 -> 1.23k
    if not finite(v) then return tostring(v) end
    local a = math.abs(v)
    if a >= 1e9 then return ('%.2fG'):format(v / 1e9) end
    if a >= 1e6 then return ('%.2fM'):format(v / 1e6) end
    if a >= 1e4 then return ('%.1fk'):format(v / 1e3) end
    return ('%.0f'):format(v)
end

local function fmt_loss(v)
    if v == nil then return '-' end
    if not finite(v) then return tostring(v) end
    return ('%.4f'):format(v)
end

-- ---- peak memory ---------------------------------------------------------------------------------

-- VmHWM of this process in bytes (nil where /proc is missing)
function M.process_peak_bytes()
    local f = io.open('/proc/self/status', 'r')
    if not f then return nil end
    local s = f:read('*a')
    f:close()
    local kb = s:match('VmHWM:%s*(%d+)%s*kB')
    return kb and tonumber(kb) * 1024 or nil
end

-- ---- TensorBoard event files ----------------------------------------------------------------------

local TB = {}
TB.__index = TB

-- tb_writer(path, {wall_time = seconds}): an event file at path (TensorBoard finds files whose
-- name contains "tfevents"; tb_filename() gives its writer's pattern). The header record is
-- written at once; every add_scalars is one Event, flushed.
function M.tb_writer(path, opts)
    opts = opts or {}
    local f, err = io.open(path, 'wb')
    if not f then fail('metrics.tb_writer: cannot create ' .. tostring(err)) end
    f:write(tb.file_version(opts.wall_time or fs.wall_time()))
    f:flush()
    return setmetatable({f = f, path = path}, TB)
end

-- events.out.tfevents.<10-digit unix time>.<host>.<pid>.0, as TensorBoard's own writer names them
function M.tb_filename(wall)
    return ('events.out.tfevents.%010d.%s.%d.0'):format(math.floor(wall or fs.wall_time()), fs.hostname(), fs.getpid())
end

-- add_scalars(step, tags, values[, wall_time]): one Event holding a simple_value per tag
function TB:add_scalars(step, tags, values, wall)
    if not self.f then fail('metrics: the TensorBoard writer is closed') end
    self.f:write(tb.scalars(wall or fs.wall_time(), step, tags, values))
    self.f:flush()
end

-- session_start(step[, wall_time]): marks a restart at step (a resumed run): TensorBoard then
-- drops the points of steps >= step that an earlier, interrupted run wrote
function TB:session_start(step, wall)
    if not self.f then fail('metrics: the TensorBoard writer is closed') end
    self.f:write(tb.session_start(wall or fs.wall_time(), step))
    self.f:flush()
end

function TB:close()
    if self.f then self.f:close() end
    self.f = nil
end

-- ---- the metrics logger ---------------------------------------------------------------------------

local Metrics = {}
Metrics.__index = Metrics

-- the lines of an existing JSONL file with step <= keep (a resumed run drops the rest)
local function truncate_jsonl(path, keep)
    local f = io.open(path, 'r')
    if not f then return end
    local kept, dropped = {}, 0
    for line in f:lines() do
        local step = tonumber(line:match('^{"step":(%-?%d+)'))
        if step and step <= keep then kept[#kept + 1] = line else dropped = dropped + 1 end
    end
    f:close()
    if dropped == 0 then return end
    local tmp = path .. '.tmp.' .. fs.getpid()
    local w = assert(io.open(tmp, 'w'))
    for _, line in ipairs(kept) do w:write(line, '\n') end
    w:close()
    fs.fsync(tmp)
    fs.rename(tmp, path)
end

function M.new(o)
    o = o or {}
    if type(o) ~= 'table' then fail('metrics.new: expected an options table') end
    local total = o.total_steps
    if total ~= nil and (type(total) ~= 'number' or total < 0) then fail('metrics.new: total_steps must be a number >= 0') end
    local m = setmetatable({
        total = total, start_step = o.start_step or 0,
        warmup = o.warmup_steps or math.min(10, math.floor((total or 0) / 5)),
        flops_per_token = o.flops_per_token, peak_flops = o.peak_flops, devices = o.devices or 1,
        flops_devices = o.flops_devices or o.devices or 1,
        memory = o.memory or 'process', out = o.out or io.stdout, log_every = o.log_every or 1,
        clock = o.clock or core.clock, wall_time = o.wall_time or fs.wall_time,
        rows = {}, skipped = 0, nan = 0, peak_mem = nil, bar_open = false,
        show_summary = o.summary ~= false,
    }, Metrics)
    if o.counts ~= nil then
        local c = o.counts
        if type(c) ~= 'table' then fail('metrics.new: counts must be a table {skipped_steps =, nan_steps =}') end
        for _, k in ipairs({'skipped_steps', 'nan_steps'}) do
            local v = c[k]
            if v ~= nil and not (finite(v) and v >= 0 and v == math.floor(v)) then
                fail(('metrics.new: counts.%s must be a non-negative integer, got %s'):format(k, tostring(v)))
            end
        end
        m.skipped, m.nan = c.skipped_steps or 0, c.nan_steps or 0
    end
    if o.flops_per_token ~= nil and not (finite(o.flops_per_token) and o.flops_per_token >= 0) then
        fail('metrics.new: flops_per_token must be a number >= 0')
    end
    if o.peak_flops ~= nil and not (finite(o.peak_flops) and o.peak_flops > 0) then
        fail('metrics.new: peak_flops must be a positive number (FLOP/s of one device)')
    end
    local progress = o.progress
    if progress == nil or progress == 'auto' then
        progress = (m.out == io.stdout and fs.isatty(1)) and 'bar' or 'lines'
    end
    if progress ~= false and progress ~= 'bar' and progress ~= 'lines' then
        fail("metrics.new: progress must be 'auto', 'bar', 'lines' or false")
    end
    m.progress = progress
    local jsonl = o.jsonl
    if jsonl == nil and o.dir then jsonl = o.dir .. '/metrics.jsonl' end
    local tbdir = o.tensorboard
    if tbdir == nil and o.dir then tbdir = o.dir .. '/tb' end
    if o.dir then fs.mkdir_p(o.dir) end
    if jsonl then
        local parent = jsonl:match('^(.*)/[^/]*$')
        if parent and parent ~= '' then fs.mkdir_p(parent) end
        truncate_jsonl(jsonl, m.start_step)
        local f, err = io.open(jsonl, 'a')
        if not f then fail('metrics.new: cannot open ' .. tostring(err)) end
        m.jsonl, m.jsonl_path = f, jsonl
    end
    if tbdir then
        fs.mkdir_p(tbdir)
        local wall = m.wall_time()
        m.tb = M.tb_writer(tbdir .. '/' .. (o.tb_filename or M.tb_filename(wall)), {wall_time = wall})
        -- a (re)start at the first step this run logs: TensorBoard drops the points an earlier run
        -- in this directory wrote from there on (a resumed run's tail, or all of a run started
        -- afresh), so no step shows twice
        m.tb:session_start(m.start_step + 1, wall)
    end
    m.t_last = m.clock()
    m.t_start = m.t_last
    return m
end

-- restart the step timer (after setup that should not count as the first step)
function Metrics:start()
    self.t_last = self.clock()
end

-- this process's peak memory (or `given`), the largest seen so far
function Metrics:_peak_memory(given)
    local v = given
    if v then
    elseif self.memory == 'process' then
        v = M.process_peak_bytes()
    else
        local ok, st = pcall(function() return require('lunar').memory_stats(self.memory) end)
        v = ok and st and st.peak_in_use or nil
    end
    if v and (not self.peak_mem or v > self.peak_mem) then self.peak_mem = v end
    return self.peak_mem
end

-- the fields of a record, in the order they are written
local FIELDS = {'step', 'loss', 'grad_norm', 'lr', 'tokens', 'step_time_s', 'tokens_per_s', 'tflops', 'mfu',
                'peak_mem_bytes', 'skipped', 'skipped_steps', 'nan_steps', 'time'}
local TB_TAGS = {loss = 'train/loss', grad_norm = 'train/grad_norm', lr = 'train/lr',
                 tokens_per_s = 'perf/tokens_per_s', step_time_s = 'perf/step_time_s', tflops = 'perf/tflops_per_device',
                 mfu = 'perf/mfu', peak_mem_bytes = 'mem/peak_gib', skipped_steps = 'train/skipped_steps',
                 nan_steps = 'train/nan_steps'}

function Metrics:log(step, rec)
    if type(step) ~= 'number' or step ~= math.floor(step) then fail('metrics.log: step must be an integer') end
    rec = rec or {}
    if type(rec) ~= 'table' then fail('metrics.log: expected a record table') end
    for _, k in ipairs({'loss', 'grad_norm', 'lr', 'tokens', 'time'}) do
        if rec[k] ~= nil and type(rec[k]) ~= 'number' then fail(('metrics.log: %s must be a number, got %s'):format(k, type(rec[k]))) end
    end
    local now = self.clock()
    local dt = rec.time or (now - self.t_last)
    self.t_last = now
    local nonfinite = (rec.loss ~= nil and not finite(rec.loss)) or (rec.grad_norm ~= nil and not finite(rec.grad_norm))
    if nonfinite then self.nan = self.nan + 1 end
    if rec.skipped then self.skipped = self.skipped + 1 end
    local r = {step = step, loss = rec.loss, grad_norm = rec.grad_norm, lr = rec.lr, tokens = rec.tokens,
               step_time_s = dt, skipped = rec.skipped and true or false, skipped_steps = self.skipped,
               nan_steps = self.nan, time = self.wall_time()}
    if rec.tokens and dt > 0 then
        r.tokens_per_s = rec.tokens / dt / self.devices
        if self.flops_per_token then
            r.tflops = rec.tokens * self.flops_per_token / dt / self.flops_devices / 1e12
            if self.peak_flops then r.mfu = r.tflops * 1e12 / self.peak_flops end
        end
    end
    r.peak_mem_bytes = self:_peak_memory(rec.peak_mem_bytes)
    local extra_keys = {}
    for k, v in pairs(rec.extra or {}) do
        if type(k) ~= 'string' or type(v) ~= 'number' then fail('metrics.log: extra must map names to numbers') end
        extra_keys[#extra_keys + 1] = k
    end
    table.sort(extra_keys)
    r.extra = rec.extra
    r.show = rec.show
    self.rows[#self.rows + 1] = r
    -- JSONL: one object per line, flushed
    if self.jsonl then
        local parts = {}
        for _, k in ipairs(FIELDS) do
            local v = r[k]
            if v ~= nil then
                parts[#parts + 1] = json_string(k) .. ':' .. (type(v) == 'boolean' and tostring(v) or json_number(v))
            end
        end
        for _, k in ipairs(extra_keys) do parts[#parts + 1] = json_string(k) .. ':' .. json_number(rec.extra[k]) end
        self.jsonl:write('{', table.concat(parts, ','), '}\n')
        self.jsonl:flush()
    end
    if self.tb then
        local tags, values = {}, {}
        for _, k in ipairs(FIELDS) do
            local tag, v = TB_TAGS[k], r[k]
            if tag and v ~= nil then
                if k == 'peak_mem_bytes' then v = v / 2 ^ 30 end
                tags[#tags + 1], values[#values + 1] = tag, v
            end
        end
        for _, k in ipairs(extra_keys) do tags[#tags + 1], values[#values + 1] = 'train/' .. k, rec.extra[k] end
        self.tb:add_scalars(step, tags, values, r.time)
    end
    self:_progress(r, nonfinite)
    return r
end

-- seconds per step for the ETA: the mean of the last (up to) 10 steps after warm-up
function Metrics:_recent_step_time()
    local n, sum = 0, 0
    for i = #self.rows, math.max(1, #self.rows - 9), -1 do
        local row = self.rows[i]
        if i > self.warmup or #self.rows <= self.warmup then
            n, sum = n + 1, sum + row.step_time_s
        end
    end
    return n > 0 and sum / n or nil
end

function Metrics:_progress(r, nonfinite)
    if not self.progress then return end
    local out = self.out
    local total = self.total
    local eta
    if total then
        local per = self:_recent_step_time()
        if per then eta = per * math.max(0, total - r.step) end
    end
    local bits = {}
    if self.progress == 'bar' then
        local head = total and ('step %d/%d'):format(r.step, total) or ('step %d'):format(r.step)
        if total and total > 0 then
            local width = 20
            local frac = math.max(0, math.min(1, r.step / total))
            local fill = math.floor(frac * width + 0.5)
            head = head .. (' [%s%s] %3d%%'):format(('#'):rep(fill), ('.'):rep(width - fill), math.floor(frac * 100 + 0.5))
        end
        bits[#bits + 1] = head
        bits[#bits + 1] = 'loss ' .. fmt_loss(r.loss)
        for _, sh in ipairs(r.show or {}) do bits[#bits + 1] = ('%s %.4g'):format(sh[1], sh[2]) end
        if r.lr then bits[#bits + 1] = ('lr %.2e'):format(r.lr) end
        if r.tokens_per_s then bits[#bits + 1] = short(r.tokens_per_s) .. ' tok/s' end
        if self.skipped > 0 or self.nan > 0 then bits[#bits + 1] = ('skipped %d nan %d'):format(self.skipped, self.nan) end
        if eta then bits[#bits + 1] = 'ETA ' .. duration(eta) end
        out:write('\r\27[K', table.concat(bits, ' | '))
        self.bar_open = true
        if total and r.step >= total then
            out:write('\n')
            self.bar_open = false
        end
        out:flush()
        return
    end
    local last = total and r.step >= total
    if not (last or nonfinite or r.skipped or (r.step - self.start_step) % self.log_every == 0
            or #self.rows == 1) then
        return
    end
    bits[#bits + 1] = total and ('step %d/%d'):format(r.step, total) or ('step %d'):format(r.step)
    bits[#bits + 1] = 'loss ' .. fmt_loss(r.loss)
    for _, sh in ipairs(r.show or {}) do bits[#bits + 1] = ('%s %.4g'):format(sh[1], sh[2]) end
    if r.grad_norm then bits[#bits + 1] = 'grad norm ' .. (finite(r.grad_norm) and ('%.4g'):format(r.grad_norm) or tostring(r.grad_norm)) end
    if r.lr then bits[#bits + 1] = ('lr %.3e'):format(r.lr) end
    if r.tokens_per_s then bits[#bits + 1] = commas(r.tokens_per_s) .. ' tok/s' end
    if r.tflops then bits[#bits + 1] = ('%.3f TFLOP/s'):format(r.tflops) end
    if r.mfu then bits[#bits + 1] = ('MFU %.2f%%'):format(100 * r.mfu) end
    if r.peak_mem_bytes then bits[#bits + 1] = commas(r.peak_mem_bytes / 2 ^ 20) .. ' MiB' end
    bits[#bits + 1] = ('%.3f s'):format(r.step_time_s)
    if eta and not last then bits[#bits + 1] = 'ETA ' .. duration(eta) end
    if r.skipped then bits[#bits + 1] = 'SKIPPED' end
    if nonfinite then bits[#bits + 1] = 'NON-FINITE' end
    out:write(table.concat(bits, ' | '), '\n')
    out:flush()
end

-- note(text): a line among the progress lines (a checkpoint saved, an evaluation): it ends the
-- bar line first, and is left out when progress is off
function Metrics:note(text)
    if not self.progress then return end
    if self.bar_open then
        self.out:write('\n')
        self.bar_open = false
    end
    self.out:write(text, '\n')
    self.out:flush()
end

-- one JSONL line {"step", name: value..., "time"} and the TensorBoard scalars of tags
local function write_extra(self, step, fields, tags, wall)
    if self.jsonl then
        local parts = {json_string('step') .. ':' .. json_number(step)}
        for _, f in ipairs(fields) do
            if f[2] ~= nil then parts[#parts + 1] = json_string(f[1]) .. ':' .. json_number(f[2]) end
        end
        parts[#parts + 1] = json_string('time') .. ':' .. json_number(wall)
        self.jsonl:write('{', table.concat(parts, ','), '}\n')
        self.jsonl:flush()
    end
    if self.tb then
        local names, values = {}, {}
        for _, f in ipairs(tags) do
            if f[2] ~= nil then names[#names + 1], values[#values + 1] = f[1], f[2] end
        end
        if #names > 0 then self.tb:add_scalars(step, names, values, wall) end
    end
end

-- log_scalars(step, {{name, value}, ...}): named numbers of a step besides the training step's
-- (a benchmark evaluation): one JSONL line {"step", name: value..., "time"} and one TensorBoard
-- tag per name, as given ("benchmark/gsm8k/avg@1")
function Metrics:log_scalars(step, list)
    if type(step) ~= 'number' or step ~= math.floor(step) then fail('metrics.log_scalars: step must be an integer') end
    write_extra(self, step, list, list, self.wall_time())
end

-- log_eval(step, {loss =, ppl =, tokens =}): an evaluation of the validation data, as a JSONL line
-- {"step", "valid_loss", "valid_ppl", "valid_tokens", "time"} and the TensorBoard tags
-- valid/loss and valid/ppl, and a progress note
function Metrics:log_eval(step, rec)
    if type(step) ~= 'number' or step ~= math.floor(step) then fail('metrics.log_eval: step must be an integer') end
    write_extra(self, step, {{'valid_loss', rec.loss}, {'valid_ppl', rec.ppl}, {'valid_tokens', rec.tokens}},
        {{'valid/loss', rec.loss}, {'valid/ppl', rec.ppl}}, self.wall_time())
    self.evals = self.evals or {}
    self.evals[#self.evals + 1] = {step = step, loss = rec.loss, ppl = rec.ppl}
    self:note(('eval step %d | valid loss %.4f | valid ppl %.3f'):format(step, rec.loss or 0 / 0, rec.ppl or 0 / 0))
end

-- counts() -> {skipped_steps =, nan_steps =} since the run began (resumes included): what a
-- checkpoint keeps so that new{counts =} continues them
function Metrics:counts()
    return {skipped_steps = self.skipped, nan_steps = self.nan}
end

-- summary() -> {steps, first_step, last_step, initial_loss, final_loss, final_grad_norm,
-- warmup_steps, measured_steps, mean_step_time_s, tokens_per_s (per device), tflops (per device),
-- mfu, total_tokens, peak_mem_bytes, skipped_steps, nan_steps, wall_s, valid_loss, valid_ppl,
-- valid_step (the last evaluation)}. The means are over the steps after warm-up (over all steps
-- when there are no others): total tokens / total time.
function Metrics:summary()
    local rows = self.rows
    local s = {steps = #rows, skipped_steps = self.skipped, nan_steps = self.nan, peak_mem_bytes = self.peak_mem,
               warmup_steps = self.warmup, wall_s = self.clock() - self.t_start}
    local ev = self.evals and self.evals[#self.evals]
    if ev then s.valid_loss, s.valid_ppl, s.valid_step = ev.loss, ev.ppl, ev.step end
    if #rows == 0 then return s end
    s.first_step, s.last_step = rows[1].step, rows[#rows].step
    s.initial_loss, s.final_loss = rows[1].loss, rows[#rows].loss
    s.final_grad_norm = rows[#rows].grad_norm
    local from = #rows > self.warmup and self.warmup + 1 or 1
    local time, tokens, n, all_tokens = 0, 0, 0, 0
    for i, r in ipairs(rows) do
        all_tokens = all_tokens + (r.tokens or 0)
        if i >= from then
            time, n = time + r.step_time_s, n + 1
            tokens = tokens + (r.tokens or 0)
        end
    end
    s.total_tokens = all_tokens
    s.measured_steps = n
    s.measured_from = rows[from].step
    s.mean_step_time_s = time / n
    if tokens > 0 and time > 0 then
        s.tokens_per_s = tokens / time / self.devices
        if self.flops_per_token then
            s.tflops = tokens * self.flops_per_token / time / self.flops_devices / 1e12
            if self.peak_flops then s.mfu = s.tflops * 1e12 / self.peak_flops end
        end
    end
    return s
end

-- the summary as text (what close() prints)
function Metrics:summary_text()
    local s = self:summary()
    local lines = {}
    local function add(k, v) lines[#lines + 1] = ('  %-26s %s'):format(k, v) end
    if s.steps == 0 then return 'Run summary: no steps logged\n' end
    lines[1] = ('Run summary: %d step%s (%d-%d)'):format(s.steps, s.steps == 1 and '' or 's', s.first_step, s.last_step)
    local function loss(v) return v == nil and '-' or (finite(v) and ('%.7g'):format(v) or tostring(v)) end
    add('Initial loss', loss(s.initial_loss))
    add('Final loss', loss(s.final_loss))
    if s.final_grad_norm then add('Final grad norm', loss(s.final_grad_norm)) end
    if s.valid_loss then
        add('Validation loss', ('%s (perplexity %s, step %d)'):format(loss(s.valid_loss), loss(s.valid_ppl), s.valid_step))
    end
    local which = s.measured_steps < s.steps
        and ('mean of steps %d-%d, after %d warm-up step%s'):format(s.measured_from, s.last_step,
            s.steps - s.measured_steps, s.steps - s.measured_steps == 1 and '' or 's')
        or 'mean of all steps'
    add('Step time', ('%s ms (%s)'):format(commas(s.mean_step_time_s * 1000, 3), which))
    local per = self.devices > 1 and '/device' or ''
    local fper = self.flops_devices > 1 and '/device' or ''
    if s.tokens_per_s then add('Token throughput', commas(s.tokens_per_s, 3) .. ' tokens/s' .. per) end
    if s.tflops then add('Model throughput', ('%s TFLOP/s%s'):format(commas(s.tflops, 3), fper)) end
    if s.mfu then add('MFU', ('%.2f%% of %s TFLOP/s peak%s'):format(100 * s.mfu, commas(self.peak_flops / 1e12, 1), fper))
    elseif s.tflops then add('MFU', 'n/a (set metrics.peak_flops, FLOP/s of one device)') end
    if s.peak_mem_bytes then
        add(self.memory == 'process' and 'Peak memory (process RSS)' or ('Peak memory (%s pool)'):format(self.memory),
            commas(s.peak_mem_bytes / 2 ^ 20) .. ' MiB')
    end
    add('Skipped / NaN steps', ('%d / %d'):format(s.skipped_steps, s.nan_steps))
    add('Tokens', commas(s.total_tokens))
    add('Wall time', duration(s.wall_s))
    return table.concat(lines, '\n') .. '\n'
end

-- close(): finishes the bar line, closes the files and prints the summary (summary = false in
-- new() turns that off). Returns the summary table.
function Metrics:close()
    if self.closed then return self:summary() end
    self.closed = true
    if self.bar_open then
        self.out:write('\n')
        self.bar_open = false
    end
    if self.jsonl then self.jsonl:close() end
    self.jsonl = nil
    if self.tb then self.tb:close() end
    self.tb = nil
    if self.show_summary then
        self.out:write(self:summary_text())
        self.out:flush()
    end
    return self:summary()
end

return M
