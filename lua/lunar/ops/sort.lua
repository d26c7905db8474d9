-- lunar.ops.sort (stub: none yet)
return {}
