-- lunar.nn.Embedding: y = W[ids]; W (V, C), ids (N) i64 -> y (N, C). The row at padding_idx
-- gets no gradient (torch's nn.Embedding(padding_idx=...)), even when that id occurs.
local ops = require 'lunar.ops'

local Embedding = {}
Embedding.__index = Embedding

function Embedding.new(store, name, padding_idx)
    return setmetatable({store = store, name = name, wname = name .. '.weight', padding_idx = padding_idx},
        Embedding)
end

function Embedding:forward(ids)
    return ops.embedding(ids, self.store:get(self.wname)), {ids = ids}
end

function Embedding:backward(dy, saved)
    local gw = self.store:grad(self.wname)
    if not gw then return nil end
    if self.padding_idx then
        local pad = ops.eq(saved.ids, self.padding_idx):unsqueeze(2)
        dy = ops.masked_fill(dy, pad, 0)
    end
    ops.embedding_backward(gw, dy, saved.ids)
    return nil
end

return Embedding
