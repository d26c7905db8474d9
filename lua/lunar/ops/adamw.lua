-- lunar.ops.adamw (stub: none yet)
return {}
