"""Everything that crosses the broker between the coordinator and a worker, each
message defined once and checked at the edge (docs/security.md).

- :mod:`fedq.protocol.envelope`: what every message shares: the message format and
  fedq version of the handshake, job ids, queue names, blob digests, bounded numbers,
  :class:`~fedq.protocol.envelope.FormatError`, a running task's claim.
- :mod:`fedq.protocol.training`: a training task (:class:`~fedq.protocol.training.TrainRef`)
  and its result (:class:`~fedq.protocol.training.UpdateRef` with its
  :class:`~fedq.protocol.training.TrainStats`): one dataclass each, whose annotations are
  also the strict check of what a worker sends.
- :mod:`fedq.protocol.inference`: an inference shard, a served batch, their answers and
  the checks of their outputs.

Nothing is re-exported here: import from the module that defines a name.
"""
