-- lunar.nn.Embedding: y = W[ids]; W (V, C), ids (N) i64 -> y (N, C). The row at padding_idx
-- gets no gradient (torch's nn.Embedding(padding_idx=...)), even when that id occurs.
-- opts.vocab = {tp =, first =, count =}: W is rows [first, first + count) of the vocabulary, split
-- over the tp group (lunar.nn.vocab_parallel); y is whole on every member.
local ops = require 'lunar.ops'
local vp = require 'lunar.nn.vocab_parallel'

local Embedding = {}
Embedding.__index = Embedding

function Embedding.new(store, name, padding_idx, opts)
    return setmetatable({store = store, name = name, wname = name .. '.weight', padding_idx = padding_idx,
                         vocab = opts and opts.vocab or nil}, Embedding)
end

function Embedding:forward(ids)
    if self.vocab then
        local y, s = vp.embedding(ids, self.store:get(self.wname), self.vocab)
        s.ids = ids
        return y, s
    end
    return ops.embedding(ids, self.store:get(self.wname)), {ids = ids}
end

function Embedding:backward(dy, saved)
    local gw = self.store:grad(self.wname)
    if not gw then return nil end
    if self.padding_idx then
        local pad = ops.eq(saved.ids, self.padding_idx):unsqueeze(2)
        dy = ops.masked_fill(dy, pad, 0)
    end
    if self.vocab then
        vp.embedding_backward(gw, dy, saved)
    else
        ops.embedding_backward(gw, dy, saved.ids)
    end
    return nil
end

return Embedding
