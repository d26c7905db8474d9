-- test_gpu_io.lua: saving CUDA tensors (contiguous and strided views, several dtypes) writes the
-- same bytes as saving their CPU copies, and load_checkpoint{device='cuda'} dequantises FP8
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
