-- test_gpu_fp8.lua: the CUDA FP8 block dequantisation against the CPU backend on the same
-- inputs. Both decode f8 with the shared inline code of lunar/dtype.h and do one f32 multiply,
-- so f32 results must be bit-identical; bf16/f16 outputs are the f32 result rounded once on
-- both sides (the CPU through its f32 kernel and a cast), so they are bit-identical too.
-- Skipped (exit 77) without a CUDA device.
local lunar = require 'lunar'
if lunar.device_count('cuda') == 0 then
    print('no CUDA device: skipped')
    os.exit(77)
end
local T = require('lunar.testing').suite('gpu.fp8')
local ops = lunar.ops

lunar.manual_seed(31)

T:test('CUDA fp8_block_dequant == CPU, exactly', function()
    for _, s in ipairs({{300, 200, 128, 128}, {576, 130, 128, 128}, {1, 1, 128, 128}, {3, 17, 128, 128},
                        {17, 1000, 128, 128}, {1000, 3, 64, 2}, {4096, 2048, 128, 128}}) do
        local m, n, bm, bn = s[1], s[2], s[3], s[4]
        for _, qdt in ipairs({'f8e4m3', 'f8e5m2'}) do
            local q = (lunar.randn(m, n) * 60):to(qdt)
            local sc = lunar.rand(math.ceil(m / bm), math.ceil(n / bn)) * 0.01 + 1e-4
            for _, dt in ipairs({'f32', 'bf16', 'f16'}) do
                local msg = ('%dx%d %s -> %s'):format(m, n, qdt, dt)
                local c = ops.fp8_block_dequant(q, sc, {dtype = dt, block = {bm, bn}})
                local g = ops.fp8_block_dequant(q:cuda(), sc:cuda(), {dtype = dt, block = {bm, bn}})
                T.equal(g:cpu(), c, msg)
            end
        end
    end
end)

T:test('CUDA: non-contiguous q and out, wrong scale shape', function()
    local q = (lunar.randn(200, 300) * 60):to('f8e4m3'):cuda():t()
    local sc = lunar.rand(3, 2):cuda()
    local big = lunar.zeros(300, 400, {device = 'cuda'})
    local out = big:narrow(2, 101, 200)
    ops.fp8_block_dequant(q, sc, {out = out})
    T.equal(out:cpu(), ops.fp8_block_dequant(q:cpu(), sc:cpu()), 'strided')
    T.raises(function() ops.fp8_block_dequant(q, sc:t()) end, 'has shape (2, 3)')
end)

os.exit(T:run())
