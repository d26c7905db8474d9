-- lunar.nn: modules with explicit forward and backward (llm.c / torch-nn style, no autograd tape).
--
-- Every module is built on a parameter store (lunar.nn.params) and a name prefix, and reads its
-- weights from the store by their checkpoint names at each call, so loading or replacing
-- weights never rebuilds modules. The contract:
--
--   local y, saved = m:forward(x)          -- saved: what the backward needs (a table)
--   local dx = m:backward(dy, saved)       -- input gradient (=); parameter gradients go into
--                                          -- the store's grad tensors (+=, so micro-batches
--                                          -- accumulate); frozen parameters get none
--
-- Activations are 2-D (N, C) with N = tokens; modules that need the sequence structure take it
-- from a `batch` table (positions, masks) passed by the model.
local M = {}

M.params = require 'lunar.nn.params'
M.Linear = require 'lunar.nn.linear'
M.RMSNorm = require 'lunar.nn.rmsnorm'
M.Embedding = require 'lunar.nn.embedding'
M.MLP = require 'lunar.nn.mlp'
M.masks = require 'lunar.nn.masks'
M.attention = require 'lunar.nn.attention'
M.MLA = require 'lunar.nn.mla'
M.DSA = require 'lunar.nn.dsa'
M.GQA = require 'lunar.nn.gqa'
M.MoE = require 'lunar.nn.moe'
M.KDA = require 'lunar.nn.kda'
M.HyperConnection = require 'lunar.nn.hyper'

return M
