"""The application: the ``pdeformer`` command (``cli``), one session per command (``run``),
convergence studies (``converge``) and the NTK test (``ntk``)."""
