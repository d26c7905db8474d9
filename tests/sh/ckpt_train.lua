-- tests/sh/ckpt_train.lua: a tiny deterministic "training" loop for test_ckpt_kill.sh.
--   lunar tests/sh/ckpt_train.lua dir=<checkpoints> steps=8 every=2 [resume=auto]
-- Each step draws a "gradient" from the data RNG stream, updates a momentum buffer (optimizer
-- state) and the weights (the model, saved through save_model), and prints
-- "step N loss <%.17g>". A resumed run must print exactly the lines of an uninterrupted one.
local lunar = require 'lunar'
local ckpt = require 'lunar.train.checkpoint'
local lio = require 'lunar.io'
local cfg = require('lunar.config').merge({dir = '', steps = 8, every = 2, keep = 2, resume = 'none'},
    require('lunar.config').overrides())

local w = lunar.zeros(64)
local m = lunar.zeros(64)
local data_rng = lunar.rng(1234):split('data')
local sched = {lr = 0.1, decay = 0.9}
local start = 0

local cm = ckpt.manager{dir = cfg.dir, every = cfg.every, keep_last = cfg.keep}
local st = cm:resume(cfg.resume)
if st then
    local f = lio.safetensors_open(st.model_dir .. '/model.safetensors')
    w:copy_(f:tensor('w'))
    f:close()
    ckpt.copy_into({m = m}, st.optimizer)
    ckpt.restore_rng(st, {data = data_rng})
    sched = st.scheduler
    start = st.step
    print(('resumed from step %d'):format(start))
    ckpt.free(st)
end

local g = lunar.empty(64)
for step = start + 1, cfg.steps do
    data_rng:normal_(g)
    g:add_(w)                       -- gradient of 0.5 |w|^2 plus noise
    m:mul_(0.9):add_(g)
    w:sub_(m:mul(sched.lr))
    sched.lr = sched.lr * sched.decay
    local loss = 0
    for _, v in ipairs(w:tolist_flat()) do loss = loss + v * v end
    print(('step %d loss %.17g'):format(step, loss))
    io.stdout:flush()
    if cm:due(step, step == cfg.steps) then
        cm:save(step, {
            save_model = function(dir) lio.save_safetensors(dir .. '/model.safetensors', {w = w}) end,
            optimizer = {m = m}, scheduler = sched, rng = {data = data_rng}, data = {position = step},
        })
        print(('saved step %d'):format(step))
        io.stdout:flush()
    end
end
