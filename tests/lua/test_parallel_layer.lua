-- lunar.parallel's model-facing layer on one process: the mappings, the context of a model that
-- is not split, and the rule that the modules of lunar.nn and lunar.model never communicate or
-- ask a group's size themselves (every parallel decision lives in lunar.parallel).
local lunar = require 'lunar'
local T = require('lunar.testing').suite('parallel.layer')
local mappings = require 'lunar.parallel.mappings'
local context = require 'lunar.parallel.context'
local vocab = require 'lunar.parallel.vocab'

local d = lunar.dist

-- the source files of a directory of lua/lunar, read from the repository
local function sources(dir)
    local list = {}
    local p = io.popen(('ls lua/lunar/%s/*.lua'):format(dir))
    for path in p:lines() do list[#list + 1] = path end
    p:close()
    assert(#list > 0, 'no source under lua/lunar/' .. dir)
    return list
end

T:test('lunar.nn and lunar.model neither communicate nor read a parallel size', function()
    local rules = {
        {'lunar%.dist', 'requires lunar.dist (collectives go through lunar.parallel)'},
        {'[%w_]+:size%(%)%s*[<>=~]', 'compares a group size'},
        {'%.size%s*[<>]', 'compares a parallel size'},
        {'tp_size%s*[<>=~]', 'compares the tp size'},
        {'%.world_size', 'reads the world size'},
    }
    local checked = 0
    for _, dir in ipairs({'nn', 'model'}) do
        for _, path in ipairs(sources(dir)) do
            local n = 0
            for line in io.lines(path) do
                n = n + 1
                local code = line:gsub('%-%-.*$', '')   -- comments may speak of anything
                for _, r in ipairs(rules) do
                    assert(not code:find(r[1]), ('%s:%d %s: %s'):format(path, n, r[2], line))
                end
            end
            checked = checked + 1
        end
    end
    assert(checked >= 15, 'the modules were read')
end)

T:test('the mappings of a whole model are the identity, forward and backward', function()
    local x = lunar.randn(4, 3)
    for _, m in ipairs({mappings.identity, context.NONE.layer_in, context.NONE.layer_out, context.NONE.embed_out,
                        context.NONE.head_in, context.NONE:block('attention').input,
                        context.NONE:block('moe').output, context.NONE.decode_heads}) do
        assert(rawequal(m:forward(x), x), tostring(m) .. ' forward')
        assert(rawequal(m:backward(x), x), tostring(m) .. ' backward')
    end
end)

T:test('on a group of one rank each mapping keeps the values', function()
    local g = d.world()
    local x = lunar.randn(6, 5, {rng = lunar.rng(3)})
    local want = x:clone()
    for _, make in ipairs({'copy_to', 'reduce_from', 'gather_rows', 'scatter_rows', 'gather_whole', 'split_rows'}) do
        local m = mappings[make](g)
        T.equal(m:forward(x:clone()), want, make .. ' forward')
        T.equal(m:backward(x:clone()), want, make .. ' backward')
    end
end)

T:test('a model that is not split: its context, vocabulary and spec options', function()
    local cfg = dofile('recipes/presets/tiny.lua').common.model.config
    local ctx = context.new(cfg, {})
    T.equal(ctx.tp_size, 1, 'tp size')
    assert(not ctx.vocab.split, 'the vocabulary is whole')
    T.equal(ctx:heads(cfg, 'num_attention_heads', 'x'), cfg.num_attention_heads, 'every head')
    T.equal(#ctx:partial({'a', 'b'}), 0, 'no tp-partial gradient')
    T.equal(#ctx:norms_partial({'a'}), 0, 'no sequence-parallel norm')
    local so = ctx:spec_opts(false)
    assert(so.tp == nil and so.etp == nil and so.experts == nil, 'no block of any tensor')
    local moe = ctx:moe('m', {E = 8, K = 2})
    assert(moe.dispatcher.kind == 'local', 'experts here')
    T.equal(moe.dispatcher.first, 0, 'first expert')
    T.equal(moe.dispatcher.count, 8, 'every expert')
    assert(moe.tokens.kind == 'all', 'every row routed')
    -- one rank: a group of one does not split the vocabulary
    assert(not vocab.of(cfg, d.world()).split, 'whole on one rank')
    assert(vocab.splits(cfg, 2), 'tp 2 divides 6400')
    assert(not vocab.splits({vocab_size = 6401}, 2), 'tp 2 does not divide 6401')
end)

T:test('the whole vocabulary is lunar.ops\' embedding and cross-entropy', function()
    local v = vocab.of({vocab_size = 7}, nil)
    local W = lunar.randn(7, 3, {rng = lunar.rng(1)})
    local ids = lunar.tensor({0, 6, 2}, 'i64')
    local y = v:lookup(ids, W)
    T.equal(y, lunar.ops.embedding(ids, W), 'lookup')
    local z = lunar.randn(3, 7, {rng = lunar.rng(2)})
    local tg = lunar.tensor({1, -100, 6}, 'i64')
    local loss, lp, lse = v:cross_entropy(z, tg)
    local l1, lp1, lse1 = lunar.ops.cross_entropy(z, tg)
    T.equal(loss, l1, 'loss')
    T.equal(lp, lp1, 'logprobs')
    T.equal(lse, lse1, 'lse')
    T.equal(v:sum_columns(lse), lse, 'nothing to sum')
end)

T:test('expert tensor parallel without its ep group is refused naming the layer', function()
    local fake = setmetatable({}, {__index = {size = function() return 2 end, rank = function() return 0 end}})
    T.raises(function() require('lunar.parallel.moe').dispatcher('model.layers.1.mlp', 8, nil, fake) end,
        'MoE model.layers.1.mlp: expert tensor parallel (etp = 2) needs the ep group')
end)

os.exit(T:run())
