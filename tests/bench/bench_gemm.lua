-- bench_gemm.lua: lunar.ops.gemm against cblas_sgemm called directly (through the FFI) on the
-- same shapes and values. Prints GFLOP/s and the ratio (blas time / lunar time); not part of
-- ctest. Timings are the best of 5 rounds; run it on an otherwise idle machine.
--   ./build-cpu/lunar tests/bench/bench_gemm.lua
local lunar = require 'lunar'
local ffi = require 'ffi'

ffi.cdef [[
typedef struct { long tv_sec; long tv_nsec; } lunar_bench_timespec;
int clock_gettime(int clk, lunar_bench_timespec *ts);
void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc);
void openblas_set_num_threads(int n);
]]

local ts = ffi.new('lunar_bench_timespec')
local function now()
    ffi.C.clock_gettime(1, ts)
    return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9
end

-- best of `rounds` timings of `reps` calls
local function time(fn, reps, rounds)
    local best = math.huge
    for _ = 1, rounds do
        local t0 = now()
        for _ = 1, reps do fn() end
        best = math.min(best, (now() - t0) / reps)
    end
    return best
end

-- Tensor data addresses are not exposed to Lua, so the direct calls get FFI buffers holding the
-- same values; both sides run with the same OpenBLAS thread count.
local threads = lunar.threads()
ffi.C.openblas_set_num_threads(threads)
print(('threads %d'):format(threads))
print(('%-26s %10s %10s %7s'):format('M x N x K (trans)', 'blas GF/s', 'lunar GF/s', 'ratio'))

local CblasRowMajor, NoTrans, Trans = 101, 111, 112
local cases = {
    {64, 64, 64, false}, {256, 256, 256, false}, {512, 512, 512, false}, {1024, 1024, 1024, false},
    {2048, 512, 512, false}, {512, 512, 512, true}, {4096, 256, 64, false}, {64, 2048, 2048, true},
}
for _, c in ipairs(cases) do
    local m, n, k, tb = c[1], c[2], c[3], c[4]
    local a, b, out = lunar.randn(m, k), tb and lunar.randn(n, k) or lunar.randn(k, n), lunar.empty(m, n)
    local pa, pb, pc = ffi.new('float[?]', m * k), ffi.new('float[?]', k * n), ffi.new('float[?]', m * n)
    local av, bv = a:tolist_flat(), b:tolist_flat()
    for i = 1, m * k do pa[i - 1] = av[i] end
    for i = 1, k * n do pb[i - 1] = bv[i] end
    local flops = 2 * m * n * k
    local reps = math.max(1, math.floor(2e9 / flops))
    local bt = b:t()   -- the trans case passes the transposed view: lunar must not copy it
    local ldb = tb and k or n
    local t_blas = time(function()
        ffi.C.cblas_sgemm(CblasRowMajor, NoTrans, tb and Trans or NoTrans, m, n, k, 1, pa, k, pb, ldb, 0, pc, n)
    end, reps, 5)
    local opts = {out = out}
    local t_lunar = time(function()
        if tb then lunar.ops.gemm(a, bt, opts) else lunar.ops.gemm(a, b, opts) end
    end, reps, 5)
    print(('%-26s %10.1f %10.1f %7.3f'):format(('%dx%dx%d%s'):format(m, n, k, tb and ' (b^T view)' or ''),
        flops / t_blas * 1e-9, flops / t_lunar * 1e-9, t_blas / t_lunar))
end
