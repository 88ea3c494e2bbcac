"""The CUDA kernels and packages under Numba's CUDA simulator: the *_cases.py files run in child
processes (tests/support/cuda_simulator.py), test_cuda_sim.py reports them."""
