-- test_tensor.lua: constructors, views, copies, printing, errors, scopes and arenas from Lua.
local lunar = require 'lunar'
local T = require('lunar.testing').suite('tensor')

T:test('constructors and metadata', function()
    local z = lunar.zeros(2, 3)
    assert(z:dim() == 2 and z:size(1) == 2 and z:size(2) == 3 and z:numel() == 6)
    assert(z:dtype() == 'f32' and z:device() == 'cpu')
    local t = lunar.tensor({{1, 2, 3}, {4, 5, 6}}, {dtype = 'i64'})
    assert(t:dtype() == 'i64' and t:get(2, 3) == 6)
    local a = lunar.arange(5)
    T.equal(a, {0, 1, 2, 3, 4}, 'arange')
    T.equal(lunar.arange(1, 2, 0.25), {1, 1.25, 1.5, 1.75}, 'arange step')
    T.equal(lunar.full({2}, 7.5), {7.5, 7.5}, 'full')
    assert(lunar.ones(3, 'bf16'):dtype() == 'bf16')
    -- booleans alone make a bool tensor (torch.tensor does too); mixed with numbers, f32
    assert(lunar.tensor({true, false}):dtype() == 'bool', 'all-boolean table')
    assert(lunar.tensor(true):dtype() == 'bool', 'a boolean')
    assert(lunar.tensor({1, true}):dtype() == 'f32', 'numbers and booleans')
    T.equal(lunar.tensor({true}, 'f32'):tolist_flat(), {1}, 'booleans into an explicit dtype')
end)

T:test('views share storage and index 1-based', function()
    local t = lunar.arange(12):view(3, 4)
    local c = t:narrow(2, 2, 2)
    assert(c:size(1) == 3 and c:size(2) == 2 and c:get(3, 1) == 9)
    local r = t[2]
    assert(r:dim() == 1 and r[1] == 4)
    local tr = t:t()
    assert(not tr:is_contiguous() and tr:get(4, 3) == 11)
    c:fill_(-1)
    assert(t:get(1, 2) == -1 and t:get(1, 1) == 0, 'narrow writes through')
    T.equal(tr:contiguous():view(12), {0, 4, 8, -1, -1, -1, -1, -1, -1, 3, 7, 11}, 'transpose copy')
    assert(t:permute(2, 1):size(1) == 4)
    assert(t:view(2, -1):size(2) == 6)
    assert(t:unsqueeze(1):size(1) == 1 and t:unsqueeze(1):squeeze(1):dim() == 2)
end)

T:test('copies between overlapping views of one storage', function()
    -- shifting a buffer in place (a rolling window); the kernel's memcpy and its parallel
    -- blocks used to read elements another block had already overwritten
    for _, n in ipairs({5, 100000}) do
        local x = lunar.arange(n)
        x:narrow(1, 1, n - 1):copy_(x:narrow(1, 2, n - 1))
        local want = {}
        for i = 1, n - 1 do want[i] = i end
        want[n] = n - 1
        T.equal(x, want, 'shift left ' .. n)
        local y = lunar.arange(n)
        y:narrow(1, 2, n - 1):copy_(y:narrow(1, 1, n - 1))
        want = {0}
        for i = 2, n do want[i] = i - 2 end
        T.equal(y, want, 'shift right ' .. n)
    end
    local a = lunar.arange(9):view(3, 3)
    a:copy_(a:t())
    T.equal(a, {0, 3, 6, 1, 4, 7, 2, 5, 8}, 'a:copy_(a:t())')
    local b = lunar.arange(4)
    b:copy_(b)
    T.equal(b, {0, 1, 2, 3}, 'copy onto itself')
    local c = lunar.arange(6):view(2, 3)
    c:copy_(c:select(1, 2))   -- broadcast row 2 over both rows, row 2 included
    T.equal(c, {3, 4, 5, 3, 4, 5}, 'broadcast a row over its own tensor')
end)

T:test('casts and conversions', function()
    local x = lunar.tensor({1.5, -2.25, 3.0e38, 1e-3})
    local b = x:bf16()
    assert(b:dtype() == 'bf16')
    -- bf16 keeps 8 significant bits: rounding is within half an ulp (2^-9 relative)
    T.close(b:float(), x, {rtol = 2 ^ -9, atol = 0})
    T.equal(b:float():narrow(1, 1, 2), {1.5, -2.25}, 'exact values stay exact')
    local i = lunar.tensor({1.9, -1.9}):to('i32')
    T.equal(i, {1, -1}, 'float to int truncates')
    assert(x:to('f32') == x, 'to() with no change returns the same tensor')
end)

T:test('printing', function()
    local s = tostring(lunar.tensor({{1, 2}, {3, 4}}))
    assert(s:find(' 1 2\n 3 4\n', 1, true), s)
    assert(s:find('[lunar.f32 tensor of size 2x2]', 1, true), s)
    -- integer dtypes print every digit (they were switched to %.4e at 1e15; %d flipped 2^63's sign)
    s = tostring(lunar.tensor({2 ^ 53, -3, 123456789012345678}, 'i64'))
    assert(s:find(' 9007199254740992\n', 1, true) and s:find('               -3\n', 1, true), s)
    assert(s:find('123456789012345680', 1, true), s)
    s = tostring(lunar.tensor({2 ^ 63 - 1}, 'i64'))
    assert(s:find('9223372036854775808', 1, true) and not s:find('-', 1, true), s)
    local big = tostring(lunar.zeros(100, 100))
    assert(big:find('...', 1, true) and #big < 2000, 'large tensors are summarised')
end)

T:test('errors name shapes and point at the caller', function()
    local err = T.raises(function() lunar.zeros(2, 3):view(4, 2) end, 'has 6 elements')
    assert(err:find('test_tensor.lua:%d+:'), 'error points at the calling line: ' .. err)
    T.raises(function() lunar.zeros(2):narrow(1, 2, 5) end, 'out of bounds')
    -- positions and dims in messages are the caller's 1-based ones
    T.raises(function() lunar.zeros(4, 5):narrow(2, 4, 5) end, 'start 4, length 5 out of bounds for dim 2 (size 5)')
    T.raises(function() lunar.zeros(4, 5):narrow(2, 0, 1) end, 'start 0')
    T.raises(function() lunar.zeros(4, 5):select(1, 7) end, 'index 7 out of bounds for dim 1 (size 4)')
    T.raises(function() lunar.zeros(2, 2):size(3) end, 'dim 3 out of range')
    T.raises(function() lunar.ones(3):unsqueeze(5) end, 'unsqueeze: dim 5 out of range for a 1-dim tensor')
    T.equal(lunar.ones(3):unsqueeze(2):size(), {3, 1}, 'unsqueeze at the end')
    -- misuse names the tensor's shape: dtype, device, freed
    local ints = lunar.zeros(2, 3, 'i64')
    T.raises(function() lunar.ops.matmul(ints, lunar.zeros(3, 2)) end, "'tensor' (2, 3) must be a float tensor, not i64")
    local gone = lunar.zeros(4, 1)
    gone:free()
    T.raises(function() lunar.ops.silu(gone) end, "tensor 'tensor' (4, 1) used after free()")
    -- indices and integer values are never silently cut or wrapped
    T.raises(function() return lunar.arange(3)[1.5] end, 'index 1.5 is not an integer')
    T.raises(function() lunar.tensor({2 ^ 31}, 'i32') end, 'value 1 (2147483648) is out of range for i32')
    T.raises(function() lunar.tensor({1, 2.5}, 'i64') end, 'value 2 (2.5) is not an integer for i64')
    T.raises(function() lunar.zeros(2, 'u8'):set(1, 256) end, 'set: 256 is out of range for u8')
    T.equal(lunar.tensor({-128, 127}, 'i8'), {-128, 127}, 'i8 limits')
end)

T:test('sizes past 64 bits and negative expands are errors, not tiny tensors', function()
    -- 2^80 elements (or 2^64 bytes) used to wrap to a small allocation that :get could index past
    T.raises(function() lunar.empty({2 ^ 40, 2 ^ 40}) end, 'too large')
    T.raises(function() lunar.empty({2 ^ 62}) end, 'too large')
    T.raises(function() lunar.empty({2 ^ 70}) end, 'not a valid size')
    T.raises(function() lunar.zeros(3):expand(-1, 3) end, 'cannot be broadcast')
    T.raises(function() lunar.zeros(1, 3):expand(2 ^ 40, 2 ^ 40, 3) end, 'cannot be broadcast')
    T.raises(function() lunar.zeros(3):narrow(1, 2 ^ 62 + 1, 3 * 2 ^ 61) end, 'out of bounds')
    local x = lunar.zeros(1, 3):expand(-1, 3)
    assert(x:size(1) == 1 and x:size(2) == 3, '-1 keeps an existing size')
end)

T:test('free and use after free', function()
    local t = lunar.zeros(4)
    local v = t:narrow(1, 1, 2)
    t:free()
    t:free()   -- idempotent
    local err = T.raises(function() v:fill_(1) end, 'used after free')
    assert(err:find('test_tensor.lua'), err)
    -- the metatable is reachable, so __gc must check its argument (it used to release whatever
    -- userdata it got as a tensor) and leave a collected tensor unusable, not dangling
    local gc = getmetatable(lunar.zeros(1)).__gc
    T.raises(function() gc(lunar.rng(1)) end, 'expected a tensor')
    T.raises(function() gc({}) end, 'expected a tensor')
    local w = lunar.zeros(2)
    gc(w)
    gc(w)
    T.raises(function() w:fill_(1) end, 'no storage')
end)

T:test('scope frees what it does not return', function()
    local kept, inner
    kept = lunar.scope(function()
        inner = lunar.zeros(10)
        return lunar.ones(3)
    end)
    assert(not inner:is_valid(), 'inner tensor freed at scope exit')
    assert(kept:is_valid())
    T.equal(kept, {1, 1, 1}, 'returned tensor kept')
    -- results after a nil are returned and kept too
    local a, b, c = lunar.scope(function() return nil, lunar.ones(2), {lunar.full({2}, 3)} end)
    assert(a == nil and b:is_valid() and c[1]:is_valid(), 'values after a nil survive the scope')
    T.equal(b, {1, 1}, 'second result')
    T.equal(c[1], {3, 3}, 'tensor in the third result')
    T.equal(select('#', lunar.scope(function() return 1, nil, nil end)), 3, 'trailing nils kept')
end)

T:test('persist: a tensor made inside a scope can outlive it', function()
    local kept
    lunar.scope(function()
        lunar.scope(function() kept = lunar.persist(lunar.ones(3)) end)
    end)
    assert(kept:is_valid(), 'persisted tensor survives nested scopes')
    T.equal(kept, {1, 1, 1}, 'values intact')
end)

T:test('arena views go stale on reset', function()
    local a = lunar.arena('step', 65536)
    local x = a:tensor({4, 4}, 'f32', 'acts.x')
    local xv = x:narrow(1, 1, 2)                -- a view taken while the arena was live
    x:fill_(2)
    a:reset()
    local err = T.raises(function() x:fill_(1) end, "arena 'step'")
    assert(err:find('acts.x', 1, true), err)
    -- methods that would return the tensor itself raise too
    T.raises(function() x:float() end, "to: tensor 'acts.x' is a view of arena 'step'")
    T.raises(function() x:contiguous() end, "contiguous: tensor 'acts.x'")
    T.raises(function() xv:to('cpu') end, "to: tensor 'acts.x'")
    T.raises(function() a:tensor({1048576}) end, 'is full')
    -- an empty tensor of an empty arena is valid (its storage had a NULL pointer, which the
    -- validity check took for a freed one)
    local e = lunar.arena('empty', 0)
    local z = e:tensor({0, 3})
    assert(z:is_valid(), 'empty arena tensor is valid')
    T.equal(lunar.ops.sum(z, 1), {0, 0, 0}, 'sum of an empty arena tensor')
    T.raises(function() e:tensor({1}) end, 'is full')
end)

T:test('rng streams are reproducible and splittable', function()
    local r1, r2 = lunar.rng(5), lunar.rng(5)
    T.equal(r1:normal_(lunar.empty(50)), r2:normal_(lunar.empty(50)), 'same seed')
    local s = r1:state()
    local x = r1:uniform_(lunar.empty(10))
    r1:set_state(s)
    T.equal(r1:uniform_(lunar.empty(10)), x, 'state round trip')
    local a = r1:split('init'):uniform_(lunar.empty(5)):tolist_flat()
    local b = r1:split('dropout'):uniform_(lunar.empty(5)):tolist_flat()
    assert(a[1] ~= b[1], 'different purposes give different streams')
    local ints = lunar.randint(3, 7, {1000}, {rng = lunar.rng(1)}):tolist_flat()
    local lo, hi = math.huge, -math.huge
    for _, v in ipairs(ints) do lo = math.min(lo, v); hi = math.max(hi, v) end
    assert(lo == 3 and hi == 6, ('randint range %d..%d'):format(lo, hi))
end)

T:test('uniform stays below hi in every float dtype; randint checks its range fits the dtype', function()
    -- bf16 rounds about 1 draw of [0, 1) in 500 up to 1, and f32 rounds 1 - 2^-53 up to 1
    for _, dt in ipairs({'bf16', 'f16', 'f32', 'f8e4m3', 'f8e5m2'}) do
        local t = lunar.rng(2):uniform_(lunar.empty({200000}, dt), 0, 1):float()
        T.equal(t:ge(1):float():sum():item(), 0, dt .. ': draws of [0, 1) equal to 1')
        assert(t:min():item() >= 0, dt .. ': a draw below 0')
    end
    local b = lunar.rng(3):uniform_(lunar.empty({100000}, 'bf16'), 1, 2):float()
    assert(b:max():item() == 1.9921875 and b:min():item() == 1, 'bf16 [1, 2): ' .. b:max():item())
    local n = lunar.rng(3):uniform_(lunar.empty({100000}, 'bf16'), -2, -1):float()
    assert(n:max():item() == -1.0078125, 'bf16 [-2, -1) max ' .. n:max():item())
    T.equal(lunar.rng(1):uniform_(lunar.empty(3), 0.5, 0.5), {0.5, 0.5, 0.5}, 'lo == hi gives lo')
    T.raises(function() lunar.rng(1):uniform_(lunar.empty(3), 1, 0) end, '[lo 1, hi 0) is not a range')
    T.raises(function() lunar.rng(1):uniform_(lunar.empty(3), 0 / 0, 1) end, 'is not a range')
    T.raises(function() lunar.arange(5):narrow(1, 1.5, 2) end, 'narrow: start 1.5 is not an integer')
    -- uniform values below the clamp are the same as before it existed: f32 [0, 1) matches u01
    local f = lunar.rng(4):uniform_(lunar.empty(1000), -3, 5)
    assert(f:max():item() < 5 and f:min():item() >= -3, 'f32 [-3, 5)')
    T.raises(function() lunar.rng(1):randint_(lunar.empty({10}, 'i8'), 0, 200) end,
        'randint: [0, 200) does not fit i8')
    T.raises(function() lunar.rng(1):randint_(lunar.empty({10}, 'u8'), -1, 3) end, 'does not fit u8')
    T.raises(function() lunar.rng(1):randint_(lunar.empty({10}, 'bool'), 0, 3) end, 'does not fit bool')
    local u = lunar.rng(1):randint_(lunar.empty({1000}, 'u8'), 250, 256):float()
    assert(u:min():item() == 250 and u:max():item() == 255, 'u8 [250, 256)')
end)

T:test('config overrides parse and merge', function()
    local cfg = lunar.config
    local o = cfg.parse({'train.steps=10', 'model.path=/x', 'optim.betas=[0.9,0.95]', 'debug=true'})
    assert(o.train.steps == 10 and o.model.path == '/x' and o.optim.betas[2] == 0.95 and o.debug == true)
    -- keys are dotted names: empty parts and parts starting with a digit are errors, not merged
    for _, bad in ipairs({'a..b=3', '.x=1', 'x.=2', '1a=2', 'a.2b=1'}) do
        T.raises(function() cfg.parse({bad}) end, 'is not a dotted name')
    end
    local merged = cfg.merge({train = {steps = 1, lr = 0.1}}, {train = {steps = 5}})
    assert(merged.train.steps == 5 and merged.train.lr == 0.1)
    T.raises(function() cfg.merge({train = {steps = 1}}, {train = {stpes = 5}}) end, 'unknown config key "train.stpes"')
    T.raises(function() cfg.merge({train = {steps = 1}}, {train = {steps = 'x'}}) end, 'expects a number')
end)

os.exit(T:run())
