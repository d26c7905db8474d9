-- test_rl_deal.lua: which data-parallel rank generates each prompt of an RL round
-- (lunar.rl.parallel.mine), for every dp size 1-8, round size 1-40 and mini-batch count 1-6:
--   * every prompt goes to exactly one rank, and each rank's list is increasing;
--   * each mini-batch (as lunar.rl.batch cuts it: rl.parallel.bounds) of at least dp prompts
--     gives every rank a consecutive block of them, no two blocks differing by more than one;
--   * a mini-batch of fewer prompts than ranks gives them to different ranks, and over the round
--     the ranks' counts differ by at most the number of mini-batches; 8 prompts in 4 mini-batches
--     over 4 ranks give each rank 2 (dealing each mini-batch from rank 0 gave ranks 0 and 2 all 8).
local rlpar = require 'lunar.rl.parallel'
local T = require('lunar.testing').suite('rl.parallel deal')

T:test('every prompt has one rank; mini-batches split evenly; small ones spread over the ranks', function()
    local cases = 0
    for D = 1, 8 do
        for count = 1, 40 do
            for mini = 1, 6 do
                local k = math.max(1, math.min(mini, count))
                local rank_of, per_rank = {}, {}
                for r = 0, D - 1 do
                    local list = rlpar.mine({size = D, rank = r}, count, mini)
                    per_rank[r] = #list
                    for j, i in ipairs(list) do
                        assert(not rank_of[i], ('D %d count %d: prompt %d on ranks %s and %d'):format(D, count, i,
                            tostring(rank_of[i]), r))
                        assert(j == 1 or i > list[j - 1], 'increasing')
                        rank_of[i] = r
                    end
                end
                for i = 1, count do assert(rank_of[i], ('D %d count %d: prompt %d on no rank'):format(D, count, i)) end
                for m = 1, k do
                    local first, last = rlpar.bounds(count, k, m)
                    local n, seen, sizes = last - first + 1, {}, {}
                    for i = first, last do
                        local r = rank_of[i]
                        if n >= D then
                            assert(i == first or r == rank_of[i - 1] or r == rank_of[i - 1] + 1,
                                ('D %d count %d mini %d: block of rank %d not consecutive'):format(D, count, mini, r))
                            sizes[r] = (sizes[r] or 0) + 1
                        else
                            assert(not seen[r], ('D %d count %d mini-batch %d: two of its %d prompts on rank %d')
                                :format(D, count, m, n, r))
                            seen[r] = true
                        end
                    end
                    if n >= D then
                        local lo, hi = math.huge, 0
                        for r = 0, D - 1 do lo, hi = math.min(lo, sizes[r] or 0), math.max(hi, sizes[r] or 0) end
                        assert(hi - lo <= 1, ('D %d count %d mini %d: blocks of %d to %d'):format(D, count, m, lo, hi))
                    end
                end
                local lo, hi = math.huge, 0
                for r = 0, D - 1 do lo, hi = math.min(lo, per_rank[r]), math.max(hi, per_rank[r]) end
                assert(hi - lo <= k, ('D %d count %d mini %d: ranks hold %d to %d prompts'):format(D, count, mini,
                    lo, hi))
                cases = cases + 1
            end
        end
    end
    T.equal(cases, 8 * 40 * 6, 'cases')
    -- 8 prompts in 4 mini-batches of 2 over 4 ranks reach every rank
    for r = 0, 3 do T.equal(#rlpar.mine({size = 4, rank = r}, 8, 4), 2, 'rank ' .. r .. ' of 4: 2 prompts') end
end)

os.exit(T:run())
