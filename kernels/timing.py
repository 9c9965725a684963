"""Device timing for benchmarks and calibration (public name of kernels._timing).

    TIMING                          one line saying how the figures below are taken
    cuda_ms(fn, reps, warmup, ...)  median device ms per call of fn, by CUDA events
    cuda_ms_round_robin(fns, ...)   {name: ms} for several fns timed in turns (shuffled order)
    turn_orders(keys, rounds, seed) the turn order cuda_ms_round_robin uses
"""
from ._timing import TIMING, cuda_ms, cuda_ms_round_robin, turn_orders

__all__ = ["TIMING", "cuda_ms", "cuda_ms_round_robin", "turn_orders"]
