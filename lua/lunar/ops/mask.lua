-- lunar.ops.mask (stub: none yet)
return {}
