"""Tiny random checkpoints for the tests: they live in ``dtorch.models.tiny``, shared with the benchmarks and the GPU
check; re-exported here under the names the tests import."""

from dtorch.models.tiny import (
    families as families,
    hf_greedy as hf_greedy,
    random_hybrid as random_hybrid,
    save_random as save_random,
)
