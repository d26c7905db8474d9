-- lunar.nn.Embedding: y = W[ids]; W (V, C), ids (N) i64 -> y (N, C). The row at padding_idx
-- gets no gradient (torch's nn.Embedding(padding_idx=...)), even when that id occurs.
-- opts.vocab (lunar.parallel.vocab, whole by default): under tensor parallel W may be rows
-- [first, first + count) of the vocabulary, split over the tp group; y is whole on every member.
local ops = require 'lunar.ops'
local context = require 'lunar.parallel.context'

local Embedding = {}
Embedding.__index = Embedding

function Embedding.new(store, name, padding_idx, opts)
    return setmetatable({store = store, name = name, wname = name .. '.weight', padding_idx = padding_idx,
                         vocab = opts and opts.vocab or context.NONE.vocab}, Embedding)
end

function Embedding:forward(ids)
    return self.vocab:lookup(ids, self.store:get(self.wname))
end

function Embedding:backward(dy, saved)
    local gw = self.store:grad(self.wname)
    if not gw then return nil end
    if self.padding_idx then
        local pad = ops.eq(saved.ids, self.padding_idx):unsqueeze(2)
        dy = ops.masked_fill(dy, pad, 0)
    end
    self.vocab:lookup_backward(gw, dy, saved)
    return nil
end

return Embedding
