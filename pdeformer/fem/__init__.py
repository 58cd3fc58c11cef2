"""The finite-element layer: the dolfinx version layer (``_dolfinx``, the one module that
knows 0.5 from 0.9), meshes (``mesh``) and the DG transport with its limiter (``transport``)."""
