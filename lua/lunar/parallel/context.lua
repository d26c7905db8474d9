-- lunar.parallel.context: how one model is split over ranks, as the pieces its modules compose.
-- Every decision that depends on a parallel size is taken here, once, when the model is built;
-- lunar.nn and lunar.model call what they were given, the same code for every layout.
--
--   local ctx = context.new(cfg, {tp =, ep =, etp = (lunar.dist groups), sequence_parallel =,
--                                 split_indexer =, indexer_loss_coeff =})
--   context.NONE                      -- not split: every mapping the identity (modules' default)
--
-- What it gives (Megatron's column / row rule: a block whose heads or columns are split takes its
-- input whole and leaves partial sums, all-reduced over tp, or reduce-scattered by the decoder
-- layer under sequence parallel):
--   ctx.tp_size, ctx.tp_rank          the tensor-parallel split (1, 0 when whole)
--   ctx.sp_group                      the tp group when sequence parallel is on, else nil
--   ctx:heads(cfg, key, who)          cfg[key] / tp, the heads a rank holds (refused unless tp divides)
--   ctx:block(kind)                   {input =, output =} mappings of a block: 'attention', 'mlp'
--                                     (the dense MLP), 'shared_experts', 'moe'
--   ctx.layer_in, ctx.layer_out       the decoder layer's mappings around each block (sequence
--                                     parallel: gather_rows / scatter_rows)
--   ctx.embed_out, ctx.head_in        the embedding's output and the LM head's input
--   ctx.vocab                         the vocabulary (lunar.parallel.vocab: whole or split over tp)
--   ctx.vocab_split                   the same when split, else nil
--   ctx:indexer()                     how a DSA indexer selects its top-k (its heads split or not)
--   ctx:moe(name, rc)                 a MoE layer's dispatcher and token strategy (lunar.parallel.moe)
--   ctx:partial(names)                names whose gradient is this rank's share over tp (whole
--                                     parameters feeding split heads), {} when not split
--   ctx:norms_partial(names)          the norms between the blocks, partial under sequence parallel
--   ctx:sum_partial(grad)             all-reduces such a gradient over tp
--   ctx:check_forward(opts)           what a forward cannot do in this layout (refused)
--   ctx:spec_opts(mtp)                the options of lunar.model.params.spec: this rank's blocks
--   ctx.decode_heads, ctx.decode_block  generation: the heads' partial sums made whole, and the
--                                     blocks' (left partial for sequence parallel)
local tensor = require 'lunar.tensor'
local mappings = require 'lunar.parallel.mappings'
local vocab = require 'lunar.parallel.vocab'
local pmoe = require 'lunar.parallel.moe'
local params = require 'lunar.model.params'
local ops = require 'lunar.ops'
local dist = require 'lunar.dist'

local fail = tensor.fail
local identity = mappings.identity

local M = {}

local Context = {}
Context.__index = Context

local function splitting(g) return g and g:size() > 1 and g or nil end

-- the refusals of a tensor-parallel model of cfg (before anything is built)
local function check_tp(cfg, g, opts)
    if cfg.model_type == 'glm5_next' then
        -- GLM-5.3-Flash: KDA and NoPE MLA heads split; the mHC streams, the k-pool indexer whole
        for k, v in pairs({sequence_parallel = opts.sequence_parallel, split_indexer = opts.split_indexer}) do
            if v then
                fail(('tensor parallel (tp = %d) with %s is not implemented for glm5_next (GLM-5.3-Flash) in this '
                    .. 'version of lunar: set parallel.%s=false'):format(g:size(), k, k))
            end
        end
        if cfg.attention_bias then
            fail(('tensor parallel (tp = %d) with attention_bias (o_proj\'s bias) is not implemented for %s'):format(
                g:size(), tostring(cfg.architecture)))
        end
        for _, k in ipairs({'num_attention_heads', 'linear_num_heads'}) do
            if cfg[k] % g:size() ~= 0 then
                fail(('tensor parallel: %s %d is not divisible by tp = %d'):format(k, cfg[k], g:size()))
            end
        end
        return
    end
    if cfg.model_type == 'glm_moe_dsa' and cfg.attention_bias then
        fail(('tensor parallel (tp = %d) with attention_bias (o_proj\'s bias) is not implemented for %s'):format(
            g:size(), tostring(cfg.architecture)))
    end
    if (opts.indexer_loss_coeff or 0) > 0 then
        -- the indexer's KL target is the attention's distribution summed over all heads
        fail(('tensor parallel (tp = %d) with the DSA indexer loss (indexer_loss_coeff %s; a recipe\'s '
            .. 'model.indexer_loss_coeff) is not implemented in this version of lunar: set it to 0 or parallel.tp=1')
            :format(g:size(), tostring(opts.indexer_loss_coeff)))
    end
    for _, k in ipairs({'num_attention_heads', 'num_key_value_heads', opts.split_indexer and 'index_n_heads' or nil}) do
        if (cfg[k] or 0) % g:size() ~= 0 then
            fail(('tensor parallel: %s %s is not divisible by tp = %d'):format(k, tostring(cfg[k]), g:size()))
        end
    end
end

local function check_etp(cfg, g)
    local Im = cfg.moe_intermediate_size
    if not cfg.n_routed_experts or not Im then
        fail(('expert tensor parallel (etp = %d): the model has no routed experts'):format(g:size()))
    end
    if Im % g:size() ~= 0 then
        fail(('expert tensor parallel: moe_intermediate_size %d is not divisible by etp = %d'):format(Im, g:size()))
    end
end

-- new(cfg, opts): opts.tp, opts.ep, opts.etp are lunar.dist groups (nil or one rank: not split);
-- opts.sequence_parallel and opts.split_indexer apply with tp > 1
function M.new(cfg, opts)
    opts = opts or {}
    local tp, etp = splitting(opts.tp), splitting(opts.etp)
    if tp then check_tp(cfg, tp, opts) end
    if etp then check_etp(cfg, etp) end
    local self = setmetatable({cfg = cfg, tp = tp, ep = opts.ep, etp = etp,
        tp_size = tp and tp:size() or 1, tp_rank = tp and tp:rank() or 0,
        sp = (tp and opts.sequence_parallel) and true or false,
        split_indexer = (tp and opts.split_indexer) and true or false}, Context)
    self.vocab = vocab.of(cfg, tp)
    self.vocab_split = self.vocab.split and self.vocab or nil
    local sp = self.sp and tp or nil
    self.sp_group = sp
    -- sequence parallel: between the blocks each tp rank holds its share of the rows (N / tp); the
    -- blocks take every row and leave their partial sums to the layer, which reduce-scatters them
    self.layer_in = sp and mappings.gather_rows(sp) or identity
    self.layer_out = sp and mappings.scatter_rows(sp) or identity
    self.embed_out = sp and mappings.split_rows(sp) or identity
    -- the head reads every row; a split vocabulary's input gradient is each member's columns' share
    if self.vocab.split then
        self.head_in = sp and mappings.gather_rows(sp) or mappings.copy_to(tp)
    else
        self.head_in = sp and mappings.gather_whole(sp) or identity
    end
    -- blocks whose heads are split reduce their own partial sums unless the layer does (sp)
    self.heads_io = (tp and not sp) and {input = mappings.copy_to(tp), output = mappings.reduce_from(tp)}
        or {input = identity, output = identity}
    -- generation holds every row on every member: what training leaves partial is made whole
    self.decode_heads = tp and mappings.reduce_from(tp) or identity
    self.decode_block = sp and mappings.reduce_from(sp) or identity
    return self
end

M.NONE = setmetatable({tp_size = 1, tp_rank = 0, sp = false, split_indexer = false,
    vocab = vocab.of({vocab_size = 0}, nil), layer_in = identity, layer_out = identity, embed_out = identity,
    head_in = identity, heads_io = {input = identity, output = identity}, decode_heads = identity,
    decode_block = identity}, Context)

-- cfg[key] / tp: the heads this rank holds
function Context:heads(cfg, key, who)
    local n = cfg[key]
    if type(n) ~= 'number' then fail(('%s: config field %s must be a number, got %s'):format(who, key, tostring(n))) end
    if n % self.tp_size ~= 0 then
        fail(('%s: %s %d is not divisible by tp = %d'):format(who, key, n, self.tp_size))
    end
    return n / self.tp_size
end

-- the input and output mappings of a block. The shared experts and the MoE layer: when the tp
-- members route shares of the rows (tp x ep) the shared experts' partial sums stay partial and
-- the MoE reduces them with the routed rows
function Context:block(kind)
    local io = self.heads_io
    if kind == 'attention' or kind == 'mlp' then return io end
    local shares = self.tp and self:_dispatches() and true or false
    if kind == 'shared_experts' then
        if shares or self.sp then return {input = identity, output = identity} end
        return io
    end
    if kind == 'moe' then
        if shares and not self.sp then return {input = mappings.copy_to(self.tp), output = mappings.reduce_from(self.tp)} end
        return {input = identity, output = identity}
    end
    fail('lunar.parallel.context: unknown block kind ' .. tostring(kind))
end

-- do the experts live on other ranks (ep, or etp with its ep group)?
function Context:_dispatches()
    local ep = self.ep
    return ep and (ep:size() > 1 or self.etp ~= nil)
end

-- a MoE layer's parallel parts: {dispatcher =, tokens =} (lunar.parallel.moe)
function Context:moe(name, rc)
    local d = pmoe.dispatcher(name, rc.E, self.ep, self.etp)
    local kind = 'all'
    if self.tp and d.kind == 'all_to_all' then kind = 'share' elseif self.sp then kind = 'keep_share' end
    return {dispatcher = d, tokens = pmoe.tokens(kind, self.tp, rc.K)}
end

-- ---- the DSA indexer's selection ----------------------------------------------------------------

-- whole heads: the fused scores and top-k (masked keys never computed); nil under the KL loss,
-- which takes the dense path
local IndexWhole = {split = false}
IndexWhole.__index = IndexWhole

-- select(qr (B, T, Hi, Di), keys (B, S, Di), wts (B, T, Hi), mask, scale, k, opts) -> scores, topk
--   opts.keep: the KL loss (the caller's dense path: nil here); opts.scores == false: the top-k
--   only; opts.sorted: the positions in increasing order (generation's paged reads)
function IndexWhole:select(qr, keys, wts, mask, scale, k, opts)
    if opts.keep then return nil end
    return ops.index_scores(qr, keys, wts, {mask = mask, scale = scale, topk = k, scores = opts.scores ~= false})
end

-- heads split over tp: this rank's heads' part of the scores (+ mask), summed over tp, then the
-- top-k every rank shares (the mask is in every rank's part: masked keys only get lower)
local IndexSplit = {split = true}
IndexSplit.__index = IndexSplit

function IndexSplit:select(qr, keys, wts, mask, scale, k, opts)
    if opts.keep then
        fail(('DSA %s: the indexer loss under tensor parallel is not implemented'):format(opts.name or 'indexer'))
    end
    local scores = ops.index_scores(qr, keys, wts, {mask = mask, scale = scale, scores = true})
    dist.all_reduce(scores, {group = self.tp})
    local _, topk = ops.topk(scores, k)
    if opts.sorted then
        local sel = ops.sort(topk)
        topk:free()
        topk = sel
    end
    if opts.scores == false then scores:free(); scores = nil end
    return scores, topk
end

-- the selection of a DSA indexer of Hi heads: {heads = the heads this rank holds, select =}
function Context:indexer(cfg, who)
    if self.split_indexer then
        return setmetatable({heads = self:heads(cfg, 'index_n_heads', who), tp = self.tp}, IndexSplit)
    end
    local Hi = cfg.index_n_heads
    if type(Hi) ~= 'number' then fail(('%s: config field index_n_heads must be a number, got %s'):format(who, tostring(Hi))) end
    return setmetatable({heads = Hi}, IndexWhole)
end

-- ---- gradients, checks, the parameter spec ------------------------------------------------------

-- the parameters of `names` whose gradient each tp rank holds only a part of (whole parameters
-- that feed this rank's heads): all of them under tp, none otherwise
function Context:partial(names)
    if self.tp then return names end
    return {}
end

-- sequence parallel: the norms between the blocks see this rank's rows only
function Context:norms_partial(names)
    if self.sp then return names end
    return {}
end

-- the sum over tp of a gradient each rank holds a part of
function Context:sum_partial(g) return dist.all_reduce(g, {group = self.tp}) end

function Context:check_forward(opts)
    if self.sp and (opts.head_positions or opts.mtp) then
        fail('forward: opts.head_positions and opts.mtp under sequence parallel are not implemented in this version '
            .. 'of lunar')
    end
end

-- the lunar.model.params.spec options of a model in this context (mtp = false: without its MTP
-- layer): this rank's experts and its tp and etp blocks
function Context:spec_opts(mtp)
    local o = {mtp = mtp}
    if self.tp then o.tp = {rank = self.tp:rank(), size = self.tp:size()} end
    if self.etp then o.etp = {rank = self.etp:rank(), size = self.etp:size()} end
    o.split_indexer = self.split_indexer or nil
    if self.ep and self.ep:size() > 1 then o.experts = params.expert_range(self.cfg, self.ep:rank(), self.ep:size()) end
    return o
end

M.Context = Context
return M
