-- recipes/tools/arith.lua: arithmetic word problems in GSM8K's format, for the tiny RL presets:
-- one or two operations (+, -, x) on small numbers, a worked solution of one equation a line,
-- then "#### N". A tiny model learns the format from a short SFT warm-up but gets the arithmetic
-- right only part of the time, so sampled answers differ in correctness: the signal GRPO and
-- DAPO learn from. `say` makes a fraction of the warm-up's rows (one per story, or one for all)
-- end in "The answer is N." instead of "#### N": the GSM8K graders read only the latter, so the
-- warm-up's model answers in a format that scores in some stories and mostly in one that does not
-- in the others, and RL has a format to find as well as sums to get right (the shipped files: 70%
-- "#### N" for the one-step sums and differences, 30% for the rest). `direct` makes some rows
-- give the final line alone (the shipped files have none). recipes/tools/make_arith.lua writes
-- the shipped files with it.
--
--   local arith = dofile('recipes/tools/arith.lua')
--   local sets = arith.generate({seed = 1, test = 200, sft = 3000, train = 4000, direct = 0, say = 0.5})
--   -- sets.test[i] = {question =, answer = "7 + 5 = 12\n12 - 3 = 9\n#### 9", result = 9}
--   arith.user_prompt(sets.test[1].question)   -- the question with the GSM8K instruction
--
-- The sets are drawn in the order test, sft, train from one stream seeded by `seed`; a question
-- already drawn is drawn again, so no question is in two sets (or twice in one). The stream is a
-- Park-Miller generator in plain double arithmetic, so the files are the same on every machine
-- and LuaJIT version.
local M = {}

-- the instruction lunar.eval.grade.prompt appends for the GSM8K graders (verl's data
-- preparation); the warm-up trains on the prompt the RL loop and the evaluation will show
M.INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

function M.user_prompt(question) return question .. ' ' .. M.INSTRUCTION end

-- ---- the random stream -------------------------------------------------------------------

local MODULUS, MULTIPLIER = 2147483647, 48271   -- state * MULTIPLIER < 2^47: exact in a double

local function stream(seed)
    if type(seed) ~= 'number' or seed ~= math.floor(seed) or seed < 1 or seed >= MODULUS then
        error(('arith: seed must be an integer in [1, %d], got %s'):format(MODULUS - 1, tostring(seed)), 3)
    end
    local state = seed
    local s = {}
    -- an integer in [lo, hi]
    function s.int(lo, hi)
        state = state * MULTIPLIER % MODULUS
        return lo + state % (hi - lo + 1)
    end
    function s.pick(list) return list[s.int(1, #list)] end
    return s
end

-- ---- the stories -------------------------------------------------------------------------

local PEOPLE = {{'Tom', 'He'}, {'Mia', 'She'}, {'Sam', 'He'}, {'Anna', 'She'}, {'Ben', 'He'}, {'Lily', 'She'},
    {'Max', 'He'}, {'Emma', 'She'}, {'Jack', 'He'}, {'Sara', 'She'}, {'Leo', 'He'}, {'Nina', 'She'}}
local ITEMS = {'apples', 'pencils', 'stickers', 'marbles', 'cookies', 'books', 'cards', 'shells', 'toys',
    'flowers', 'eggs', 'stamps'}

-- the largest number a problem shows or reaches (every intermediate result too)
M.MAX_VALUE = 99

-- Each story: the numbers it draws (ranges), a check they make sense, the question, and its
-- steps {a, op, b} where an operand is a drawn number's name or 'r1' (the first step's result).
local STORIES = {
    {draw = {a = {2, 30}, b = {2, 30}}, steps = {{'a', '+', 'b'}},
     text = '{N} has {a} {I}. {P} buys {b} more {I}. How many {I} does {N} have now?'},
    {draw = {a = {5, 40}, b = {2, 30}}, ok = function(v) return v.b < v.a end, steps = {{'a', '-', 'b'}},
     text = '{N} has {a} {I}. {P} gives {b} {I} to {F}. How many {I} does {N} have left?'},
    {draw = {a = {2, 9}, b = {2, 9}}, steps = {{'a', 'x', 'b'}},
     text = '{N} buys {a} boxes of {I}. Each box holds {b} {I}. How many {I} does {N} buy?'},
    {draw = {a = {2, 30}, b = {2, 30}}, steps = {{'a', '+', 'b'}},
     text = '{F} has {a} {I}. {N} has {b} more {I} than {F}. How many {I} does {N} have?'},
    {draw = {a = {5, 40}, b = {2, 30}}, ok = function(v) return v.b < v.a end, steps = {{'a', '-', 'b'}},
     text = '{F} has {a} {I}. {N} has {b} fewer {I} than {F}. How many {I} does {N} have?'},
    {draw = {a = {2, 30}, b = {2, 30}, c = {2, 30}}, ok = function(v) return v.c < v.a + v.b end,
     steps = {{'a', '+', 'b'}, {'r1', '-', 'c'}},
     text = '{N} has {a} {I}. {P} buys {b} more and then gives {c} to {F}. How many {I} does {N} have now?'},
    {draw = {a = {2, 9}, b = {2, 9}, c = {2, 30}}, steps = {{'a', 'x', 'b'}, {'r1', '+', 'c'}},
     text = '{N} buys {a} boxes with {b} {I} in each box. {P} already had {c} {I}. How many {I} does {N} have now?'},
    {draw = {a = {2, 9}, b = {2, 9}, c = {2, 30}}, ok = function(v) return v.c < v.a * v.b end,
     steps = {{'a', 'x', 'b'}, {'r1', '-', 'c'}},
     text = '{N} buys {a} boxes with {b} {I} in each box and uses {c} of them. How many {I} are left?'},
    {draw = {a = {2, 30}}, steps = {{'a', 'x', '2'}, {'a', '+', 'r1'}},
     text = '{F} has {a} {I}. {N} has twice as many {I} as {F}. How many {I} do they have together?'},
    {draw = {a = {2, 30}, b = {2, 30}, c = {2, 30}}, ok = function(v) return v.c < v.a + v.b end,
     steps = {{'a', '+', 'b'}, {'r1', '-', 'c'}},
     text = '{N} picks {a} {I} in the morning and {b} in the afternoon. {P} loses {c} of them. How many {I} '
         .. 'does {N} have?'},
}
M.STORIES = STORIES

local APPLY = {
    ['+'] = function(x, y) return x + y end,
    ['-'] = function(x, y) return x - y end,
    ['x'] = function(x, y) return x * y end,
}
M.APPLY = APPLY

-- the value of an operand: a drawn number, a literal, or r1
local function value(name, v, results)
    if name == 'r1' then return results[1] end
    return v[name] or tonumber(name)
end

-- one problem from the stream, or nil when the drawn numbers do not make a sensible one
local function draw(s)
    local which = s.int(1, #STORIES)
    local story = STORIES[which]
    local v = {}
    for _, name in ipairs({'a', 'b', 'c'}) do
        local range = story.draw[name]
        if range then v[name] = s.int(range[1], range[2]) end
    end
    local who, friend, items = s.pick(PEOPLE), s.pick(PEOPLE), s.pick(ITEMS)
    if friend == who or (story.ok and not story.ok(v)) then return nil end
    local results, lines = {}, {}
    for i, step in ipairs(story.steps) do
        local x, y = value(step[1], v, results), value(step[3], v, results)
        local r = APPLY[step[2]](x, y)
        if r < 1 or r > M.MAX_VALUE then return nil end
        results[i] = r
        lines[i] = ('%d %s %d = %d'):format(x, step[2], y, r)
    end
    local fields = {N = who[1], P = who[2], F = friend[1], I = items, a = v.a, b = v.b, c = v.c}
    local question = story.text:gsub('{(%a)}', function(k) return tostring(fields[k]) end)
    local result = results[#results]
    lines[#lines + 1] = ('#### %d'):format(result)
    return {question = question, answer = table.concat(lines, '\n'), result = result, story = which}
end

-- opts: seed, the size of each set (test, sft, train), and direct: the fraction of the SFT rows
-- answered with the final line alone ("#### N"), the rest worked out. The warm-up then knows
-- both ways and mostly answers directly, which is mostly wrong; working it out is mostly right,
-- and is what the reward of RL comes to prefer. (Test and train rows always hold the worked
-- answer, as GSM8K's do.)
function M.generate(opts)
    local direct = opts.direct or 0
    if type(direct) ~= 'number' or not (direct >= 0 and direct <= 1) then
        error(('arith: direct must be a fraction in [0, 1], got %s'):format(tostring(opts.direct)), 2)
    end
    -- say: one fraction, or one per story (in STORIES' order)
    local say = opts.say or 0
    if type(say) == 'number' then
        local one = say
        say = {}
        for i = 1, #STORIES do say[i] = one end
    end
    local function fraction(x) return type(x) == 'number' and x >= 0 and x <= 1 end
    local ok = type(say) == 'table' and #say == #STORIES
    for i = 1, #STORIES do ok = ok and fraction(say[i]) end
    if not ok then
        error(('arith: say must be a fraction in [0, 1] or a list of %d (one per story), got %s'):format(#STORIES,
            type(opts.say) == 'table' and ('a list of ' .. #opts.say) or tostring(opts.say)), 2)
    end
    local any_say = false
    for i = 1, #STORIES do any_say = any_say or say[i] > 0 end
    local s = stream(opts.seed)
    -- the answer formats from a stream of their own: the problems of every set stay the same
    local formats = stream(opts.seed % (MODULUS - 1) + 1)
    local seen, sets = {}, {}
    for _, name in ipairs({'test', 'sft', 'train'}) do
        local n = opts[name]
        if type(n) ~= 'number' or n ~= math.floor(n) or n < 0 then
            error(('arith: %s must be a count of problems, got %s'):format(name, tostring(n)), 2)
        end
        local set, tries = {}, 0
        while #set < n do
            tries = tries + 1
            if tries > 100 * n + 1000 then
                error(('arith: could not draw %d distinct problems for %s (the stories hold too few)'):format(n, name), 2)
            end
            local p = draw(s)
            if p and not seen[p.question] then
                seen[p.question] = true
                -- (direct = 0 draws nothing here: the problems do not depend on the option then)
                if name == 'sft' and direct > 0 then p.direct = s.int(1, 1000) <= direct * 1000 end
                if name == 'sft' and any_say then p.say = formats.int(1, 1000) <= say[p.story] * 1000 end
                set[#set + 1] = p
            end
        end
        sets[name] = set
    end
    return sets
end

-- the warm-up's answer to a problem: worked out or direct, ending in "#### N" or, for a row drawn
-- with `say`, in "The answer is N." (which the GSM8K graders do not read)
function M.sft_answer(p)
    local last = p.say and ('The answer is %d.'):format(p.result) or ('#### %d'):format(p.result)
    if p.direct then return last end
    return (p.answer:gsub('#### %d+$', function() return last end))
end

-- The shipped files' names and texts (JSONL, one row a line, keys in this order):
--   arith_test.jsonl, arith_train.jsonl   {"question", "answer"} (GSM8K's fields)
--   arith_sft_chat.jsonl                  {"id", "messages": [user, assistant]}, the user turn
--                                         being user_prompt(question) (the sft recipe's chat data)
function M.files(sets)
    local pyjson = require 'lunar.pyjson'
    local function qa(set)
        local out = {}
        for i, p in ipairs(set) do
            out[i] = pyjson.dumps(pyjson.object({{'question', p.question}, {'answer', p.answer}})) .. '\n'
        end
        return table.concat(out)
    end
    local chat = {}
    for i, p in ipairs(sets.sft) do
        local messages = pyjson.array({
            pyjson.object({{'role', 'user'}, {'content', M.user_prompt(p.question)}}),
            pyjson.object({{'role', 'assistant'}, {'content', M.sft_answer(p)}})})
        chat[i] = pyjson.dumps(pyjson.object({{'id', ('arith-sft-%d'):format(i - 1)}, {'messages', messages}})) .. '\n'
    end
    return {
        {name = 'arith_test.jsonl', text = qa(sets.test)},
        {name = 'arith_train.jsonl', text = qa(sets.train)},
        {name = 'arith_sft_chat.jsonl', text = table.concat(chat)},
    }
end

-- the settings the shipped files were made with (recipes/tools/make_arith.lua's defaults)
M.SHIPPED = {seed = 1, test = 200, sft = 3000, train = 4000, direct = 0,
              say = {0.3, 0.3, 0.7, 0.3, 0.3, 0.7, 0.7, 0.7, 0.7, 0.7}}

return M
