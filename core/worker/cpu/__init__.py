"""CPU fast paths: tiled, packed and quantized linears, fused C++ kernels (sources in csrc/), their tuning and build."""
