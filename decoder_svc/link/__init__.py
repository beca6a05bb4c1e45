"""The decoder's link to a materializer: ``materializer_link.MaterializerLink`` and its parts.

- :mod:`.materializer_link`: the façade the decode loop and the pipeline use
  (``submit``, ``note_slot_wait``, ``start``/``close``, its state and counters);
- :mod:`.state`: what the parts share (settings, the step queue, the streams, the locks);
- :mod:`.dispatch`: the dispatcher thread (send, queue, or build now);
- :mod:`.delivery`: in-order delivery, building a step in-process;
- :mod:`.transport`: the gRPC streams, their receivers and the connector;
- :mod:`.failover`: switching to in-process building and back, drain handover;
- :mod:`.watchdog`: the stall watchdog.
"""
