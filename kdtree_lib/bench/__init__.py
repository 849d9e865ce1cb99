"""Benchmarks: one module per measured thing, each a command (`python -m kdtree_lib.bench.<name>`).

They share `timing` (the one way to time a GPU call) and `inputs` (synthetic drafts, trees and random
weights); no benchmark imports another, so each can change without moving the others' numbers.
"""
