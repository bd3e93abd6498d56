"""Model execution: a step's tensors, the attention and linear kernels, sampling, threads."""
