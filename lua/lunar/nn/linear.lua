-- lunar.nn.Linear: y = x W^T (+ b), W stored [out, in] like torch. x (N, in) -> y (N, out).
local ops = require 'lunar.ops'

local Linear = {}
Linear.__index = Linear

-- Linear.new(store, name, {bias = false}): reads `name .. '.weight'` (and '.bias') from store.
function Linear.new(store, name, opts)
    opts = opts or {}
    return setmetatable({store = store, name = name, wname = name .. '.weight',
                         bname = opts.bias and (name .. '.bias') or nil}, Linear)
end

function Linear:weight() return self.store:get(self.wname) end

function Linear:forward(x)
    local y = ops.gemm(x, self.store:get(self.wname), {trans_b = true})
    if self.bname then ops.add_(y, self.store:get(self.bname)) end
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
    if need_dx == false then return nil end
    return ops.gemm(dy, W)
end

return Linear
