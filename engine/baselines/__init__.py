"""Re-implementations of other systems' paths, kept for head-to-head benchmarks.

`sglang_cpu`: SGLang's per-request CPU DDTree build (DDTREE.md section 7), equal in output to
`engine.reference.ddtree.build_tree`.
"""
