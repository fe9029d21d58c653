"""Finite groups as Cayley tables, numbered exactly as Merrill et al. 2024's word-problem data.

Conventions (those of `jopetty/word-problem`, which builds its groups with `abstract_algebra`):

- S_n: the permutations of (0..n-1) in lexicographic order (``itertools.permutations``), so index 0
  is the identity. One-line notation, product ``(a*b)[i] = a[b[i]]`` (b acts first).
- A_n: the even permutations, kept in their S_n order (a subgroup's elements sorted by parent index).
- Z_n: index k is k, product (a + b) mod n.
- D_n: symmetries of the regular n-gon (order 2n). The reference has no D_n; we follow the DeltaProduct
  paper (appendix B.5, eq. 7): indices 0..n-1 are rotations r_0..r_{n-1}, n..2n-1 reflections s_0..s_{n-1},
  r_i r_j = r_{i+j}, r_i s_j = s_{i+j}, s_i r_j = s_{i-j}, s_i s_j = r_{i-j} (mod n). As maps of Z_n,
  r_i: x -> x + i and s_j: x -> j - x, composed like S_n (b acts first).
- G x H: pairs in ``itertools.product`` order, index ``i * |H| + j``, componentwise product; longer
  products fold left, so the index is row-major over the factors.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from functools import reduce

import numpy as np

MAX_ORDER = 4096  # a Cayley table of this order is 16M entries (64 MiB as int32)


class GroupSpecError(ValueError):
    """A group name that cannot be parsed or built."""


@dataclass(frozen=True, eq=False)
class Group:
    """A finite group given by its Cayley table: ``table[a, b]`` is the index of ``a * b``."""

    name: str
    table: np.ndarray  # [order, order] int32
    element_names: tuple[str, ...]
    perms: np.ndarray | None = field(default=None, repr=False)  # [order, n] one-line form, if permutations

    @property
    def order(self) -> int:
        return int(self.table.shape[0])

    @property
    def identity(self) -> int:
        return 0

    @property
    def inverse(self) -> np.ndarray:
        """``inverse[a]`` is the index of a^-1."""
        rows, cols = np.nonzero(self.table == self.identity)
        inv = np.empty(self.order, dtype=np.int64)
        inv[rows] = cols
        return inv

    def mul(self, a: int, b: int) -> int:
        return int(self.table[a, b])

    def scan(self, x: np.ndarray) -> np.ndarray:
        """Prefix products along the last axis: ``y[..., i] = x[..., 0] * ... * x[..., i]``."""
        x = np.asarray(x, dtype=np.int64)
        y = np.empty_like(x)
        if x.shape[-1] == 0:
            return y
        acc = x[..., 0]
        y[..., 0] = acc
        for i in range(1, x.shape[-1]):
            acc = self.table[acc, x[..., i]]
            y[..., i] = acc
        return y

    def moved_points(self) -> np.ndarray | None:
        """For permutation groups: how many points each element moves (None otherwise)."""
        if self.perms is None:
            return None
        return (self.perms != np.arange(self.perms.shape[1])).sum(axis=1)


def _perm_codes(perms: np.ndarray) -> np.ndarray:
    """Base-n code of each permutation; ascending code is lexicographic order."""
    n = perms.shape[1]
    weights = n ** np.arange(n - 1, -1, -1, dtype=np.int64)
    return perms.astype(np.int64) @ weights


def _perm_group(name: str, perms: np.ndarray) -> Group:
    """Group of the given permutations (rows, lexicographically sorted, closed under composition)."""
    codes = _perm_codes(perms)
    comp_codes = np.stack([_perm_codes(perms[a][perms]) for a in range(len(perms))])  # a[b[i]]
    table = np.searchsorted(codes, comp_codes)
    if not np.array_equal(codes[np.minimum(table, len(codes) - 1)], comp_codes):
        raise GroupSpecError(f"{name}: permutations are not closed under composition")
    names = tuple(str(tuple(int(v) + 1 for v in p)) for p in perms)  # the reference names them base 1
    return Group(name, table.astype(np.int32), names, perms.astype(np.int64))


def _check_order(name: str, order: int) -> None:
    if order > MAX_ORDER:
        raise GroupSpecError(f"group {name} has order {order} > {MAX_ORDER}; use a smaller group")


def symmetric(n: int) -> Group:
    """S_n in lexicographic order of one-line notation."""
    if n < 1:
        raise GroupSpecError(f"S{n}: n must be >= 1")
    _check_order(f"S{n}", int(np.prod(np.arange(1, n + 1))))
    perms = np.array(list(itertools.permutations(range(n))), dtype=np.int64).reshape(-1, n)
    return _perm_group(f"S{n}", perms)


def alternating(n: int) -> Group:
    """A_n: even permutations in S_n order."""
    if n < 1:
        raise GroupSpecError(f"A{n}: n must be >= 1")
    _check_order(f"A{n}", max(1, int(np.prod(np.arange(1, n + 1))) // 2))
    perms = np.array(list(itertools.permutations(range(n))), dtype=np.int64).reshape(-1, n)
    even = np.array([_parity(p) == 0 for p in perms])
    return _perm_group(f"A{n}", perms[even])


def _parity(p: np.ndarray) -> int:
    """0 for an even permutation, 1 for an odd one (by counting inversions)."""
    p = list(p)
    return sum(1 for i in range(len(p)) for j in range(i + 1, len(p)) if p[i] > p[j]) % 2


def cyclic(n: int) -> Group:
    """Z_n with index k = k."""
    if n < 1:
        raise GroupSpecError(f"Z{n}: n must be >= 1")
    _check_order(f"Z{n}", n)
    a = np.arange(n)
    return Group(f"Z{n}", ((a[:, None] + a[None, :]) % n).astype(np.int32), tuple(str(k) for k in range(n)))


def dihedral(n: int) -> Group:
    """D_n of order 2n: rotations r_0..r_{n-1} then reflections s_0..s_{n-1} (DeltaProduct eq. 7)."""
    if n < 1:
        raise GroupSpecError(f"D{n}: n must be >= 1")
    _check_order(f"D{n}", 2 * n)
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    table = np.empty((2 * n, 2 * n), dtype=np.int32)
    table[:n, :n] = (i + j) % n  # r_i r_j = r_{i+j}
    table[:n, n:] = n + (i + j) % n  # r_i s_j = s_{i+j}
    table[n:, :n] = n + (i - j) % n  # s_i r_j = s_{i-j}
    table[n:, n:] = (i - j) % n  # s_i s_j = r_{i-j}
    names = tuple(f"r{k}" for k in range(n)) + tuple(f"s{k}" for k in range(n))
    return Group(f"D{n}", table, names)


def direct_product(g: Group, h: Group) -> Group:
    """G x H with pairs in itertools.product order (index i * |H| + j)."""
    _check_order(f"{g.name}x{h.name}", g.order * h.order)
    gi = np.repeat(np.arange(g.order), h.order)
    hi = np.tile(np.arange(h.order), g.order)
    table = g.table[gi[:, None], gi[None, :]].astype(np.int64) * h.order + h.table[hi[:, None], hi[None, :]]
    names = tuple(f"{a}:{b}" for a, b in itertools.product(g.element_names, h.element_names))
    return Group(f"{g.name}x{h.name}", table.astype(np.int32), names)


_FACTOR = re.compile(r"([SAZD])(\d+)")
_BUILDERS = {"S": symmetric, "A": alternating, "Z": cyclic, "D": dihedral}


def parse_group(name: str) -> Group:
    """Build a group from a name: S4, A5, Z60, D8, or products S3xZ2 / S3_x_Z2 (the reference spelling)."""
    parts = re.split(r"_x_|x", name.strip())
    factors = []
    for part in parts:
        m = _FACTOR.fullmatch(part)
        if m is None:
            raise GroupSpecError(
                f"unknown group {name!r}: use S<n>, A<n>, Z<n>, D<n> or products like S3xZ2")
        factors.append(_BUILDERS[m.group(1)](int(m.group(2))))
    group = reduce(direct_product, factors)
    return Group("x".join(f.name for f in factors), group.table, group.element_names, group.perms)
