-- tests/mpi/common.lua: what the multi-rank tests share (loaded with dofile; ctest runs them from
-- the source root under mpirun).
--
-- suite(name, np): a lunar.testing suite whose failing case ends the whole job at once (os.exit(1)
-- under MPI aborts every rank, see lunar.dist), because the other ranks would otherwise wait in
-- the next collective. Exits 77 (skipped) when the world does not have np ranks.
local lunar = require 'lunar'
local testing = require 'lunar.testing'

local M = {}

function M.suite(name, np)
    local d = lunar.dist
    if d.world_size() ~= np then
        io.write(('%s: needs %d ranks (mpirun -np %d), have %d: skipped\n'):format(name, np, np, d.world_size()))
        os.exit(77)
    end
    local T = testing.suite(('%s [rank %d/%d]'):format(name, d.rank(), d.world_size()))
    local add = T.test
    function T.test(self, desc, fn)
        add(self, desc, function()
            local ok, err = xpcall(fn, debug.traceback)
            if not ok then
                io.stderr:write(('[rank %d] FAIL %s: %s\n'):format(d.rank(), desc, tostring(err)))
                io.stderr:flush()
                os.exit(1)
            end
        end)
    end
    return T
end

-- flat list of a tensor's values (any view, any dtype)
function M.values(t) return t:contiguous():tolist_flat() end

-- a non-contiguous view with t's shape and values: the transpose of a fresh (C, R) tensor
function M.strided_copy(t)
    local R, Cn = t:size(1), t:size(2)
    local base = lunar.empty({Cn, R}, {dtype = t:dtype(), device = t:device()})
    local v = base:t()
    v:copy_(t)
    assert(not v:is_contiguous())
    return v
end

return M
