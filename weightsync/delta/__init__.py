"""Delta pushes: a source sends each destination with an inbox only what changed since the version that
destination holds (the words that differ from the source's copy of what it last pushed, encoded), and
the destination scatters them into its shadow.

* ``sender``: ``DeltaSender``, the source's side (the copy of what it last pushed, the compare, which
  writes go as planned and which as encoded changes, the spans posted one after another);
* ``receiver``: ``DeltaReceiver``, the destination's side (its inbox, the headers, the scatter);
* ``codec``: the encodings, their one size rule, and the payload's records;
* the kernels per backend: ``cuda`` (CUDA C++ from ``kernels.cu``, compiled at run time by ``nvrtc``),
  ``host`` (the C++ host kernels of cpp/delta/), ``triton_kernels`` (Triton).
"""

from weightsync.delta.sender import DELTA_KEY, SPANS, DeltaReceiver, DeltaSender, DeltaWork

__all__ = ["DELTA_KEY", "SPANS", "DeltaReceiver", "DeltaSender", "DeltaWork"]
