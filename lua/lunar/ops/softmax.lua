-- lunar.ops.softmax (stub: none yet)
return {}
