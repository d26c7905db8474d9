-- recipes/pretrain.lua: language-model pretraining on plain text or a Megatron indexed dataset
-- (data.kind=indexed data.train=<prefix>; build one with recipes/tools/preprocess.lua).
--   lunar recipes/pretrain.lua [preset=tiny] [train.steps=200] ...
local common = dofile(((arg and arg[0] or 'recipes/pretrain.lua'):match('^(.*/)') or './') .. 'common.lua')
common.run('pretrain')
