-- lunar.ops.fp8: FP8 block dequantisation (DeepSeek-V3 / GLM-5 FP8 checkpoints).
--   fp8_block_dequant(q, scale_inv, {dtype='f32', block={128, 128}, out=})   -> (M, N)
-- out[i][j] = f32(q[i][j]) * scale_inv[ceil-div block of (i, j)], computed in f32 and rounded
-- once to dtype. q (M, N) f8e4m3/f8e5m2, scale_inv (ceil(M/128), ceil(N/128)).
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local C = core.ops

local M = {}

function M.fp8_block_dequant(q, scale_inv, opts)
    tensor.check(q, 'q', 'fp8_block_dequant')
    tensor.check(scale_inv, 'scale_inv', 'fp8_block_dequant')
    opts = opts or {}
    local block = opts.block or {128, 128}
    local out = opts.out
    if not out then
        local s = q:size()
        out = core.empty({s[1], s[2] or 0}, opts.dtype or 'f32', q:device())
        out:set_name(q:name())
    end
    return C.fp8_block_dequant(out, q, scale_inv, block[1], block[2])
end

return M
