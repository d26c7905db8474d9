-- lunar.parallel.mappings: the communication at the edges of a split block, each a forward and
-- its backward (Megatron's tensor- and sequence-parallel mappings). A module of lunar.nn holds the
-- mappings its parallel context (lunar.parallel.context) gave it and calls them whatever the
-- layout; on a model that is not split every one is the identity, and no module asks a group's
-- size.
--
--   mapping            forward(x)                     backward(d)
--   identity           x                              d
--   copy_to(g)         x                              all_reduce(d)      the input of a block whose
--                                                                        heads or columns are split
--   reduce_from(g)     all_reduce(x)                  d                  that block's output: the
--                                                                        members' partial sums
--   gather_rows(g)     all_gather(x) (rows)           reduce_scatter(d)  sequence parallel: a block's
--                                                                        input, every member's rows
--   scatter_rows(g)    reduce_scatter(x)              all_gather(d)      sequence parallel: a block's
--                                                                        partial output, this
--                                                                        member's rows of the sum
--   split_rows(g)      this member's rows of x        all_gather(d)      sequence parallel: the
--                                                                        embedding's output (whole
--                                                                        on every member)
--   gather_whole(g)    all_gather(x)                  this member's      sequence parallel: the
--                                                     rows of d          input of a head that is
--                                                                        whole on every member
--
-- forward and backward return the tensor to go on with (in place for the all-reduces). The
-- members of g call every mapping in the same order (they are collectives).
local dist = require 'lunar.dist'
local tensor = require 'lunar.tensor'

local M = {}

local function same(_, x) return x end

local Mapping = {}
Mapping.__index = Mapping

local function mapping(kind, g, forward, backward)
    return setmetatable({kind = kind, group = g, forward = forward, backward = backward}, Mapping)
end

function Mapping:__tostring() return 'mapping(' .. self.kind .. ')' end

M.identity = mapping('identity', nil, same, same)

local function all_reduce(self, x) return dist.all_reduce(x, {group = self.group}) end
local function all_gather(self, x) return dist.all_gather(x:contiguous(), {group = self.group}) end
local function reduce_scatter(self, x) return dist.reduce_scatter(x:contiguous(), {group = self.group}) end

-- this member's block of n / size consecutive rows
local function my_rows(self, x)
    local g = self.group
    local n = x:size(1) / g:size()
    return x:narrow(1, g:rank() * n + 1, n):contiguous()
end

function M.copy_to(g) return mapping('copy_to', g, same, all_reduce) end
function M.reduce_from(g) return mapping('reduce_from', g, all_reduce, same) end
function M.gather_rows(g) return mapping('gather_rows', g, all_gather, reduce_scatter) end
function M.scatter_rows(g) return mapping('scatter_rows', g, reduce_scatter, all_gather) end
function M.gather_whole(g) return mapping('gather_whole', g, all_gather, my_rows) end

-- split_rows(g): its forward also checks that the rows divide over the group (naming the batch)
function M.split_rows(g)
    return mapping('split_rows', g, function(self, x, b)
        local T = self.group:size()
        if x:size(1) % T ~= 0 then
            tensor.fail(('forward: sequence parallel splits the batch\'s %d tokens (B %d x T %d) over tp = %d ranks: '
                .. 'they must divide evenly'):format(x:size(1), b and b.B or 1, b and b.T or x:size(1), T))
        end
        return my_rows(self, x)
    end, all_gather)
end

function M.is_mapping(x) return getmetatable(x) == Mapping end

return M
