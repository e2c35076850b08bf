"""Keyed pseudo-random permutations of [0, n) with O(1) memory and random access.

A balanced Feistel network over the smallest even number of bits that covers n, with
cycle walking (an index that lands at or above n is encrypted again until it falls below
n): a bijection on [0, n) whatever the round function, so epoch orders and the held-out
split cost nothing per row and any position can be looked up alone (as Levanter and
Grain shuffle). Vectorized over numpy arrays of indices.
"""

import numpy as np

_ROUNDS = 8
_ONES = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x):
    """splitmix64's finalizer: a fast, well-spread hash of uint64 values (wraps mod 2^64)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class Permutation:
    """perm(i) for i in [0, n): a bijection fixed by `key` (a tuple of ints, e.g. (seed, epoch))."""

    def __init__(self, n: int, key: tuple):
        self.n = int(n)
        bits = max(2, (self.n - 1).bit_length())
        self.half = np.uint64((bits + 1) // 2)
        self.mask = np.uint64((1 << int(self.half)) - 1)
        k = np.uint64(0x9E3779B97F4A7C15)
        with np.errstate(over="ignore"):
            for part in key:
                k = _mix(k ^ np.uint64(int(part) & 0xFFFFFFFFFFFFFFFF))
            self.round_keys = [_mix(k + np.uint64(r + 1)) for r in range(_ROUNDS)]

    def _rounds(self, x, keys):
        left, right = x >> self.half, x & self.mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & self.mask)
        return (left << self.half) | right

    def _walk(self, idx, keys):
        x = np.asarray(idx, np.int64)
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise IndexError(f"index out of range for a permutation of {self.n}")
        y = x.astype(np.uint64)
        with np.errstate(over="ignore"):
            y = self._rounds(y, keys)
            out = y >= self.n
            while out.any():  # cycle walking: at most a few rounds, as n > domain / 4
                y[out] = self._rounds(y[out], keys)
                out = y >= self.n
        return y.astype(np.int64)

    def __call__(self, idx):
        return self._walk(idx, self.round_keys)

    def inverse(self, idx):
        """perm.inverse(perm(i)) == i: the Feistel rounds run backwards with swapped halves."""
        x = np.asarray(idx, np.int64).astype(np.uint64)
        swap = lambda v: ((v & self.mask) << self.half) | (v >> self.half)  # noqa: E731
        with np.errstate(over="ignore"):
            inv = lambda v, keys: swap(self._rounds(swap(v), keys))  # noqa: E731
            y = inv(x, self.round_keys[::-1])
            out = y >= self.n
            while out.any():
                y[out] = inv(y[out], self.round_keys[::-1])
                out = y >= self.n
        return y.astype(np.int64)
