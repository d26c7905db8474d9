-- lunar.nn.Linear: y = x W^T (+ b), W stored [out, in] like torch. x (N, in) -> y (N, out).
-- With a LoRA adapter on this module in the store (lunar.nn.lora), y also gets the low-rank
-- path s * dropout(x) A^T B^T, and backward its gradients.
-- forward(x[, {row_invariant = true}]): the products (the adapter's too) row-invariant
-- (lunar.ops.gemm: each row's bits independent of the other rows; generation's decode steps).
local ops = require 'lunar.ops'
local lora = require 'lunar.nn.lora'

local Linear = {}
Linear.__index = Linear

-- Linear.new(store, name, {bias = false}): reads `name .. '.weight'` (and '.bias') from store.
function Linear.new(store, name, opts)
    opts = opts or {}
    return setmetatable({store = store, name = name, wname = name .. '.weight',
                         bname = opts.bias and (name .. '.bias') or nil}, Linear)
end

function Linear:weight() return self.store:get(self.wname) end

function Linear:forward(x, opts)
    local y = ops.gemm(x, self.store:get(self.wname), {trans_b = true, row_invariant = opts and opts.row_invariant})
    if self.bname then ops.add_(y, self.store:get(self.bname)) end
    local ad = self.store:adapter(self.name)
    if ad then return y, {x = x, lora = lora.forward(ad, x, y, opts), ad = ad} end
    return y, {x = x}
end

-- dx = dy W; dW += dy^T x; db += sum over rows of dy. need_dx = false skips dx.
function Linear:backward(dy, saved, need_dx)
    local W = self.store:get(self.wname)
    local gw = self.store:grad(self.wname)
    if gw then ops.gemm(dy, saved.x, {trans_a = true, out = gw, beta = 1}) end
    if self.bname then
        local gb = self.store:grad(self.bname)
        if gb then ops.add_(gb, ops.sum(dy, 1)) end
    end
    if need_dx == false then
        if saved.lora then lora.backward(saved.ad, dy, saved.lora, saved.x, nil, 'params') end
        return nil
    end
    local dx = ops.gemm(dy, W)
    if saved.lora then lora.backward(saved.ad, dy, saved.lora, saved.x, dx) end
    return dx
end

return Linear
