-- recipes/gsm8k.lua: GRPO on GSM8K (reinforcement learning with verifiable rewards).
--   lunar recipes/gsm8k.lua [preset=tiny] [train.steps=50] [rl.n=8] [model.path=/ckpt/GLM-5.3] ...
-- Each step generates rl.n answers to each of rl.prompts GSM8K questions with the model being
-- trained, scores them with SkyRL's GSM8K reward (the first "#### N", rl.reward), normalises the
-- rewards within each question's group and takes PPO-clipped policy-gradient steps
-- (lua/lunar/rl/trainer.lua; docs/rl.md). The tiny preset runs three steps of the tiny model on
-- the shipped GSM8K questions; preset=tiny_arith learns arithmetic word problems on a CPU.
local common = dofile(((arg and arg[0] or 'recipes/gsm8k.lua'):match('^(.*/)') or './') .. 'common.lua')
common.run('grpo')
