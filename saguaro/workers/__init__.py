"""Worker processes: starting and supervising the processes an engine runs beside itself.

Two kinds of worker share this machinery: the SSD speculator process (``ssd/worker.py``) and the ranks of a
tensor-parallel target that Saguaro starts itself (``parallel/launch.py``). Files: ``process.py`` (a fresh
interpreter per worker, every start-up wait watching it: ``WorkerProcess``, ``expect_all``), ``shipment.py``
(what a worker receives of a model: a name, or tensors in shared memory), ``shared_file.py`` (the anonymous
in-memory file a worker inherits by descriptor). A worker silent for ``Config.worker_timeout_s`` is declared
dead, whichever kind it is.
"""
