-- lunar.ops.reduce (stub: none yet)
return {}
