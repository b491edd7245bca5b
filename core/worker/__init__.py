"""The side that touches tensors: model loading and wrapping, the model runner, its persistent batch, CPU kernels."""
