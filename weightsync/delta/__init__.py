"""Delta pushes: a source sends each destination with an inbox only what changed since the version that
destination holds (the words that differ from the source's copy of what it last pushed, encoded), and
the destination scatters them into its shadow.

* ``sender``: ``DeltaSender``, the source's side (the copy of what it last pushed, the compare, which
  writes go as planned and which as encoded changes, the spans posted one after another);
* ``receiver``: ``DeltaReceiver``, the destination's side (its inbox, the headers, the scatter);
* ``codec``: the encodings, their one size rule, and the payload's records; ``units``: what the codec
  and every backend share (the ENC_IDX16 block from ``block.h``, the payload's alignment);
* ``work``: what the sender keeps per plan epoch and per push; ``compare``: the sender's compare;
* ``backend``: which kernels run; the kernels per backend: ``cuda`` (CUDA C++ from ``kernels.cu``,
  compiled at run time by ``nvrtc``), ``host`` (the C++ host kernels of cpp/delta/), ``triton_kernels``
  (Triton).

Who decides what
----------------
* A destination that can take deltas registers a *delta inbox* (``Destination(..., delta_bytes=N)``): a
  host array of header slots (per span one per source rank, :data:`HEADER_RECORD`, :func:`header_slot`)
  and a payload area of ``N``
  bytes on its device, split evenly between the group's sources. It publishes both descriptors under the
  pseudo-key :data:`DELTA_KEY` when it joins. Its grant says which version it can take a delta on (the
  ``held`` field of the grant): inplace, the live version unless an abandoned version left bytes in it;
  staged, the newest complete version if the shadow it grants holds it too (after every version the
  other shadow is brought up to it: same entries, off the sources' critical path), else -1.
* A push goes in *spans*, sent one after another: :data:`SPANS` early ones and a final one (a plan's
  *part*, weightsync/plan/parts.py, is another thing: what one participant does in a plan epoch). The
  local tensors are cut, in order, into
  SPANS runs of about equal bytes; a span holds the direct writes that read its tensors. Every source
  writes each inbox destination, per version and early span, that span's payload (its entries and
  encoded changes) and then its header, each with an immediate of the span's own
  (:func:`weightsync.wire.delta_part_imm`): the destination waits for the span's header from every
  source, then for the payload immediates they announce, then reads the entries and scatters the sparse
  ones, while the sources compare and send the next span. Last comes the final span (the staged writes
  and the tail; its header's immediate :func:`weightsync.wire.delta_header_imm`), held back like a
  push's tail until the source has checked its tensors: it announces the data immediates of every write
  sent as planned and of its own payload. The header may land before its payload (nothing orders two
  writes on the wire), so a payload is read only once its immediates are in. Only after the final span
  does the destination flip the version and ack. An inbox destination always lands this way (dense
  versions too, their spans holding entries only), so there is no mixed counting. A source whose share
  of an inbox cannot hold its entry tables sends that destination every write as planned, its headers
  announcing no entries (:data:`ALL_PLANNED`, with its relay chunks in a chain): the plan is not refused
  for an inbox too small.
* A source created with ``delta=True`` keeps a copy of what it last pushed (its *reference*, one flat
  tensor per span and word size, a *space*, holding its local tensors' words end to end, on their device,
  ``PushStats.delta_ref_bytes``) and the version it holds. Its push compares every local tensor with the
  reference once (integer views: bitwise, so NaN, -0.0 and denormals count as what they are), and for
  each destination that granted a ``held`` equal to the reference's version sends, per planned direct
  write, only the changed elements, in the smallest of two encodings (:func:`choose`), or the write
  itself where that is smaller (the break-even). Every other destination (new, replaced, failed, behind,
  after a re-plan: the reference's version is reset then) gets the dense push, header included.
* A relay chain (the sources write its head, which forwards each chunk as it lands) takes a delta as one:
  every member holds one layout, so one entry table and payload, encoded once, serve all of them; each
  member with an inbox gets them straight from every source, while the writes they say go as planned
  travel as relay chunks through the chain, which the member counts (the header announces the payload's
  immediates only). The chain gets a delta only if every member has an inbox and granted the reference's
  version; otherwise the version is dense for the whole chain. Each member's share is the smallest
  member's (one payload fits them all).
"""

from weightsync.delta.codec import DELTA_KEY, SPANS
from weightsync.delta.receiver import DeltaReceiver
from weightsync.delta.sender import DeltaSender
from weightsync.delta.work import DeltaWork

__all__ = ["DELTA_KEY", "SPANS", "DeltaReceiver", "DeltaSender", "DeltaWork"]
