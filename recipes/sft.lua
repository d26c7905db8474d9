-- recipes/sft.lua: supervised fine-tuning (chat data, loss on the assistant tokens).
--   lunar recipes/sft.lua [preset=tiny] [train.steps=300] [model.path=/ckpt/GLM-5.2] ...
-- The tiny preset (the default) trains a small GLM-5-architecture model from a seeded random
-- init on the shipped chat data, on the CPU, and prints the falling loss.
local common = dofile(((arg and arg[0] or 'recipes/sft.lua'):match('^(.*/)') or './') .. 'common.lua')
common.run('sft')
