-- lunar.ops.norm (stub: none yet)
return {}
