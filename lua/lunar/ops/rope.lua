-- lunar.ops.rope (stub: none yet)
return {}
