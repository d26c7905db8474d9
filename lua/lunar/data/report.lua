-- lunar.data.report: counting bad rows of a data source per reason, with where they are.
--
--   local rep = data.report{show = 5}       -- keep the first `show` locations of each reason
--   rep:good()                              -- one accepted row
--   rep:bad(reason, file, line, detail)     -- one rejected row ('invalid_json', 'missing_field', ...)
--   rep.counts[reason], rep.n_bad, rep.n_good
--   rep:where(reason)                       -- {{file=, line=, detail=}, ...} (the first `show`)
--   rep:lines(reason)                       -- {line, ...} of those
--   rep:summary()                           -- text: one line per reason, with the first locations
--   rep:print([stream])                     -- the summary to stderr (nothing when there is no bad row)
--   rep:note(what, file, line, detail)      -- a row kept but changed ('truncated', 'split'):
--                                              rep.notes[what], rep:where_noted(what)
--   rep:merge(other)                        -- add another report's counts and locations
--
-- Readers never raise for a bad row: they count it here and go on. Reasons are reported in
-- sorted order so the text is deterministic.
local M = {}

local Report = {}
Report.__index = Report

function M.new(opts)
    opts = opts or {}
    return setmetatable({counts = {}, examples = {}, notes = {}, noted = {}, n_bad = 0, n_good = 0,
        show = opts.show or 5, name = opts.name}, Report)
end

function Report:good(n)
    self.n_good = self.n_good + (n or 1)
end

-- one more of `key` in counts, and its location among the first `show` in examples
local function count(self, counts, examples, key, file, line, detail)
    counts[key] = (counts[key] or 0) + 1
    local ex = examples[key]
    if not ex then
        ex = {}
        examples[key] = ex
    end
    if #ex < self.show then ex[#ex + 1] = {file = file, line = line, detail = detail} end
end

function Report:bad(reason, file, line, detail)
    self.n_bad = self.n_bad + 1
    count(self, self.counts, self.examples, reason, file, line, detail)
end

-- A row that was kept but changed (cut to max_len, split into pieces): counted apart from the
-- rejected ones, with where the first `show` of each kind are
function Report:note(what, file, line, detail)
    count(self, self.notes, self.noted, what, file, line, detail)
end

function Report:where_noted(what) return self.noted[what] or {} end

-- Take back one good row (a later stage rejected a row an earlier stage accepted).
function Report:ungood(n)
    self.n_good = self.n_good - (n or 1)
end

function Report:where(reason) return self.examples[reason] or {} end

function Report:lines(reason)
    local out = {}
    for i, e in ipairs(self:where(reason)) do out[i] = e.line end
    return out
end

function Report:reasons()
    local r = {}
    for k in pairs(self.counts) do r[#r + 1] = k end
    table.sort(r)
    return r
end

-- counts and examples of another report added to ours (examples up to `show` per key)
local function merge_counts(self, counts, examples, o_counts, o_examples)
    for key, n in pairs(o_counts) do
        counts[key] = (counts[key] or 0) + n
        local ex = examples[key] or {}
        examples[key] = ex
        for _, e in ipairs(o_examples[key] or {}) do
            if #ex < self.show then ex[#ex + 1] = e end
        end
    end
end

function Report:merge(other)
    merge_counts(self, self.counts, self.examples, other.counts, other.examples)
    merge_counts(self, self.notes, self.noted, other.notes, other.noted)
    self.n_bad = self.n_bad + other.n_bad
    self.n_good = self.n_good + other.n_good
    return self
end

local function loc(e)
    local s = (e.file or '?') .. (e.line and (':' .. e.line) or '')
    if e.detail then s = s .. ' (' .. e.detail .. ')' end
    return s
end

-- one line per key of counts, sorted: "<prefix><key>: n  e.g. file:line (detail); ..."
local function lines_of(out, counts, examples, prefix)
    local keys = {}
    for k in pairs(counts) do keys[#keys + 1] = k end
    table.sort(keys)
    for _, k in ipairs(keys) do
        local n = counts[k]
        local locs = {}
        for i, e in ipairs(examples[k] or {}) do locs[i] = loc(e) end
        local more = n > #locs and (', and %d more'):format(n - #locs) or ''
        out[#out + 1] = ('  %s%s: %d  e.g. %s%s'):format(prefix, k, n, table.concat(locs, '; '), more)
    end
end

function Report:summary()
    local head = ('%s%d rows accepted, %d rejected'):format(self.name and (self.name .. ': ') or '', self.n_good,
        self.n_bad)
    local out = {head}
    lines_of(out, self.counts, self.examples, '')
    lines_of(out, self.notes, self.noted, 'kept but ')
    return table.concat(out, '\n')
end

-- the summary to stream (default stderr) when a row was rejected or changed
function Report:print(stream)
    if self.n_bad == 0 and next(self.notes) == nil then return end
    stream = stream or io.stderr
    stream:write(self:summary(), '\n')
end

Report.__tostring = Report.summary

return M
