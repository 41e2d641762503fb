"""The benchmarks: workloads, systems side by side, the engine's and the GPU's figures.

Without CUDA the fused forward's Triton kernels run in Triton's interpreter, chosen here,
before any bench module lets transformers import Triton (``python -m agentspec.bench.engine
--ops`` counts them on the CPU).
"""

from agentspec.engine.fused import interpret_without_gpu

interpret_without_gpu()
