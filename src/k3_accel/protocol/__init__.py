"""The target <-> draft-server wire protocol, version 2: columnar batches.

A request is a multipart ZMQ message. Frame 0 is a msgpack array
``[v, seq, msg]`` where ``msg`` is one of the tagged, array-encoded message
structs below (decoded and type-checked by msgspec); the op's tensors follow
as raw frames, in a fixed order with shapes implied by the header:

- ``ingest``  ``meta int64 [n, 3]`` (handle, start, count) | ``tokens int64 [rows]`` | ``hidden [rows, width]``
- ``propose`` ``meta int64 [n, 4]`` (handle, start, count, anchor) | ``tokens`` | ``hidden``
  [| ``temperature float32 [n]`` | ``seeds int64 [n]`` with ``sampling``: each request's
  sampling temperature (0 = greedy) and seed; only to a server whose hello says ``sampling``]
- ``reconnect`` ``tokens int64 [length]``

On the device plane (``slot >= 0``, agreed by ``attach``) a row message carries no
``hidden`` frame: its rows sit in the target's shared device slot ``slot``, and
``meta`` gets one more column, the slot row of each request's first row.

Request ``i`` owns the next ``count`` rows, which sit at positions
``start .. start+count-1``; a propose's anchor sits at ``start + count``.
Requests are integer *handles* chosen by the client (never reused within its
session); their state lives in the namespace of the session the client
declared in ``hello``. ``hidden`` is empty when the header's ``hidden`` is "".

A reply is ``[v, seq, ok, server_id, error, failures, result, tensors]``
(:class:`ReplyHeader`) plus raw frames listed in ``tensors`` as
``[name, dtype, shape]``. ``failures`` lists ``[i, code, message]`` for the
requests of a batch that failed on their own; the others succeeded.
A version-1 peer gets ``BAD_VERSION`` in version-1 framing.
"""
from k3_accel.protocol.base import *  # noqa: F401,F403
from k3_accel.protocol.messages import *  # noqa: F401,F403
from k3_accel.protocol.replies import *  # noqa: F401,F403
