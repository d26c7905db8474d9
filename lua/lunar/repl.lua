-- lunar.repl: how the REPL shows values (tensors pretty-printed, tables shown one level deep),
-- its commands (:help, and at a failure :where, :up, :down, :frame, :locals), and the REPL that
-- lunar --repl-on-error opens at the failure.
--
-- At a failure the frames have already returned: the error handler copied the stack while they
-- existed (host/lua/stack.c), and the REPL works on that copy. Code typed there sees the
-- selected frame's locals, then its upvalues, then the globals. Assigning to an upvalue sets
-- it for real (the function that holds it is still alive); assigning to a local changes only
-- the REPL's copy (the frame is gone), and the REPL says so.
local M = {}

local print_mod = require 'lunar.print'
local tensor = require 'lunar.tensor'

local function short(v)
    if type(v) == 'string' then return string.format('%q', v) end
    return tostring(v)
end

local function show_table(t)
    local parts, n = {}, 0
    local keys = {}
    for k in pairs(t) do keys[#keys + 1] = k end
    table.sort(keys, function(a, b)
        if type(a) == type(b) and (type(a) == 'number' or type(a) == 'string') then return a < b end
        return type(a) < type(b)
    end)
    for _, k in ipairs(keys) do
        n = n + 1
        if n > 40 then parts[#parts + 1] = '...' break end
        local v = t[k]
        local vs = type(v) == 'table' and (getmetatable(v) and tostring(v) or '{...}') or short(v)
        if type(k) == 'number' and k == n then parts[#parts + 1] = vs
        else parts[#parts + 1] = (type(k) == 'string' and k:match('^[%a_][%w_]*$') and k or '[' .. short(k) .. ']') .. ' = ' .. vs end
    end
    return '{' .. table.concat(parts, ', ') .. '}'
end

function M.show(...)
    for i = 1, select('#', ...) do
        local v = select(i, ...)
        if type(v) == 'table' and not (getmetatable(v) and getmetatable(v).__tostring) then
            print(show_table(v))
        else
            print(tostring(v))
        end
    end
end

-- ---- the stack at a failure ---------------------------------------------------------------------

local SHORT_WIDTH = 72   -- :locals cuts a value's text here

-- a value in one line: a tensor as its summary, a table one level deep, all cut to SHORT_WIDTH
local function one_line(v)
    local s
    if tensor.is_tensor(v) then
        s = print_mod.summary(v)
        local ok, why = v:is_valid()
        if not ok then s = s .. ' (invalid: ' .. why .. ')' end
    elseif type(v) == 'table' and not (getmetatable(v) and getmetatable(v).__tostring) then
        s = show_table(v)
    else
        local ok, text = pcall(short, v)
        s = ok and type(text) == 'string' and text:match('^[^\n]*') or ('(a ' .. type(v) .. ')')
    end
    if #s > SHORT_WIDTH then s = s:sub(1, SHORT_WIDTH - 3) .. '...' end
    return s
end

-- "file:line: in function 'name'", as Lua's tracebacks say it
local function frame_label(f)
    local where = f.what == 'C' and '[C]: in ' or (f.source .. ':' .. f.line .. ': in ')
    if f.what == 'main' then return where .. 'main chunk' end
    if f.namewhat and f.namewhat ~= '' then return where .. "function '" .. f.name .. "'" end
    if f.what == 'C' then return where .. '?' end
    return where .. 'function <' .. f.source .. ':' .. f.linedefined .. '>'
end

-- name -> {vars = f.locals or f.upvalues, i = index}: what a name typed at the REPL refers to in
-- frame f (a later local shadows an earlier one, a local shadows an upvalue)
local function bindings(f)
    if f.bindings then return f.bindings end
    local b = {}
    for i = 1, f.upvalues.n do b[f.upvalues.names[i]] = {vars = f.upvalues, i = i, upvalue = true} end
    for i = 1, f.locals.n do b[f.locals.names[i]] = {vars = f.locals, i = i} end
    f.bindings = b
    return b
end

local function globals_of(f)
    return f.what ~= 'C' and getfenv(f.func) or _G
end

local sessions = setmetatable({}, {__mode = 'k'})   -- REPL env -> {stack=, sel=}

local function frame_line(session, i)
    return ('#%d  %s'):format(i - 1, frame_label(session.stack[i]))
end

-- prints where the REPL now stands: the frame, and its source line when it comes from a file
-- (not lunar's own library, whose chunks are named "@lunar:...")
local function announce(session, out)
    local f = session.stack[session.sel]
    out:write(frame_line(session, session.sel), '\n')
    local path = f.chunk and f.chunk:match('^@(.*)')
    if path and f.line > 0 and not f.lib then
        local file = io.open(path, 'r')
        if file then
            local n = 0
            for text in file:lines() do
                n = n + 1
                if n == f.line then out:write('    ', (text:gsub('^%s+', '')), '\n') break end
            end
            file:close()
        end
    end
end

-- M.at_failure(stack) -> env: the environment for code typed at the failure REPL (stack: the
-- copy made by host/lua/stack.c); says where the REPL opens
function M.at_failure(stack)
    local session = {stack = stack, sel = math.min(stack.start or 1, #stack)}
    local env = setmetatable({}, {
        __index = function(_, k)
            local f = session.stack[session.sel]
            if not f then return _G[k] end
            local b = bindings(f)[k]
            if b then return b.vars.values[b.i] end
            return globals_of(f)[k]
        end,
        __newindex = function(_, k, v)
            local f = session.stack[session.sel]
            local b = f and bindings(f)[k]
            if not b then
                (f and globals_of(f) or _G)[k] = v
            elseif b.upvalue then
                for j = 1, math.huge do
                    local name = debug.getupvalue(f.func, j)
                    if name == nil then break end
                    if name == k then debug.setupvalue(f.func, j, v) break end
                end
                b.vars.values[b.i] = v
            else
                b.vars.values[b.i] = v
                io.stderr:write(("lunar: '%s' is a local of frame #%d, which the error has already " ..
                    "unwound: only the REPL's copy is changed\n"):format(k, session.sel - 1))
            end
        end,
    })
    sessions[env] = session
    io.stderr:write('lunar: entering the REPL at the failure (the frame\'s locals are visible; ' ..
        ':help lists the commands; Ctrl-D to exit)\n')
    if #stack > 0 then announce(session, io.stderr) end
    return env
end

-- ---- commands ---------------------------------------------------------------------------------

local HELP = [[
:help          this list
:where         the stack at the failure, innermost frame first; > marks the selected frame
:up [N]        select the frame N levels out (the caller; N defaults to 1)
:down [N]      select the frame N levels in (the callee)
:frame N       select frame #N (as numbered by :where)
:locals        the selected frame's locals and upvalues
Code typed at the REPL sees the selected frame's locals and upvalues, then the globals.
:where, :up, :down, :frame and :locals work in the REPL of lunar --repl-on-error.]]

-- the session of env, or an error naming the command
local function session_for(env, cmd)
    local session = env and sessions[env]
    if not session or #session.stack == 0 then
        error((':%s: no stack to show: this REPL was not opened at a failure (lunar --repl-on-error ' ..
            'script.lua opens one)'):format(cmd), 0)
    end
    return session
end

-- the count argument of :up/:down/:frame (default when empty), or an error naming the command
local function count_arg(cmd, arg, default, min)
    if arg == '' and default then return default end
    local n = tonumber(arg)
    if not n or n ~= math.floor(n) or n < min or not arg:match('^%d+$') then
        error((':%s takes %s, got %q'):format(cmd,
            min == 0 and 'a frame number (0 is the innermost; :where lists them)' or 'a number of frames (1 or more)',
            arg), 0)
    end
    return n
end

local function select_frame(session, i, cmd)
    local last = #session.stack
    if i < 1 then
        if session.sel == 1 then error((':%s: already at the innermost frame (#0)'):format(cmd), 0) end
        i = 1
    elseif i > last then
        if session.sel == last then error((':%s: already at the outermost frame (#%d)'):format(cmd, last - 1), 0) end
        i = last
    end
    session.sel = i
    announce(session, io.stdout)
end

-- the commands that take no argument refuse one rather than ignore it
local function no_arg(cmd, arg)
    if arg ~= '' then error((':%s takes no argument, got %q'):format(cmd, arg), 0) end
end

local commands = {}

function commands.help(_, arg)
    no_arg('help', arg)
    print(HELP)
end

-- a deep stack (a runaway recursion has thousands of frames) is shown as its ends and the
-- frames around the selected one, as Lua's tracebacks cut theirs
local WHERE_ENDS, WHERE_AROUND = 10, 2

function commands.where(env, arg)
    no_arg('where', arg)
    local session = session_for(env, 'where')
    local n, sel = #session.stack, session.sel
    local skipped = 0
    for i = 1, n do
        if i <= WHERE_ENDS or i > n - WHERE_ENDS or math.abs(i - sel) <= WHERE_AROUND then
            if skipped > 0 then print(('  ... %d frames (:frame N selects any)'):format(skipped)) end
            skipped = 0
            print((i == sel and '> ' or '  ') .. frame_line(session, i))
        else
            skipped = skipped + 1
        end
    end
end

function commands.up(env, arg)
    local session = session_for(env, 'up')
    select_frame(session, session.sel + count_arg('up', arg, 1, 1), 'up')
end

function commands.down(env, arg)
    local session = session_for(env, 'down')
    select_frame(session, session.sel - count_arg('down', arg, 1, 1), 'down')
end

function commands.frame(env, arg)
    local session = session_for(env, 'frame')
    local n = count_arg('frame', arg, nil, 0)
    if n > #session.stack - 1 then
        error((':frame %d: there are frames #0 to #%d'):format(n, #session.stack - 1), 0)
    end
    select_frame(session, n + 1, 'frame')
end

local function list_vars(title, vars)
    if vars.n == 0 then return end
    print(title)
    local last = {}
    for i = 1, vars.n do last[vars.names[i]] = i end
    for i = 1, vars.n do
        local name = vars.names[i]
        print(('  %s = %s%s'):format(name, one_line(vars.values[i]), last[name] ~= i and '  (shadowed)' or ''))
    end
end

function commands.locals(env, arg)
    no_arg('locals', arg)
    local session = session_for(env, 'locals')
    local f = session.stack[session.sel]
    print(frame_line(session, session.sel))
    if f.what == 'C' then print('  (a C function: no locals)') return end
    if f.locals.n == 0 and f.upvalues.n == 0 then print('  (no locals or upvalues)') return end
    list_vars('locals:', f.locals)
    local shown = {}
    for i = 1, f.locals.n do shown[f.locals.names[i]] = true end
    local ups = {n = 0, names = {}, values = {}}
    for i = 1, f.upvalues.n do   -- an upvalue a local shadows cannot be reached from the REPL
        local name = f.upvalues.names[i]
        ups.n = ups.n + 1
        ups.names[ups.n] = shown[name] and name .. ' (shadowed by the local)' or name
        ups.values[ups.n] = f.upvalues.values[i]
    end
    list_vars('upvalues:', ups)
end

-- M.command(line, env): runs a REPL command (a line starting with ':' and a letter); env is the
-- REPL's environment table, nil for the globals. Errors are one line naming the command.
function M.command(line, env)
    local cmd, arg = line:match('^:(%a+)%s*(.-)%s*$')
    local fn = cmd and commands[cmd]
    if not fn then
        error(('unknown command %q (:help lists the commands)'):format(line:match('^%S*')), 0)
    end
    fn(env, arg)
end

return M
