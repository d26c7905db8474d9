-- test_gpu_io.lua: saving CUDA tensors (contiguous and strided views, several dtypes) writes the
-- same bytes as saving their CPU copies, bf16/f16 results of CUDA kernels with NaNs save the
-- bytes of the CPU's results, and load_checkpoint{device='cuda'} dequantises FP8
-- weights on the GPU to the same values as on the CPU. Skipped (exit 77) without a CUDA device.
local lunar = require 'lunar'
if lunar.device_count('cuda') == 0 then
    print('no CUDA device: skipped')
    os.exit(77)
end
local T = require('lunar.testing').suite('gpu.io')
local lio = lunar.io

lunar.manual_seed(3)
local dir = os.tmpname()
os.remove(dir)
os.execute("mkdir -p '" .. dir .. "'")

local function slurp(p)
    local f = assert(io.open(p, 'rb'))
    local s = f:read('*a')
    f:close()
    return s
end

T:test('save_safetensors of CUDA tensors == of their CPU copies', function()
    local cpu = {a = lunar.randn(33, 17), b = lunar.randn(8, 9):to('bf16'), c = lunar.randint(0, 100, {5}),
                 d = (lunar.randn(4, 4) * 10):to('f8e4m3')}
    local gpu = {}
    for k, v in pairs(cpu) do gpu[k] = v:cuda() end
    gpu.e = lunar.randn(20, 30):cuda():t()   -- a strided view on the GPU
    cpu.e = gpu.e:cpu()
    lio.save_safetensors(dir .. '/cpu.safetensors', cpu)
    lio.save_safetensors(dir .. '/gpu.safetensors', gpu)
    T.equal(slurp(dir .. '/cpu.safetensors') == slurp(dir .. '/gpu.safetensors') and 1 or 0, 1, 'same bytes')
end)

-- a kernel's bf16/f16 output goes through common.cuh's lunar_from_f32, which must write the CPU's
-- NaN (bf16 0x7fc0, f16 0x7e00 | sign; CUDA's own conversions write 0x7fff) and round ties alike.
-- The NaNs are made positive (abs) for f16: a GPU multiply returns a positive NaN where x86 keeps
-- the sign of its NaN operand, and bf16 has one NaN for both signs.
T:test('computed bf16 and f16 outputs with NaNs save the same bytes as the CPU\'s', function()
    local vals, pos = {}, {}
    for i = 1, 64 do
        vals[i] = (i - 32) * 1.0078125
        pos[i] = 0.5 + i * 0.0078125
    end
    for _, v in ipairs({0 / 0, 0 / 0, math.huge, -math.huge, 0, 6e-8, 1e-5, 65504, 3e38}) do
        vals[#vals + 1] = v
        pos[#pos + 1] = 1.5
    end
    local ops = lunar.ops
    for _, dt in ipairs({'bf16', 'f16'}) do
        local x = ops.abs(lunar.tensor(vals, 'f64')):to(dt)
        local y = lunar.tensor(pos, 'f64'):to(dt)
        local xg, yg = x:cuda(), y:cuda()
        local cpu = {mul = ops.mul(x, y), add = ops.add(x, y), neg_mul = ops.mul(ops.neg(x), y)}
        local gpu = {mul = ops.mul(xg, yg), add = ops.add(xg, yg), neg_mul = ops.mul(ops.neg(xg), yg)}
        if dt == 'f16' then cpu.neg_mul, gpu.neg_mul = nil, nil end
        local a, b = dir .. '/nan_cpu_' .. dt .. '.safetensors', dir .. '/nan_gpu_' .. dt .. '.safetensors'
        lio.save_safetensors(a, cpu)
        lio.save_safetensors(b, gpu)
        T.equal(slurp(a) == slurp(b) and 1 or 0, 1, dt .. ': same bytes')
    end
end)

T:test('load_checkpoint on cuda: FP8 dequantised on the GPU', function()
    local q = (lunar.randn(300, 200) * 60):to('f8e4m3')
    local s = lunar.rand(3, 2) * 0.01
    lio.save_safetensors(dir .. '/fp8.safetensors', {['w.weight'] = q, ['w.weight_scale_inv'] = s})
    local g = lio.load_checkpoint(dir .. '/fp8.safetensors', {dtype = 'f32', device = 'cuda'})
    local c = lio.load_checkpoint(dir .. '/fp8.safetensors', {dtype = 'f32'})
    T.equal(g['w.weight']:device():match('^cuda') and 1 or 0, 1, 'on the GPU')
    T.equal(g['w.weight']:cpu(), c['w.weight'], 'same values')
end)

local rc = T:run()
os.execute("rm -rf '" .. dir .. "'")
os.exit(rc)
