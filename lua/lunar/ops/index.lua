-- lunar.ops.index (stub: none yet)
return {}
