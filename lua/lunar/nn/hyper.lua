-- lunar.nn.HyperConnection: one mHC site of GLM-5.3-Flash (HF's Glm5NextTextHyperConnection),
-- the read of a block's input from the n residual streams and the write of its output back:
--
--   read(X[, lopts])  X (N, n, H) streams -> u (N, H) the block's input, and the site's weights
--            (lopts.row_invariant: the projection's product row-invariant, as a decode step needs):
--              z = fn . rmsnorm_unweighted(flatten X) * scale + base   (f32; scale per section)
--              pre, post, comb = lunar.ops.hc_weights(z)              (sigmoid, 2 sigmoid, Sinkhorn)
--              u = sum_j pre_j X_j                                    (in X's dtype)
--   write(X, a, site) -> Y = post a + comb^T X   (stream i: post_i a + sum_j comb[j, i] X_j)
--
-- backward runs the two in reverse: write_backward(dY, site) -> dX (the residual path), da;
-- read_backward(du, site, dX) adds the read's gradient into dX and the parameters' into the store.
-- Parameters (checkpoint names): prefix .. '_fn' ((2 + n) n, n H), '_base' ((2 + n) n) f32,
-- '_scale' (3) f32, e.g. model.language_model.layers.0.hc_attn_fn.
local core = require 'lunar.core'
local ops = require 'lunar.ops'

local Hyper = {}
Hyper.__index = Hyper

function Hyper.new(store, prefix, cfg)
    local n = cfg.hc_mult
    local self = setmetatable({store = store, name = prefix, n = n, H = cfg.hidden_size, iters = cfg.hc_sinkhorn_iters,
                               hc_eps = cfg.hc_eps, norm_eps = cfg.rms_norm_eps,
                               fn = prefix .. '_fn', base = prefix .. '_base', scale = prefix .. '_scale'}, Hyper)
    -- which of the 3 scales multiplies each of the (2 + n) n pre-activations
    local sec = {}
    for i = 1, (2 + n) * n do sec[i] = i <= n and 0 or (i <= 2 * n and 1 or 2) end
    self.section = sec
    return self
end

-- the (2 + n) n scale vector from scale (3)
local function scale_vector(self, dev)
    if not self.section_t or self.section_t:device() ~= dev then
        self.section_t = core.persist(core.from_flat(self.section, {#self.section}, 'i64', dev))
    end
    return ops.index_select(self.store:get(self.scale):float(), 1, self.section_t)
end

function Hyper:read(X, lopts)
    local N, n, H = X:size(1), self.n, self.H
    local flat = X:contiguous():view(N, n * H):float()
    local xn, rstd = ops.rmsnorm(flat, nil, self.norm_eps)
    local fn = self.store:get(self.fn):float()
    local r = ops.gemm(xn, fn, {trans_b = true, row_invariant = lopts and lopts.row_invariant})   -- (N, (2 + n) n)
    local sv = scale_vector(self, X:device())
    local z = ops.add(ops.mul(r, sv:view(1, -1)), self.store:get(self.base):float():view(1, -1))
    local pre, post, comb = ops.hc_weights(z, n, {iters = self.iters, eps = self.hc_eps})
    local u = ops.hc_collapse(X, pre):to(X:dtype())
    return u, {X = X, flat = flat, xn = xn, rstd = rstd, r = r, sv = sv, z = z, pre = pre, post = post, comb = comb}
end

function Hyper:write(X, a, site)
    return ops.hc_mix(X, a, site.post, site.comb):to(X:dtype())
end

-- dY (N, n, H) -> dX (the residual path, f32) and da (N, H); the weights' gradients kept in site
function Hyper:write_backward(dY, a, site)
    local dX, da, dpost, dcomb = ops.hc_mix_backward(dY, site.X, a, site.post, site.comb)
    site.dpost, site.dcomb = dpost, dcomb
    return dX, da
end

-- du (N, H) the gradient of the block's input; adds the read's gradient into dX (f32) and the
-- parameters' into the store; returns dX
function Hyper:read_backward(du, site, dX)
    local N, n, H = site.X:size(1), self.n, self.H
    local _, dpre = ops.hc_collapse_backward(du, site.X, site.pre, {dx = dX})
    local dz = ops.hc_weights_backward(dpre, site.dpost, site.dcomb, site.z, n, {iters = self.iters, eps = self.hc_eps})
    local gbase = self.store:grad(self.base)
    if gbase then ops.add_(gbase, ops.sum(dz, 1)) end
    local gscale = self.store:grad(self.scale)
    if gscale then
        local per = ops.sum(ops.mul(dz, site.r), 1)                 -- ((2 + n) n)
        ops.index_add_(gscale, 1, self.section_t, per)
    end
    local dr = ops.mul(dz, site.sv:view(1, -1))
    local gfn = self.store:grad(self.fn)
    if gfn then ops.gemm(dr, site.xn, {trans_a = true, out = gfn, beta = 1}) end
    local dxn = ops.gemm(dr, self.store:get(self.fn):float())       -- (N, n H)
    local dflat = ops.rmsnorm_backward(dxn, site.flat, nil, site.rstd)
    ops.add_(dX, dflat:view(N, n, H))
    return dX
end

return Hyper
