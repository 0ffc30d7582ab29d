"""Tensor parallelism on torch.distributed: process groups, weight sharding, parallel layers, the
rank-0 runner that hands each step to the other ranks, and the worker process those ranks run.

Where it sits: the engine builds the model through `parallel/` when `tensor_parallel_size > 1`;
`parallel/` builds on `model/` (it slices weights and wraps layers) and nothing below it knows of it.
"""
