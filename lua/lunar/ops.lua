-- lunar.ops: every op, with friendly signatures that allocate their outputs (pass `out=` in the
-- options to write into an existing tensor). One module per family under lunar/ops/; each
-- returns a table of functions that is merged here.
local M = {}

local families = {'gemm', 'elementwise', 'reduce', 'softmax', 'norm', 'rope', 'index', 'sort', 'mask', 'adamw', 'fp8', 'attention', 'kda', 'hyper'}

for _, fam in ipairs(families) do
    local mod = require('lunar.ops.' .. fam)
    for name, f in pairs(mod) do
        if M[name] ~= nil then error('lunar.ops: ' .. name .. ' defined twice (family ' .. fam .. ')') end
        M[name] = f
    end
end

return M
