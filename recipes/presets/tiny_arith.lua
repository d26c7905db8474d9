-- recipes/presets/tiny_arith.lua: the tiny RL task: arithmetic word problems in GSM8K's format
-- (recipes/tools/arith.lua; examples/data/rl/), a tiny GLM-5-architecture model and the
-- tiny preset's tokenizer. The sft recipe is the warm-up: from a seeded init it learns the
-- answer format fully and the arithmetic only in part, which leaves room for RL to raise the
-- held-out accuracy (docs/rl.md, "The tiny task").
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
        train = {steps = 500, log_every = 10},
        optim = {lr = 3e-3, min_lr = 3e-4, warmup = 20, weight_decay = 0.1},
        checkpoint = {every = 100, keep_last = 1},
        -- benchmark.every=100 follows the held-out greedy accuracy during the warm-up
        benchmark = {every = 0, datasets = {'arith'}, limit = 200, max_new_tokens = 48},
    },
    -- grpo and dapo: the RL recipes on examples/data/rl/arith_train.jsonl from the warm-up's model
}
