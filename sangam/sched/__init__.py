"""The policy core: everything that decides, and nothing that computes (docs/design.md §1, §4).

The request state machine (``request``), page allocation (``page_allocator``), the deficit
``BatchBuilder`` (``batch_builder``), the ``Router`` (``router``) and ``Placement``
(``placement``: where each block runs and when K/V moves, in every mode, failures included).
Pure Python: no tensors, no clock (time is an argument), no I/O. The engine's multi-worker
front and the simulator (``sangam-bench sim``) drive the same objects.
"""
