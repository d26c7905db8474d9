-- lunar.nn.vocab_parallel: lunar.parallel.vocab under its earlier name
return require 'lunar.parallel.vocab'
