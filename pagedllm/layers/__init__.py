"""The building blocks a model is made of: paged attention, projections, fused elementwise ops,
the C++ kernels behind them (compiled for this CPU at run time), the Triton kernel for GPUs, and
the tensor-parallel slicing of weights.  They know tensors and kernels, never requests or steps."""
