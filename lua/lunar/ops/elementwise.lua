-- lunar.ops.elementwise (stub: none yet)
return {}
