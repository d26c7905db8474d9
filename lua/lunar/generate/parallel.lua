-- lunar.generate.parallel: generation on a model split over ranks (tensor, expert and expert
-- tensor parallel; docs/parallel.md), with the same sharded weights the training uses.
--
--   local gpar = require 'lunar.generate.parallel'
--   local par = gpar.of(model)            -- nil on a whole model
--   gpar.same_requests(par, ids_lists, params_text)   -- tp members were given the same requests
--   local whole = gpar.logits(par, logits)             -- (B, V) the same bits on every tp member
--   local most = gpar.agree(par, {a, b})               -- each number's largest over the ranks
--   gpar.empty_forward(model, par)                     -- a forward of no rows (the MoE layers)
--
-- Tensor parallel: the members of a tp group hold the same sequences and run every forward
-- together; the attention's and MLP's partial sums are all-reduced (lunar.generate.decode), the
-- logits are made whole and the same bits on every member (all_gather of the vocabulary split's
-- columns, or rank 0's logits broadcast when the vocabulary is whole), so every member samples
-- the same tokens and the members stay in step without another message.
--
-- Expert parallel (ep or etp > 1): the members of an expert group hold different sequences (each
-- its own prompts), but every forward of a MoE layer is a collective of the group. Generation
-- therefore runs in lockstep over the world: at each round of the scheduler the ranks agree on
-- the most prefills any of them runs and on whether any runs a decode step, and a rank with
-- fewer runs forwards of no rows (every MoE layer on a (0, H) input, its all_to_alls with empty
-- splits) until all are done. A rank whose requests are done keeps answering until every rank's
-- are. Every forward runs the MoE layers in the same order, so the k-th forward of every member
-- meets the others' k-th in each layer.
local lunar = require 'lunar'
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local dist = require 'lunar.dist'

local fail = tensor.fail

local M = {}

local function split(g) return g and g:size() > 1 and g or nil end

-- the parallel context of a model, or nil when nothing of it is split
function M.of(model)
    local o = model.opts or {}
    local tp, ep, etp = split(o.tp), split(o.ep), split(o.etp)
    if not (tp or ep or etp) then return nil end
    return {tp = tp, vocab = model.vocab, lockstep = (ep or etp) and dist.world() or nil, H = model.cfg.hidden_size,
            dtype = model.dtype, device = model:device()}
end

-- a checksum of the requests (exact in f64: every term below 2^53)
local function checksum(lists, text)
    local s, M31 = 0, 2147483647
    for i, ids in ipairs(lists) do
        s = (s * 31 + #ids + i) % M31
        for _, t in ipairs(ids) do s = (s * 131 + t + 1) % M31 end
    end
    for k = 1, #text do s = (s * 131 + text:byte(k)) % M31 end
    return s
end

-- the members of a tp group must be given the same requests (they run one copy of each sequence
-- between them): refused, on every member, when they were not
function M.same_requests(par, lists, text)
    if not (par and par.tp) then return end
    local c = checksum(lists, text)
    local t = core.from_flat({c, -c}, {2}, 'f64')
    dist.all_reduce(t, {group = par.tp, op = 'max'})
    local v = t:tolist_flat()
    if v[1] ~= c or -v[2] ~= c then
        fail(('generate: the %d tensor-parallel ranks of this model (group \'%s\') were given different prompts or '
            .. 'sampling options; tp ranks hold one copy of each sequence between them and need the same requests')
            :format(par.tp:size(), par.tp:name()))
    end
end

-- logits (B, V) whole, the same bits on every tp member (frees the local part when it gathers)
function M.logits(par, logits)
    if not (par and par.tp) then return logits end
    local v = par.vocab
    if not v then
        -- every member computed the whole row; rank 0's is the one all of them sample from
        dist.broadcast(logits, {group = par.tp, root = 0})
        return logits
    end
    local B, c, T = logits:size(1), v.count, par.tp:size()
    local all = dist.all_gather(logits:contiguous(), {group = par.tp})          -- (T * B, c)
    logits:free()
    local whole = core.empty({B, c * T}, all:dtype(), all:device())
    for r = 0, T - 1 do whole:narrow(2, r * c + 1, c):copy_(all:narrow(1, r * B + 1, B)) end
    all:free()
    return whole
end

-- the largest of each of the values in list over the world (the lockstep's counts); list
-- unchanged without lockstep
function M.agree(par, list)
    if not (par and par.lockstep) then return list end
    local t = core.from_flat(list, {#list}, 'f64')
    dist.all_reduce(t, {group = par.lockstep, op = 'max'})
    return t:tolist_flat()
end

-- a forward of no rows: each MoE layer in order on a (0, H) input (its collectives with nothing
-- of this rank's), for a rank that has fewer forwards to run than another of its expert group
function M.empty_forward(model, par)
    local x = core.empty({0, par.H}, par.dtype, par.device)
    for _, L in ipairs(model.layers) do
        if L.mlp_type == 'sparse' then
            -- (the tp members all run it: whatever the MoE reduces over tp, they reduce together)
            lunar.scope(function() L.mlp:forward(x, {row_invariant = true}) end)
        end
    end
    x:free()
end

return M
