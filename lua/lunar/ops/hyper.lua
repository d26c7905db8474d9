-- lunar.ops.hyper: mHC hyper-connections, GLM-5.3-Flash's n residual streams (contracts in
-- host/include/lunar/ops.h). Per token row r, f32:
--   hc_weights(z, n, {iters=, eps=})                     -> pre (N, n), post (N, n), comb (N, n, n)
--       z (N, (2 + n) n) the site's pre-activations [pre | post | comb]: pre = sigmoid + eps,
--       post = 2 sigmoid, comb = Sinkhorn(softmax(z_comb) + eps) (iters column divisions and
--       iters - 1 row divisions, the last a column one)
--   hc_weights_backward(dpre, dpost, dcomb, z, n, {iters=, eps=})   -> dz
--   hc_mix(x, a, post, comb)                             -> y (N, n, H): y_i = post_i a + sum_j comb[j, i] x_j
--   hc_mix_backward(dy, x, a, post, comb)                -> dx, da, dpost, dcomb
--   hc_collapse(x, pre)                                  -> u (N, H) = sum_j pre_j x_j
--   hc_collapse_backward(du, x, pre, {dx=})              -> dx (accumulated into opts.dx), dpre
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local C = core.ops
local check = tensor.check

local M = {}

local function f32(shape, like) return core.empty(shape, 'f32', like:device()) end

local function hparams(opts, op)
    local iters, eps = opts.iters, opts.eps
    if type(iters) ~= 'number' or type(eps) ~= 'number' then
        tensor.fail(op .. ': opts.iters (Sinkhorn iterations) and opts.eps (hc_eps) are required')
    end
    return iters, eps
end

function M.hc_weights(z, n, opts)
    check(z, 'z', 'hc_weights')
    local iters, eps = hparams(opts or {}, 'hc_weights')
    local N = z:size(1)
    return C.hc_weights(f32({N, n}, z), f32({N, n}, z), f32({N, n, n}, z), z, n, iters, eps)
end

function M.hc_weights_backward(dpre, dpost, dcomb, z, n, opts)
    check(z, 'z', 'hc_weights_backward')
    local iters, eps = hparams(opts or {}, 'hc_weights_backward')
    return C.hc_weights_backward(f32(z:size(), z), dpre, dpost, dcomb, z, n, iters, eps)
end

function M.hc_mix(x, a, post, comb)
    check(x, 'x', 'hc_mix')
    return C.hc_mix(f32(x:size(), x), x, a, post, comb)
end

function M.hc_mix_backward(dy, x, a, post, comb)
    check(x, 'x', 'hc_mix_backward')
    check(a, 'a', 'hc_mix_backward')
    check(comb, 'comb', 'hc_mix_backward')
    return C.hc_mix_backward(f32(x:size(), x), f32(a:size(), a), f32(post:size(), post), f32(comb:size(), comb),
                             dy, x, a, post, comb)
end

function M.hc_collapse(x, pre)
    check(x, 'x', 'hc_collapse')
    return C.hc_collapse(f32({x:size(1), x:size(3)}, x), x, pre)
end

function M.hc_collapse_backward(du, x, pre, opts)
    opts = opts or {}
    check(x, 'x', 'hc_collapse_backward')
    local dx = opts.dx or f32(x:size(), x):fill_(0)
    return C.hc_collapse_backward(dx, f32(pre:size(), pre), du, x, pre)
end

return M
