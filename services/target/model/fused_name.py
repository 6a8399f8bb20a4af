"""The name of the submodule that holds a model's fused projections (q/k/v and gate/up per
layer), on its own so the fusing forwards and the GGUF loader, which matches fused layers to
their parts, can both read it without importing each other."""

FUSED = "specmesh_fused"
