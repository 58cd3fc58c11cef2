"""The march on the mesh (``forward``), its adjoint (``adjoint``), output during a run
(``trackers``) and training (``train``)."""
