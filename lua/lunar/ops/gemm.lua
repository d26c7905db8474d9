-- lunar.ops.gemm (stub: none yet)
return {}
