"""The first op where two arms part.

When an exact comparison of two arms fails at a step, the step and the gradient that differ are
known, but not the op. Re-running both arms up to that step under :class:`OpRecorder`
(:mod:`.record`) gives every op they executed, forward and backward, in order: the op, its module,
its output shapes, a bitwise hash and the absolute maximum of each output. :func:`compare_ops`
(:mod:`.compare`) matches the two sequences by their order and finds the first op whose outputs
differ, or the ops one arm ran that the other lacks just before it. It also states how ambiguous
the matching was, since an eager arm and a traced arm do not run the same op sequence.
:func:`first_op_divergence` (:mod:`.locate`) drives the two passes and returns the result as JSON data.
"""

from harness.op_divergence.compare import Comparison, compare_ops, describe
from harness.op_divergence.locate import ArmRun, first_op_divergence, measured, output_difference, record_arm
from harness.op_divergence.record import OpRecord, OpRecorder, content_digest

__all__ = [
    "ArmRun",
    "Comparison",
    "OpRecord",
    "OpRecorder",
    "compare_ops",
    "content_digest",
    "describe",
    "first_op_divergence",
    "measured",
    "output_difference",
    "record_arm",
]
