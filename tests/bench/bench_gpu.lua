-- bench_gpu.lua: lunar's CUDA kernels at GLM-5-layer sizes, as ratios measured in this run.
--   GEMM: bf16 y = x @ W^T (W stored (out, in) like a linear layer's weight, f32 accumulation)
--         for tokens 1024..16384 and hidden 2048..6144, in TFLOP/s and as MFU against the
--         H200's dense bf16 peak (989 TFLOP/s; LUNAR_PEAK_TFLOPS overrides it).
--   memory-bound ops: rmsnorm, softmax and cross-entropy (forward and backward), f32 and bf16,
--         in GB/s of the bytes they must move, and as a fraction of a device-to-device copy
--         (read + write) timed in the same run.
-- Every timed region is bracketed by lunar.synchronize('cuda') after warm-up calls; each figure
-- is the best of 3 rounds. Not part of ctest; tests/gpu/run.sh runs it and keeps the output.
-- Exit 77 without a CUDA device. LUNAR_GPU_DRY_RUN=1 runs tiny sizes on the CPU (to check the
-- script itself); LUNAR_BENCH_QUICK=1 runs fewer GEMM shapes.
--   ./build-gpu/lunar tests/bench/bench_gpu.lua
local lunar = require 'lunar'
local ffi = require 'ffi'
local DRY = os.getenv('LUNAR_GPU_DRY_RUN') == '1'
if not DRY and lunar.device_count('cuda') == 0 then
    print('no CUDA device: skipped')
    os.exit(77)
end
local DEV = DRY and 'cpu' or 'cuda'
local QUICK = os.getenv('LUNAR_BENCH_QUICK') == '1'
local PEAK = tonumber(os.getenv('LUNAR_PEAK_TFLOPS') or '') or 989
local ops = lunar.ops

ffi.cdef [[
typedef struct { long tv_sec; long tv_nsec; } lunar_bench_timespec;
int clock_gettime(int clk, lunar_bench_timespec *ts);
]]
local ts = ffi.new('lunar_bench_timespec')
local function now()
    ffi.C.clock_gettime(1, ts)   -- CLOCK_MONOTONIC
    return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9
end

-- seconds per call of fn: `warm` untimed calls, then the best of 3 rounds of `reps` calls, each
-- round between two synchronisations of the device
local function time(fn, reps, warm)
    for _ = 1, warm or 2 do fn() end
    lunar.synchronize(DEV)
    local best = math.huge
    for _ = 1, 3 do
        local t0 = now()
        for _ = 1, reps do fn() end
        lunar.synchronize(DEV)
        best = math.min(best, (now() - t0) / reps)
    end
    return best
end

-- repetitions so that one round lasts about `secs` given a first estimate
local function reps_for(fn, secs)
    fn()
    lunar.synchronize(DEV)
    local t0 = now()
    fn()
    lunar.synchronize(DEV)
    local one = math.max(now() - t0, 1e-6)
    return math.max(1, math.min(200, math.floor(secs / one)))
end

print(('lunar bench_gpu on %s%s'):format(DEV, DRY and ' (dry run: tiny sizes, numbers meaningless)' or ''))

-- ---- GEMM ----------------------------------------------------------------------------------
local TOKENS = DRY and {64} or (QUICK and {1024, 16384} or {1024, 4096, 16384})
local HIDDEN = DRY and {128} or (QUICK and {2048, 6144} or {2048, 4096, 6144})
-- per layer: an attention projection (H -> H), the MLP up (H -> 4H) and down (4H -> H)
local LAYER = {{'proj', 1, 1}, {'up', 1, 4}, {'down', 4, 1}}

print(('\nbf16 GEMM y = x @ W^T, f32 accumulation; MFU against %g TFLOP/s'):format(PEAK))
print(('%-6s %6s %6s %6s %6s %10s %10s %7s'):format('layer', 'tokens', 'hidden', 'K', 'N', 'ms', 'TFLOP/s', 'MFU'))
local best_mfu, worst_mfu, sum_mfu, n_mfu = 0, math.huge, 0, 0
for _, h in ipairs(HIDDEN) do
    for _, t in ipairs(TOKENS) do
        for _, l in ipairs(LAYER) do
            local k, n = h * l[2], h * l[3]
            lunar.scope(function()
                local x = lunar.randn(t, k, {dtype = 'bf16', device = DEV})
                local w = lunar.randn(n, k, {dtype = 'bf16', device = DEV}):mul(0.02)
                local y = lunar.empty({t, n}, {dtype = 'bf16', device = DEV})
                local opts = {trans_b = true, out = y}
                local fn = function() ops.gemm(x, w, opts) end
                local secs = time(fn, reps_for(fn, 0.05), 3)
                local tflops = 2 * t * k * n / secs * 1e-12
                local mfu = tflops / PEAK
                best_mfu, worst_mfu = math.max(best_mfu, mfu), math.min(worst_mfu, mfu)
                sum_mfu, n_mfu = sum_mfu + mfu, n_mfu + 1
                print(('%-6s %6d %6d %6d %6d %10.3f %10.1f %6.1f%%'):format(l[1], t, h, k, n, secs * 1e3, tflops,
                    100 * mfu))
                io.flush()
            end)
        end
    end
end
print(('GEMM MFU: mean %.1f%%, range %.1f%% .. %.1f%% over %d shapes'):format(100 * sum_mfu / n_mfu, 100 * worst_mfu,
    100 * best_mfu, n_mfu))

-- ---- memory-bound ops against a device-to-device copy --------------------------------------
local ROWS, COLS = 16384, 4096   -- 64M elements: far beyond the L2 (60 MB) in f32 and bf16
local CE_ROWS, VOCAB = 2048, 151552
if DRY then ROWS, COLS, CE_ROWS, VOCAB = 64, 256, 16, 1000 end

local copy_gbs = lunar.scope(function()
    local src = lunar.randn(ROWS * COLS, {device = DEV})
    local dst = lunar.empty({ROWS * COLS}, {device = DEV})
    local fn = function() dst:copy_(src) end
    local secs = time(fn, reps_for(fn, 0.05), 3)
    return 2 * ROWS * COLS * 4 / secs * 1e-9
end)
print(('\ndevice-to-device copy of %d MiB: %.0f GB/s (bytes read + written)'):format(ROWS * COLS * 4 / 2 ^ 20,
    copy_gbs))
print(('%-24s %5s %14s %10s %9s %8s'):format('op', 'dtype', 'shape', 'ms', 'GB/s', 'of copy'))

local function report(name, dt, shape, bytes, fn)
    local secs = time(fn, reps_for(fn, 0.05), 3)
    local gbs = bytes / secs * 1e-9
    print(('%-24s %5s %14s %10.3f %9.0f %7.1f%%'):format(name, dt, shape, secs * 1e3, gbs, 100 * gbs / copy_gbs))
    io.flush()
end

for _, dt in ipairs({'f32', 'bf16'}) do
    local es = dt == 'f32' and 4 or 2
    lunar.scope(function()
        local shape = ('%dx%d'):format(ROWS, COLS)
        local x = lunar.randn(ROWS, COLS, {dtype = dt, device = DEV})
        local w = lunar.ones(COLS, {dtype = dt, device = DEV})
        local y = lunar.empty({ROWS, COLS}, {dtype = dt, device = DEV})
        local rstd = lunar.empty({ROWS}, {device = DEV})
        local dy = lunar.randn(ROWS, COLS, {dtype = dt, device = DEV})
        local dx = lunar.empty({ROWS, COLS}, {dtype = dt, device = DEV})
        local n = ROWS * COLS
        -- x read, y written (the weight and the per-row statistics are negligible)
        report('rmsnorm', dt, shape, 2 * n * es, function() ops.rmsnorm(x, w, 1e-6, {out = y, rstd = rstd}) end)
        report('rmsnorm_backward', dt, shape, 3 * n * es,
            function() ops.rmsnorm_backward(dy, x, w, rstd, {out = dx}) end)
        report('softmax', dt, shape, 2 * n * es, function() ops.softmax(x, {out = y}) end)
        report('softmax_backward', dt, shape, 3 * n * es, function() ops.softmax_backward(dy, y, {out = dx}) end)
    end)
    lunar.scope(function()
        local shape = ('%dx%d'):format(CE_ROWS, VOCAB)
        local logits = lunar.randn(CE_ROWS, VOCAB, {dtype = dt, device = DEV})
        local targets = lunar.randint(0, VOCAB, {CE_ROWS}, {device = DEV})
        local dlogits = lunar.empty({CE_ROWS, VOCAB}, {dtype = dt, device = DEV})
        local _, _, lse = ops.cross_entropy(logits, targets)
        local n = CE_ROWS * VOCAB
        -- forward: the logits read once; backward: read and the gradient written
        report('cross_entropy', dt, shape, n * es, function() ops.cross_entropy(logits, targets) end)
        report('cross_entropy_backward', dt, shape, 2 * n * es,
            function() ops.cross_entropy_backward(1 / CE_ROWS, logits, lse, targets, {out = dlogits}) end)
    end)
end
print('\nbench_gpu: done')
