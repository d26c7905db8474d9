-- lunar.parallel.vocab: the model's vocabulary, whole on every rank or split over tensor parallel
-- (Megatron's vocab-parallel embedding, LM head and cross-entropy). Member r of the tp group
-- holds rows [first, first + count) of the embedding and of the LM head (count = V / tp); nothing
-- here gathers a (N, V) tensor.
--
--   local vocab = require 'lunar.parallel.vocab'
--   local v = vocab.of(cfg, tp_group)     -- the model's: split when tp > 1 divides vocab_size
--   local y, saved = v:lookup(ids, W);  v:lookup_backward(gW, dy, saved)
--   local loss, logprobs, lse, ctx = v:cross_entropy(logits, targets)
--   local dlogits = v:cross_entropy_backward(dloss, logits, lse, targets, ctx)
--   v:sum_columns(t)        -- a per-row sum over the vocabulary's columns (the entropy's terms)
--   v.split, v.first, v.count, v.tp, v.no_target (a target id for an lse-only cross-entropy)
--
-- The functions under them, on a split vocabulary v = {tp = group, first =, count =}:
--   local vp = require 'lunar.parallel.vocab'
--   local v = {tp = group, first = r * V / tp, count = V / tp}
--   -- y (N, H), whole on every member:
--   local y, saved = vp.embedding(ids, W_local, v)
--   vp.embedding_backward(gW, dy, saved)                      -- gW += dy's rows this member holds
--   local loss, logprobs, lse, ctx = vp.cross_entropy(logits_local, targets, v)
--   local dlogits_local = vp.cross_entropy_backward(dloss, logits_local, lse, ctx)
--
-- Embedding: each member looks up the ids in its rows (0 for the others) and one all-reduce over
-- tp adds the members' rows: every id is found on exactly one member. Its backward needs no
-- communication: dy is the same on every member and each adds it into the rows it holds.
--
-- Cross-entropy on the local logits (N, count): each member's log-sum-exp over its columns and
-- its columns' target logit (0 when the target is elsewhere) go to every member in one all_gather
-- of a (N, 2) tensor; the whole row's lse = m + log(sum_r exp(lse_r - m)) (m the largest lse_r)
-- and target logit are summed in member order, so every member holds the same bits. loss =
-- lse - target logit, logprobs = target logit - lse (0 and 0 where the target is ignore_index
-- -100), lse as lunar.ops.cross_entropy's. The backward is local: softmax(logits - lse) on the
-- member's columns times dloss, minus dloss at the target's column where the member holds it.
local core = require 'lunar.core'
local ops = require 'lunar.ops'
local dist = require 'lunar.dist'

local M = {}

local IGNORE = -100

-- which ids (N) i64 fall in [first, first + count): held (N) f32 1/0, and rows (N) i64 the local
-- row of each (0 where not held)
local function local_rows(ids, v)
    local f = ids:to('f32')                                   -- exact: vocabularies are < 2^24
    local held = ops.mul(ops.ge(f, v.first, {dtype = 'f32'}), ops.lt(f, v.first + v.count, {dtype = 'f32'}))
    local rows = ops.mul(ops.sub(f, v.first), held):to('i64')
    f:free()
    return held, rows
end

-- y (N, H) = W[ids], W split by rows over v.tp (this member's (count, H) block)
function M.embedding(ids, W, v)
    local held, rows = local_rows(ids, v)
    local y = ops.embedding(rows, W)
    ops.masked_fill_(y, ops.eq(held, 0):view(held:numel(), 1), 0)
    dist.all_reduce(y, {group = v.tp})
    return y, {held = held, rows = rows}
end

-- gW (count, H) += the rows of dy (N, H) whose ids this member holds; saved from embedding()
function M.embedding_backward(gW, dy, saved)
    local dyl = ops.masked_fill(dy, ops.eq(saved.held, 0):view(saved.held:numel(), 1), 0)
    ops.embedding_backward(gW, dyl, saved.rows)
    dyl:free()
end

-- logits (N, count) f32 this member's columns, targets (N) i64 whole-vocabulary ids (or -100).
-- Returns loss (N), logprobs (N), lse (N) (f32, whole-row values, the same on every member) and
-- what the backward needs.
function M.cross_entropy(logits, targets, v)
    local N = logits:size(1)
    local T = v.tp:size()
    local held, rows = local_rows(targets, v)
    local ignored = ops.eq(targets, IGNORE, {dtype = 'f32'})
    -- the kernel's targets: this member's row of a target it holds, column 0 of one it does not
    -- (its term is taken back in the backward), ignore_index where ignored
    local kt = ops.add(ops.mul(rows:to('f32'), ops.sub(1, ignored)), ops.mul(ignored, IGNORE)):to('i64')
    local _, lp_l, lse_l = ops.cross_entropy(logits, kt)
    -- the target's logit where held: lp_l + lse_l (0 elsewhere)
    local pack = core.empty({N, 2}, 'f32', logits:device())
    pack:narrow(2, 1, 1):copy_(lse_l:view(N, 1))
    pack:narrow(2, 2, 1):copy_(ops.mul(ops.add(lp_l, lse_l), held):view(N, 1))
    local all = dist.all_gather(pack, {group = v.tp})           -- (T * N, 2), member order
    local function part(r, c) return all:narrow(1, r * N + 1, N):narrow(2, c, 1):contiguous():view(N) end
    local m = part(0, 1)
    for r = 1, T - 1 do m = ops.maximum(m, part(r, 1)) end
    local s = core.empty({N}, 'f32', logits:device()):fill_(0)
    local tl = core.empty({N}, 'f32', logits:device()):fill_(0)
    for r = 0, T - 1 do
        ops.add_(s, ops.exp(ops.sub(part(r, 1), m)))
        ops.add_(tl, part(r, 2))
    end
    local lse = ops.add(m, ops.log(s))
    local skip = ops.ne(ignored, 0)
    local keep = ops.eq(ignored, 0, {dtype = 'f32'})
    local logprobs = ops.masked_fill(ops.sub(tl, lse), skip, 0)
    local loss = ops.masked_fill(ops.sub(lse, tl), skip, 0)
    -- rows whose target another member holds: column 0's term to restore in the backward
    local elsewhere = ops.mul(ops.eq(held, 0, {dtype = 'f32'}), keep)
    return loss, logprobs, lse, {kt = kt, elsewhere = elsewhere}
end

-- dlogits (N, count) = dloss * (softmax over the whole row, this member's columns) - dloss at the
-- target's column where held; dloss (N) f32 or a number
function M.cross_entropy_backward(dloss, logits, lse, ctx)
    local N = logits:size(1)
    local d = ops.cross_entropy_backward(dloss, logits, lse, ctx.kt)
    -- where the target is elsewhere the kernel subtracted dloss at column 0: that element is
    -- dloss * exp(logit - lse), recomputed, and chosen by the 0/1 weights (no cancellation)
    local col = core.empty({N, 1}, 'i64', logits:device()):fill_(0)
    local g = type(dloss) == 'number' and dloss or dloss:view(N, 1)
    local fresh = ops.mul(ops.exp(ops.sub(ops.gather(logits, 2, col), lse:view(N, 1))), g)
    local e = ctx.elsewhere:view(N, 1)
    local kernel = ops.gather(d, 2, col)
    local v = ops.add(ops.mul(kernel, ops.sub(1, e)), ops.mul(fresh, e))
    ops.scatter_(d, 2, col, v:to(d:dtype()))
    return d
end

-- ---- the vocabulary a model uses -------------------------------------------------------------

-- whole: every rank holds every row and computes every column (lunar.ops' embedding and
-- cross-entropy); nothing to sum
local Whole = {split = false, first = 0, no_target = 0}
Whole.__index = Whole

function Whole:lookup(ids, W) return ops.embedding(ids, W), {ids = ids} end
function Whole:lookup_backward(gW, dy, saved) ops.embedding_backward(gW, dy, saved.ids) end
function Whole:cross_entropy(logits, targets) return ops.cross_entropy(logits, targets) end
function Whole:cross_entropy_backward(dloss, logits, lse, targets)
    return ops.cross_entropy_backward(dloss, logits, lse, targets)
end
function Whole:sum_columns(t) return t end

-- split over tp: the functions above (an lse-only cross-entropy ignores every target, so that no
-- member takes a column it does not hold)
local Split = {split = true, no_target = IGNORE}
Split.__index = Split

function Split:lookup(ids, W)
    local y, s = M.embedding(ids, W, self)
    s.ids = ids
    return y, s
end
function Split:lookup_backward(gW, dy, saved) M.embedding_backward(gW, dy, saved) end
function Split:cross_entropy(logits, targets) return M.cross_entropy(logits, targets, self) end
function Split:cross_entropy_backward(dloss, logits, lse, _, ctx) return M.cross_entropy_backward(dloss, logits, lse, ctx) end
function Split:sum_columns(t) return dist.all_reduce(t, {group = self.tp}) end

-- does tensor parallel over `tp` ranks split the vocabulary of cfg? When tp divides vocab_size;
-- otherwise the embedding and the LM head stay whole on every rank
function M.splits(cfg, tp)
    return tp > 1 and cfg.vocab_size % tp == 0
end

-- the vocabulary of a model of cfg on a tp group (nil or one rank: whole)
function M.of(cfg, tp)
    if not (tp and M.splits(cfg, tp:size())) then return setmetatable({count = cfg.vocab_size}, Whole) end
    local count = cfg.vocab_size / tp:size()
    return setmetatable({tp = tp, first = tp:rank() * count, count = count}, Split)
end

return M
