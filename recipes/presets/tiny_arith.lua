-- recipes/presets/tiny_arith.lua: the tiny RL task: arithmetic word problems in GSM8K's format
-- (recipes/tools/arith.lua; examples/data/rl/), a tiny GLM-5-architecture model and the
-- tiny preset's tokenizer. The sft recipe is the warm-up: from a seeded init it learns the
-- arithmetic in part and two ways to end an answer, "#### N" (which the GSM8K grader reads) and
-- "The answer is N." (which it does not), which leaves room for RL to raise the held-out
-- accuracy (docs/rl.md, "The tiny task").
--   lunar recipes/sft.lua preset=tiny_arith      -> runs/tiny_arith_sft/final
local tiny = dofile((debug.getinfo(1, 'S').source:match('^@(.*/)') or './') .. 'tiny.lua')

local config = {}
for k, v in pairs(tiny.common.model.config) do config[k] = v end
-- no padding past the tokenizer's 6,292 tokens: sampling at temperature 1 would otherwise draw
-- ids that have no text (the padded rows of lm_head are never trained up, but never reach 0)
config.vocab_size = 6292

return {
    common = {
        model = {config = config, seed = 1234},
        tokenizer = 'recipes/presets/tiny/tokenizer.json',
        hardware = {nodes = 1, gpus_per_node = 0, gpu = 'cpu'},
    },
    sft = {
        data = {kind = 'chat', train = {'examples/data/rl/arith_sft_chat.jsonl'}, template = 'glm5',
                seq_len = 256, micro_batch = 8},
        train = {steps = 1500, log_every = 10},
        optim = {lr = 3e-3, min_lr = 3e-4, warmup = 20, weight_decay = 0.1},
        checkpoint = {every = 500, keep_last = 1},
        -- benchmark.every=250 follows the held-out greedy accuracy during the warm-up
        benchmark = {every = 0, datasets = {'arith'}, limit = 200, max_new_tokens = 48},
    },
    -- RL from the warm-up's model (run the sft recipe of this preset first): GRPO, and DAPO with
    -- dynamic sampling (half the groups of the warm-up are all wrong), on the 4,000 training
    -- problems, greedy accuracy on the 200 held-out ones every 10 steps (docs/rl.md, The tiny
    -- task, says what these settings have shown so far)
    grpo = {
        model = {path = 'runs/tiny_arith_sft/final'},
        data = {kind = 'prompt_answer', train = 'examples/data/rl/arith_train.jsonl',
                valid = 'examples/data/rl/arith_test.jsonl', prompt_field = 'question', answer_field = 'answer',
                template = 'glm5'},
        rl = {reward = 'gsm8k', n = 16, prompts = 8, mini_batches = 1, micro_batch = 32, kl_coef = 0, eval_limit = 200},
        rollout = {max_prompt_len = 256, max_new_tokens = 40, temperature = 1.0},
        train = {steps = 200, log_every = 1, eval_every = 10},
        optim = {lr = 5e-5, min_lr = 5e-5, warmup = 0, schedule = 'constant', weight_decay = 0},
        checkpoint = {every = 50, keep_last = 1},
    },
    dapo = {
        model = {path = 'runs/tiny_arith_sft/final'},
        data = {kind = 'prompt_answer', train = 'examples/data/rl/arith_train.jsonl',
                valid = 'examples/data/rl/arith_test.jsonl', prompt_field = 'question', answer_field = 'answer',
                template = 'glm5'},
        rl = {reward = 'gsm8k', n = 16, prompts = 8, mini_batches = 1, micro_batch = 32, kl_coef = 0, eval_limit = 200,
              eps_low = 0.2, eps_high = 0.28, loss_reduction = 'token-mean', dynamic_sampling = true,
              max_gen_batches = 4, overlong_buffer = 8, overlong_penalty = 1.0},
        rollout = {max_prompt_len = 256, max_new_tokens = 40, temperature = 1.0},
        train = {steps = 200, log_every = 1, eval_every = 10},
        optim = {lr = 5e-5, min_lr = 5e-5, warmup = 0, schedule = 'constant', weight_decay = 0},
        checkpoint = {every = 50, keep_last = 1},
    },
}
