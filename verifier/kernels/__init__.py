"""The verifier's kernels: the CPU's C kernels (W8A8 GEMM, tree attention, whole decoder layers)
with their ctypes bindings and build, and the device engine's Triton kernels. Nothing here imports
the model; the model chooses among them."""
