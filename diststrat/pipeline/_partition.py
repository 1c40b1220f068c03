"""`partition`: cut a sequence of layer costs into contiguous stages, optimally.

The objective is the pipeline's clock: every micro-batch waits for the slowest stage, so
the best cut minimizes the largest stage cost. Dynamic programming over (stages, prefix)
finds that minimum exactly; lingvo's greedy histogram cut only approximates it.
"""

import math
import numbers
from typing import Sequence

import numpy as np


def partition(costs: Sequence[float], num_stages: int) -> list[int]:
  """Splits `costs` into `num_stages` contiguous stages minimizing the largest stage's sum.

  Exact: dynamic programming over the number of stages and the length of the prefix,
  O(num_stages * len(costs)**2) vectorized (0.1 s for 1000 layers and 8 stages). Among
  equally good cuts it returns the same one every time: the one whose last stage is
  shortest, then the stage before it, and so on.

  Args:
    costs: a sequence of finite, non-negative numbers, one per layer, in order.
    num_stages: the number of stages, from 1 to `len(costs)`.

  Returns:
    A list of `num_stages` positive ints, the number of layers in each stage; they sum
    to `len(costs)`.

  Raises:
    ValueError: a cost is negative or not finite, or `num_stages` is not between 1 and
      `len(costs)`.

  Example:
    >>> from diststrat.pipeline import partition
    >>> partition([1, 1, 1, 1, 4], 2)
    [4, 1]
    >>> partition([1, 2, 3, 4, 5, 6], 3)
    [3, 2, 1]
  """
  costs = _check_costs(costs)
  if (isinstance(num_stages, bool) or not isinstance(num_stages, numbers.Integral) or
      not 1 <= num_stages <= len(costs)):
    raise ValueError(
        "partition() needs between 1 and len(costs) stages, each holding at least one "
        f"layer. Received: num_stages={num_stages!r} for {len(costs)} costs. Use at most "
        f"{len(costs)} stages (devices), or split the model into more layers.")
  num_stages = int(num_stages)
  n = len(costs)
  values = np.asarray(costs, dtype=np.float64)
  # Scaled by a power of two (exact) so that sums of huge costs stay finite.
  values = np.ldexp(values, -int(np.frexp(values.max())[1]))
  prefix = np.concatenate([[0.0], np.cumsum(values)])
  # bests[s - 1][i]: the smallest possible largest stage cost of layers [0, i) cut into
  # s stages (inf where i < s).
  bests = [prefix.copy()]
  for s in range(2, num_stages + 1):
    best = np.full(n + 1, np.inf)
    for i in range(s, n + 1):
      j = np.arange(s - 1, i)  # The last stage is [j, i); the first s - 1 stages hold [0, j).
      best[i] = np.min(np.maximum(bests[-1][j], prefix[i] - prefix[j]))
    bests.append(best)
  optimum = bests[-1][n]
  # Ties: the last stage as short as an optimal cut allows (the latest start whose prefix
  # still fits in s - 1 stages within the optimum), then the stage before it, and so on.
  sizes = []
  end = n
  for s in range(num_stages, 1, -1):
    j = np.arange(s - 1, end)
    fits = np.maximum(bests[s - 2][j], prefix[end] - prefix[j]) <= optimum
    start = int(j[np.nonzero(fits)[0][-1]])
    sizes.append(end - start)
    end = start
  sizes.append(end)
  return sizes[::-1]


def _check_costs(costs):
  try:
    if isinstance(costs, (str, bytes)):  # Its characters would parse as numbers.
      raise TypeError("a string")
    values = [_number(c) for c in costs]
  except (TypeError, ValueError) as e:
    raise ValueError("partition() takes a sequence of numbers, one cost per layer. "
                     f"Received: costs={costs!r}. Pass e.g. [1.0, 2.5, 0.0].") from e
  if not values:
    raise ValueError("partition() needs at least one cost. Received: costs=[]. Pass one "
                     "cost per layer.")
  bad = [(i, c) for i, c in enumerate(values) if not math.isfinite(c) or c < 0]
  if bad:
    i, c = bad[0]
    raise ValueError("Every cost must be a finite number >= 0. Received: "
                     f"costs[{i}]={c!r}. Replace it with an estimate (0 for a layer that "
                     "does no arithmetic).")
  return values


def _number(cost):
  """`cost` as a float: a number (numpy ones too), not a string that parses as one."""
  if isinstance(cost, (str, bytes)):
    raise TypeError(f"{cost!r} is a string")
  return float(cost)
