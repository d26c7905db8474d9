-- lunar.ops.mask: attention masks.
--   causal_mask(tq[, tk], {offset=0, dtype='bool', device=, out=})  -> (tq, tk): k visible iff k <= q + offset
--   block_mask(cu_seqlens, {causal=true, dtype='bool', out=})      -> (T, T) for packed documents
-- bool masks are true where attention is allowed; float masks are 0 there and -inf elsewhere.
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local C = core.ops

local M = {}

function M.causal_mask(tq, tk, opts)
    if type(tk) == 'table' then opts, tk = tk, nil end
    opts = opts or {}
    local out = opts.out or core.empty({tq, tk or tq}, opts.dtype or 'bool', opts.device)
    return C.causal_mask(out, opts.offset or 0)
end

function M.block_mask(cu_seqlens, opts)
    tensor.check(cu_seqlens, 'cu_seqlens', 'block_mask')
    opts = opts or {}
    local out = opts.out
    if not out then   -- T is the last offset: read back here (give `out` to avoid the read on a device)
        local t = 0
        if cu_seqlens:dim() == 1 and cu_seqlens:numel() > 0 then t = cu_seqlens:get(cu_seqlens:numel()) end
        out = core.empty({t, t}, opts.dtype or 'bool', opts.device or cu_seqlens:device())
    end
    return C.block_mask(out, cu_seqlens, opts.causal ~= false)
end

return M
