"""What runs inside one participant (no Ray here: the control client does that).

* ``describe``: tensors (torch, DTensor, numpy; ``Sharded``, ``Fused``, ``Placed``) to a layout;
* ``participant``: engine, mailbox and outbox, join and part fetch shared by both roles;
* ``source``: ``Source`` and its public API; ``push``: one push, ``Push``, its steps in the protocol's
  order (``grants``: the grants it reads; ``tails``: the writes it holds back until its check);
  ``push_handle``: a push in flight; ``push_stats``: ``PushStats``; ``staging``: the staging pool, chunk
  preparation with CUDA graphs and the staged pipeline; ``transforms``: casts and FP8 quantization;
* ``destination``: ``Destination`` (receiving thread, versions, acks); ``relay``: a chain member.

Delta pushes have a package of their own: weightsync.delta.
"""

from weightsync.runtime.describe import Fused, Placed, Sharded, describe_tensors

__all__ = ["Fused", "Placed", "Sharded", "describe_tensors"]
