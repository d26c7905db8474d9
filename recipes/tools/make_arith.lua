-- recipes/tools/make_arith.lua: writes the tiny RL task's data (recipes/tools/arith.lua) to
-- examples/data/rl/: 200 held-out test problems, the SFT warm-up's chat rows and the RL
-- training prompts, none shared between sets.
--
--   lunar recipes/tools/make_arith.lua [seed=1] [test=200] [sft=3000] [train=4000] [direct=0]
--       [say=F or say=[F1,...,F10]]
--       [out=examples/data/rl]
--
-- The defaults are the shipped files' settings (tests/lua/test_rl_arith.lua regenerates them and
-- compares byte for byte).
local lunar = require 'lunar'
local here = (arg and arg[0] or 'recipes/tools/make_arith.lua'):match('^(.*/)') or './'
local arith = dofile(here .. 'arith.lua')

local opts = {seed = arith.SHIPPED.seed, test = arith.SHIPPED.test, sft = arith.SHIPPED.sft,
              train = arith.SHIPPED.train, direct = arith.SHIPPED.direct, say = arith.SHIPPED.say, out = here .. '../../examples/data/rl'}
for k, v in pairs(lunar.config.overrides()) do
    if opts[k] == nil then
        error(('make_arith: unknown option %q (known: direct, out, say, seed, sft, test, train)'):format(tostring(k)), 0)
    end
    opts[k] = v
end

local sets = arith.generate(opts)
lunar.core.fs.mkdir_p(opts.out)
for _, file in ipairs(arith.files(sets)) do
    local path = opts.out .. '/' .. file.name
    local f = assert(io.open(path, 'wb'))
    f:write(file.text)
    f:close()
    local rows = select(2, file.text:gsub('\n', ''))
    print(('%s: %d rows, %d bytes'):format(path, rows, #file.text))
end
