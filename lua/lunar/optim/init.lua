-- lunar.optim: optimizers over a parameter store (lunar.nn.params) and LR schedules.
--
--   local optim = require 'lunar.optim'
--   local opt = optim.AdamW.new(model.params, {lr = 3e-4, weight_decay = 0.1, clip = 1.0,
--                                              schedule = {warmup = 100, total = 1000, min_lr = 3e-5}})
--   local info = opt:step{loss = out.loss}; opt:zero_grad()
--   optim.schedule.new{lr =, warmup =, total =, decay = 'cosine'|'linear'|'constant', min_lr =}
local M = {}

M.AdamW = require 'lunar.optim.adamw'
M.schedule = require 'lunar.optim.schedule'

return M
