-- lunar.ops.elementwise: arithmetic, comparisons and activations, elementwise.
--   add sub mul div pow maximum minimum (a, b, {out=})   a or b may be a number; tensors
--       broadcast (numpy rules). The result has the float dtype of the tensor operand(s), f32 when
--       they have two different float dtypes (or none).
--   eq ne lt le gt ge (a, b, {out=, dtype='bool'})       1/0 results, bool unless dtype says
--   add_ sub_ mul_ div_ (a, b)                           in place: a = a <op> b, returns a
--   neg abs exp log sqrt rsqrt reciprocal square tanh sigmoid silu gelu gelu_tanh relu sin cos
--       (x, {out=}); gelu is the exact erf form, gelu_tanh the tanh approximation
--   <unary>_backward(dy, x, {out=}) -> dx = dy * f'(x)
--   swiglu(gate, up, {out=}) -> silu(gate) * up
--   swiglu_backward(dout, gate, up, {dgate=, dup=}) -> dgate, dup
--   masked_fill(x, mask, value, {out=}), masked_fill_(x, mask, value): value where mask is true;
--       mask (bool/u8) broadcasts to x. Its backward is masked_fill(dy, mask, 0).
-- The tensor operators + - * / ^ and unary - call add, sub, mul, div, pow and neg.
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local C = core.ops

local M = {}

local is_tensor = tensor.is_tensor
local fail = tensor.fail
local floats = tensor.FLOAT_DTYPES

local function float_dtype(...)
    local dt
    for i = 1, select('#', ...) do
        local x = select(i, ...)
        if is_tensor(x) and floats[x:dtype()] then
            if dt and dt ~= x:dtype() then return 'f32' end
            dt = x:dtype()
        end
    end
    return dt or 'f32'
end

local function shape_str(t) return '(' .. table.concat(t:size(), ', ') .. ')' end

local function out_shape(name, a, b)
    if not is_tensor(b) then return a:size() end
    if not is_tensor(a) then return b:size() end
    -- numpy rules from the sizes alone (the op itself checks that the tensors are usable)
    local sa, sb = a:size(), b:size()
    local n = math.max(#sa, #sb)
    local shape = {}
    for i = 1, n do
        local x, y = sa[i - n + #sa] or 1, sb[i - n + #sb] or 1
        if x ~= y and x ~= 1 and y ~= 1 then
            fail(('%s: a %s and b %s do not broadcast together'):format(name, shape_str(a), shape_str(b)))
        end
        shape[i] = x == 1 and y or x
    end
    return shape
end

-- number-first forms: the op applied as tensor <op'> number
local swapped = {add = 'add', sub = 'rsub', mul = 'mul', div = 'rdiv', maximum = 'maximum', minimum = 'minimum',
                 eq = 'eq', ne = 'ne', lt = 'gt', le = 'ge', gt = 'lt', ge = 'le'}

local function binary(name, a, b, opts, out_dtype)
    opts = opts or {}
    local ta, tb = is_tensor(a), is_tensor(b)
    if not ta and not tb then
        fail(('%s: expected a tensor operand, got a %s and a %s'):format(name, type(a), type(b)))
    end
    if (not ta and type(a) ~= 'number') or (not tb and type(b) ~= 'number') then
        fail(('%s: operands must be tensors or numbers, got a %s and a %s'):format(name, type(a), type(b)))
    end
    local ref = ta and a or b
    local out = opts.out or core.empty(out_shape(name, a, b), out_dtype or float_dtype(a, b), ref:device())
    if tb and not ta then
        local op = swapped[name]
        if op then return C.binary(out, b, a, op) end
        -- no reversed form (pow): the number becomes a 0-dim tensor that broadcasts, filled on
        -- b's device (no host->device copy)
        a = core.empty({}, float_dtype(b), b:device()):fill_(a)
    end
    return C.binary(out, a, b, name)
end

for _, name in ipairs({'add', 'sub', 'mul', 'div', 'pow', 'maximum', 'minimum'}) do
    M[name] = function(a, b, opts) return binary(name, a, b, opts) end
end

for _, name in ipairs({'eq', 'ne', 'lt', 'le', 'gt', 'ge'}) do
    M[name] = function(a, b, opts) return binary(name, a, b, opts, opts and opts.dtype or 'bool') end
end

for _, name in ipairs({'add', 'sub', 'mul', 'div'}) do
    M[name .. '_'] = function(a, b)
        if not is_tensor(a) then fail(('%s_: the first operand must be a tensor (it is written), got a %s'):format(
            name, type(a))) end
        return C.binary(a, a, b, name)
    end
end

local unary_ops = {'neg', 'abs', 'exp', 'log', 'sqrt', 'rsqrt', 'reciprocal', 'square', 'tanh', 'sigmoid', 'silu',
                   'gelu', 'gelu_tanh', 'relu', 'sin', 'cos'}

local check_tensor = tensor.check

for _, name in ipairs(unary_ops) do
    M[name] = function(x, opts)
        check_tensor(x, 'x', name)
        local out = opts and opts.out or core.empty(x:size(), float_dtype(x), x:device())
        return C.unary(out, x, name)
    end
    M[name .. '_backward'] = function(dy, x, opts)
        check_tensor(dy, 'dy', name .. '_backward')
        check_tensor(x, 'x', name .. '_backward')
        local dx = opts and opts.out or core.empty(x:size(), float_dtype(dy, x), x:device())
        return C.unary_backward(dx, dy, x, name)
    end
end

function M.swiglu(gate, up, opts)
    check_tensor(gate, 'gate', 'swiglu')
    check_tensor(up, 'up', 'swiglu')
    local out = opts and opts.out or core.empty(gate:size(), float_dtype(gate, up), gate:device())
    return C.swiglu_forward(out, gate, up)
end

function M.swiglu_backward(dout, gate, up, opts)
    opts = opts or {}
    check_tensor(dout, 'dout', 'swiglu_backward')
    check_tensor(gate, 'gate', 'swiglu_backward')
    check_tensor(up, 'up', 'swiglu_backward')
    local dt = float_dtype(gate, up)
    local dgate = opts.dgate or core.empty(gate:size(), dt, gate:device())
    local dup = opts.dup or core.empty(up:size(), dt, up:device())
    return C.swiglu_backward(dgate, dup, dout, gate, up)
end

function M.masked_fill(x, mask, value, opts)
    check_tensor(x, 'x', 'masked_fill')
    check_tensor(mask, 'mask', 'masked_fill')
    local out = opts and opts.out or core.empty(x:size(), float_dtype(x), x:device())
    return C.masked_fill(out, x, mask, value)
end

function M.masked_fill_(x, mask, value)
    check_tensor(x, 'x', 'masked_fill_')
    check_tensor(mask, 'mask', 'masked_fill_')
    return C.masked_fill(x, x, mask, value)
end

return M
