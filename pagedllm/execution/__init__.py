"""Model execution: a step turned into tensors, the model built for this device, sampling, threads."""
