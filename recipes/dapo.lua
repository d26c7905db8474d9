-- recipes/dapo.lua: DAPO on DAPO-Math (GRPO with clip-higher, dynamic sampling, token-level loss
-- and overlong reward shaping).
--   lunar recipes/dapo.lua [preset=tiny] [train.steps=50] [model.path=/ckpt/GLM-5.3] ...
-- Each step generates rl.n answers to DAPO-Math problems, scores them with verl's math_dapo
-- reward (the last "Answer:" line, +1 / -1; rl.reward), drops the groups whose answers are all
-- right or all wrong and generates more until rl.prompts groups are kept, shapes the rewards of
-- responses near the length limit, and takes clip-higher policy-gradient steps
-- (lua/lunar/rl/trainer.lua; docs/rl.md).
local common = dofile(((arg and arg[0] or 'recipes/dapo.lua'):match('^(.*/)') or './') .. 'common.lua')
common.run('dapo')
