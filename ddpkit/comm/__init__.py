"""How bytes travel between the ranks: every collective's journey, from a strategy's call to the wire.

``process_group`` (every collective counted, recorded, emulated, remembered), ``emulator`` (a
thread per emulated link), ``flight`` (a ring of the rank's last collectives) and ``desync`` (their
reading when ranks part), ``transport/`` (shared memory between CPU ranks on one host).
``ddpkit.network`` and ``ddpkit.topology`` are the vocabulary shared with the cost model.
"""
