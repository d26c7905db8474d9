-- lunar.model.sharded: lunar.parallel.checkpoint under its earlier name
return require 'lunar.parallel.checkpoint'
