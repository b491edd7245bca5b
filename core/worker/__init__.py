"""The side that touches tensors: the runner's step at the top; models, CPU fast paths and ranks in their rooms."""
