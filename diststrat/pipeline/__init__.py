"""Pipeline model parallelism: GPipe.

A sequence of layers is cut into stages, one per device; each batch is split into
micro-batches that flow through the stages; gradients are summed over the
micro-batches. See docs/pipeline.md.
"""

from diststrat.pipeline._cost import estimate_costs as estimate_costs
from diststrat.pipeline._gpipe import GPipe as GPipe
from diststrat.pipeline._partition import partition as partition

__all__ = ["GPipe", "partition", "estimate_costs"]
