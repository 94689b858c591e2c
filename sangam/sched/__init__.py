"""The policy core: everything that decides, and nothing that computes (docs/design.md §1, §4).

A request's block geometry and position (``block_cursor``), its state machine and timeline
(``request``), the scheduling and deployment configurations (``config``), page allocation
(``page_allocator``), the deficit ``BatchBuilder`` (``batch_builder``), one worker's requests
and iteration (``worker_core``), the ``Router`` (``router``), ``Placement`` (``placement``:
where each block runs and when K/V moves, in every mode, failures included), the front's
decisions over it (``front_core``) and what fronts and workers tell each other (``messages``).
Pure Python: no tensors, no clock (time is an argument), no I/O. The engine (in process and
over worker processes) and the simulator (``sangam-bench sim``) run the same objects.
"""
