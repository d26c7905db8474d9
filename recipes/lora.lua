-- recipes/lora.lua: LoRA fine-tuning (adapters only; the base weights stay bit-identical), saved
-- in Hugging Face PEFT's format.
--   lunar recipes/lora.lua [preset=tiny] [peft.r=16] [model.path=/ckpt/GLM-5.2] ...
local common = dofile(((arg and arg[0] or 'recipes/lora.lua'):match('^(.*/)') or './') .. 'common.lua')
common.run('lora')
