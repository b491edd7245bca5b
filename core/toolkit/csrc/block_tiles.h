// GGUF block tiles (patchbay.toolkit.block_tiles): a GGUF file's quantized blocks repacked losslessly into
// tiles of 16 output features, their products with activations rounded to int8 per 32 inputs, and their rows.
// The kernels are in block_tiles.cpp; tiles.cpp's tiled_linear dispatches to them and binds them.
#pragma once
#include <torch/extension.h>

// Whether `tiles` are block tiles: uint8 [tiles][blocks][16 lanes][bytes per lane and block], 4-D (int4 tiles are
// 3-D).  The bytes per lane and block name the format (block_tiles.cpp: kFormats).
bool is_block_tiles(const torch::Tensor& tiles);

// x [rows, K] (float32 or bfloat16, rows of contiguous features) times the block tiles' weight [out_features, K],
// plus `bias`: activations rounded to int8 per 32 inputs, integer dot products, in x's dtype.
torch::Tensor block_tiles_linear(torch::Tensor x, torch::Tensor tiles, c10::optional<torch::Tensor> bias,
                                 int64_t out_features, int64_t threads);

// Adds the block tiles' functions to the extension's module.
void bind_block_tiles(pybind11::module& m);
