-- test_cuda_status.lua: what lunar says about CUDA in each kind of build, on any machine.
--   * lunar.cuda_status() -> available, message: the devices found, or "CUDA is not available: "
--     and why: a build without CUDA says so, a CUDA build where the runtime found no device keeps
--     the runtime's own error (a missing driver or one too old for the runtime used to read as
--     "0 devices"); device_count('cuda') is 0 then;
--   * making a tensor or an arena on a CUDA device that is not there gives the same reason;
--   * a recipe asked for model.device=cuda gives it too.
local lunar = require 'lunar'
local T = require('lunar.testing').suite('cuda status')

local built, n = lunar.cuda_built(), lunar.device_count('cuda')
local ok, msg = lunar.cuda_status()

T:test('cuda_status says what was found, or why CUDA is not available', function()
    assert(type(ok) == 'boolean' and type(msg) == 'string')
    assert(ok == (n > 0), ('cuda_status %s with %d devices'):format(tostring(ok), n))
    if not built then
        assert(msg == 'CUDA is not available: this lunar was built without CUDA (LUNAR_WITH_CUDA=OFF, or no nvcc)', msg)
    elseif n == 0 then
        -- the runtime's error, with its name: e.g. cudaErrorNoDevice, cudaErrorInsufficientDriver
        assert(msg:find('^CUDA is not available: cudaGetDeviceCount: .+ %(cudaError%w+%)$'), msg)
    else
        assert(msg == ('%d CUDA device%s'):format(n, n == 1 and '' or 's'), msg)
    end
    local again_ok, again = lunar.cuda_status()
    assert(again_ok == ok and again == msg, 'asked twice: ' .. again)
end)

T:test('a tensor or an arena on a missing CUDA device names the reason', function()
    local dev = 'cuda:' .. n
    local err = T.raises(function() lunar.zeros(2, {device = dev}) end, 'device ' .. dev .. ' not available')
    local aerr = T.raises(function() lunar.arena('a', 64, dev) end, "arena 'a': device " .. dev .. ' not available')
    for _, e in ipairs({err, aerr}) do
        if ok then
            assert(not e:find('CUDA is not available', 1, true), e)
            assert(e:find(('(%d cuda device%s found)'):format(n, n == 1 and '' or 's'), 1, true), e)
        else
            assert(e:find(msg, 1, true), ('%q does not give the reason %q'):format(e, msg))
        end
    end
    -- a check point on it says the same
    if not ok then T.raises(function() lunar.sync_check(dev) end, msg) end
end)

T:test('a recipe that asks for model.device=cuda gives the reason', function()
    if ok then return end
    local common = dofile('recipes/common.lua')
    T.raises(function() common.run('sft', {quiet = true, model = {device = 'cuda'}, output = {dir = false}}) end,
        'wants model.device=cuda but ' .. msg)
end)

os.exit(T:run())
