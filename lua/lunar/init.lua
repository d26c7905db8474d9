-- lunar: tensors, ops, collectives and checkpoint I/O for training GLM-5-family models.
--
--   local lunar = require 'lunar'
--   local x = lunar.randn(4, 8)                 -- f32 on cpu
--   local w = lunar.ones(8, {dtype = 'bf16'})
--   local y = lunar.ops.rmsnorm(x, w, 1e-5)
--   print(y)                                    -- printed like torch
--
-- Dims and positions are 1-based (t:size(1), t:narrow(1, 2, 3)); ids that come from files or
-- the network (token ids, layer and expert ids, ranks, devices) are 0-based.
local core = require 'lunar.core'

local lunar = {}
lunar.core = core
lunar.version = core.version

local tensor = require 'lunar.tensor'
for k, v in pairs(tensor.api) do lunar[k] = v end

lunar.ops = require 'lunar.ops'
lunar.config = require 'lunar.config'

-- lunar.scope(fn, ...): tensors created inside fn are freed when it returns, except the ones
-- it returns (directly, or anywhere inside returned tables). Errors propagate after cleanup,
-- with the traceback of where they were raised (core.error_site records it before the unwind).
local function pack(...) return {n = select('#', ...), ...} end

local function keep_returned(v, seen)
    if tensor.is_tensor(v) then
        core.scope_keep(v)
    elseif type(v) == 'table' and not seen[v] then
        seen[v] = true
        for k, x in pairs(v) do
            keep_returned(k, seen)
            keep_returned(x, seen)
        end
    end
end

function lunar.scope(fn, ...)
    core.scope_push()
    -- n counts the results past a nil (#res would stop at the first one)
    local res = pack(xpcall(fn, core.error_site, ...))
    if res[1] then
        if res.n > 1 then   -- (a training step's scope returns nothing: no table for it)
            local seen = {}
            for i = 2, res.n do keep_returned(res[i], seen) end
        end
    else
        -- under --repl-on-error the tensors of the failing stack's frames (their locals and
        -- upvalues) outlive the cleanup, for its REPL (kept into the enclosing scope, so a
        -- caught error frees them there)
        local stack = core.error_stack(res[2])
        if stack then keep_returned(stack, {}) end
    end
    core.scope_pop()
    if not res[1] then core.reraise(res[2]) end
    return unpack(res, 2, res.n)
end

-- lunar.persist(t): t survives the lunar.scope() it was created in (model weights, gradients
-- and optimizer state created inside a step). Returns t.
function lunar.persist(t) return core.persist(t) end

-- Arenas: one block of memory for tensors that share a lifetime (see docs/architecture.md).
function lunar.arena(name, bytes, device)
    return core.arena_new(name, bytes, device)
end

-- Random streams. lunar.rng(seed) makes an independent stream; the default stream used by
-- randn/rand/randint when no `rng` option is given is reseeded by lunar.manual_seed.
function lunar.rng(seed)
    return core.rng_new(seed or 0)
end

local default_rng = core.rng_new(0)
function lunar.manual_seed(seed) default_rng = core.rng_new(seed) return default_rng end
function lunar.default_rng() return default_rng end

-- seconds from a monotonic clock (os.clock() is CPU time, summed over threads)
function lunar.clock() return core.clock() end

function lunar.threads(n) return core.threads(n) end
function lunar.device_count(kind) return core.device_count(kind or 'cuda') end
function lunar.cuda_built() return core.cuda_built() end
-- available, message: (true, '2 CUDA devices') or (false, 'CUDA is not available: ' .. why), why
-- being a build without CUDA or the CUDA runtime's own error (no driver, a driver too old for
-- the runtime, no device); device_count('cuda') is 0 then
function lunar.cuda_status() return core.cuda_status() end
-- waits for the device's queued work, then checks it as lunar.sync_check does
function lunar.synchronize(device) core.synchronize(device) end
-- A check point: an index op on a device (cuda, the debug devices cpu:N) does not stop to read
-- back whether its index values were in range; the device keeps the first bad one and this
-- raises it (op, tensor, value, valid range), at the cost of one read. A model forward that
-- reads its loss and the optimizer step call it; lunar.check_each_op(true) (or
-- LUNAR_CHECK_EACH_OP=1) makes every index op on a device check at once, to find the op.
function lunar.sync_check(device) core.sync_check(device) end
function lunar.check_each_op(on) return core.check_each_op(on) end
function lunar.memory_stats(device) return core.pool_stats(device) end
-- {to_host=, from_host=, to_host_bytes=, from_host_bytes=}: transfers between the host and any
-- device so far (cross-device copies, get/set/item/tolist of device tensors). On a GPU each is a
-- synchronisation; the debug device cpu:1 (LUNAR_FAKE_CPU_DEVICES=1) counts them without one.
function lunar.transfer_stats() return core.transfer_stats() end

-- lunar.dist is loaded on first use (it initialises MPI when launched under mpirun); so are
-- lunar.io (checkpoints, JSON), lunar.model, lunar.data, lunar.optim, lunar.peft, lunar.chat,
-- lunar.tokenizer, lunar.generate.
local lazy = {dist = 'lunar.dist', io = 'lunar.io', model = 'lunar.model', data = 'lunar.data',
              optim = 'lunar.optim', peft = 'lunar.peft', chat = 'lunar.chat', tokenizer = 'lunar.tokenizer',
              generate = 'lunar.generate'}
setmetatable(lunar, {__index = function(t, k)
    local mod = lazy[k]
    if mod then
        local d = require(mod)
        rawset(t, k, d)
        return d
    end
end})

-- lunar.breakpoint(): open the REPL here (locals are not captured; pass them in a table)
function lunar.breakpoint(env)
    if env then setmetatable(env, {__index = _G}) end
    core.repl(env)
end

tensor.install(lunar)
return lunar
