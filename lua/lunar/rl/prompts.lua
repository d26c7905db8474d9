-- lunar.rl.prompts: the problems an RL run draws its prompts from, and the order it draws them in.
--
--   local prompts = require 'lunar.rl.prompts'
--   local set = prompts.load(files, {tokenizer = tok, reward = 'gsm8k', template = 'glm5',
--       enable_thinking = false, prompt_field = 'question', answer_field = 'answer',
--       max_prompt_len = 512, limit = nil})
--   local sampler = prompts.sampler(set, {seed = 1, shuffle = true})
--   local batch = sampler:next(16)       -- 16 problems: {index =, ids =, gold =, question =}
--   sampler:state() / sampler:set_state(s)   -- the position, for checkpoints
--
-- A problem is a JSONL row with its question (prompt_field) and its answer (answer_field). The
-- prompt is one user message, the question with the instruction the reward's reference data
-- preparation appends (lunar.rl.rewards.prompt), rendered with the chat template and the
-- generation prompt (with thinking off, the default, the prompt ends in </think>, as SFT rows
-- without reasoning are rendered). The gold answer is what the reward compares with: for the
-- GSM8K rewards, the number after the first "#### " of a worked answer (commas removed), else
-- the answer as written.
-- Prompts longer than max_prompt_len tokens are left out (as SkyRL does) and counted; rows
-- without a question or an answer are an error naming the file and line; a set with no usable
-- problem is an error saying why.
local lunar = require 'lunar'
local core = require 'lunar.core'
local rewards = require 'lunar.rl.rewards'

local user_error = core.user_error

local M = {}

local function as_list(x) if type(x) == 'table' then return x end return {x} end

-- the gold answer of a row's answer field for this reward
local function gold_of(reward, answer)
    if type(answer) == 'number' then return tostring(answer) end
    if type(reward) == 'string' and reward:find('gsm8k', 1, true) and answer:find('####', 1, true) then
        return require('lunar.eval.grade').gsm8k_gold(answer)
    end
    return answer
end

-- load(files, opts) -> {problems = {...}, rows =, too_long =, longest =}
function M.load(files, opts)
    local tok, reward = opts.tokenizer, opts.reward
    local qf, af = opts.prompt_field or 'question', opts.answer_field or 'answer'
    local set = {problems = {}, rows = 0, too_long = 0, longest = 0}
    for _, path in ipairs(as_list(files)) do
        local f, err = io.open(path, 'rb')
        if not f then user_error(('data.train: cannot open %s: %s'):format(path, tostring(err))) end
        local ln = 0
        for line in f:lines() do
            ln = ln + 1
            if line:find('%S') then
                local ok, row = pcall(lunar.io.decode_json, line)
                if not ok or type(row) ~= 'table' then
                    f:close()
                    user_error(('%s:%d: not a JSON object: %s'):format(path, ln, lunar.config.strip_where(tostring(row))))
                end
                local q, a = row[qf], row[af]
                if type(q) ~= 'string' or q == '' then
                    f:close()
                    user_error(('%s:%d: no question: the row has no string field %q (set data.prompt_field)')
                        :format(path, ln, qf))
                end
                if type(a) ~= 'string' and type(a) ~= 'number' then
                    f:close()
                    user_error(('%s:%d: no answer: the row has no string or number field %q (set data.answer_field)')
                        :format(path, ln, af))
                end
                set.rows = set.rows + 1
                local name = type(reward) == 'string' and reward or 'gsm8k'
                local text = lunar.chat.render({{role = 'user', content = rewards.prompt(name, q)}},
                    {template = opts.template or 'glm5', add_generation_prompt = true,
                     enable_thinking = opts.enable_thinking or false})
                local ids = tok:encode(text, {special = true})
                if #ids > set.longest then set.longest = #ids end
                if #ids > opts.max_prompt_len then
                    set.too_long = set.too_long + 1
                else
                    set.problems[#set.problems + 1] = {index = #set.problems + 1, ids = ids, question = q,
                        gold = gold_of(reward, a), source = ('%s:%d'):format(path, ln)}
                end
                if opts.limit and set.rows >= opts.limit then break end
            end
        end
        f:close()
        if opts.limit and set.rows >= opts.limit then break end
    end
    if #set.problems == 0 then
        if set.rows == 0 then
            user_error(('data.train: no problem in %s (empty files)'):format(table.concat(as_list(files), ', ')))
        end
        user_error(('data.train: none of the %d problems is usable: every prompt is longer than '
            .. 'rollout.max_prompt_len=%d tokens (the longest has %d); raise rollout.max_prompt_len')
            :format(set.rows, opts.max_prompt_len, set.longest))
    end
    return set
end

-- ---- the order ------------------------------------------------------------------------------------

local Sampler = {}
Sampler.__index = Sampler

-- a permutation of 1..n from a seeded stream (Fisher-Yates over core.rng draws)
local function permutation(n, seed, epoch)
    local rng = core.rng_new(seed):split('rl_prompts'):split(epoch)
    local p = {}
    for i = 1, n do p[i] = i end
    for i = n, 2, -1 do
        local j = 1 + math.floor(rng:uniform_at(n - i) * i)
        if j > i then j = i end
        p[i], p[j] = p[j], p[i]
    end
    return p
end

-- sampler(set, {seed =, shuffle = true}): epochs of the problems, each in a fresh order
function M.sampler(set, opts)
    local s = setmetatable({set = set, seed = opts.seed or 1, shuffle = opts.shuffle ~= false, epoch = 1, pos = 0},
        Sampler)
    s:_order()
    return s
end

function Sampler:_order()
    local n = #self.set.problems
    if self.shuffle then self.order = permutation(n, self.seed, self.epoch)
    else
        self.order = {}
        for i = 1, n do self.order[i] = i end
    end
end

-- next(k) -> k problems (an epoch ends and the next begins in the middle when it must)
function Sampler:next(k)
    local out = {}
    for i = 1, k do
        if self.pos >= #self.order then
            self.epoch, self.pos = self.epoch + 1, 0
            self:_order()
        end
        self.pos = self.pos + 1
        out[i] = self.set.problems[self.order[self.pos]]
    end
    return out
end

function Sampler:state() return {epoch = self.epoch, pos = self.pos, problems = #self.set.problems} end

function Sampler:set_state(st)
    if type(st) ~= 'table' or st.problems ~= #self.set.problems then
        error(('the prompt set has %d usable problems but the checkpoint was written with %s'):format(
            #self.set.problems, tostring(type(st) == 'table' and st.problems or '?')), 0)
    end
    self.epoch, self.pos = st.epoch, st.pos
    self:_order()
end

return M
