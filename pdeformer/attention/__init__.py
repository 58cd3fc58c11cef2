"""Softmax attention on weighted points: direct summation and its reverse mode
(``softmax``), the log-Laplace table and fine grid (``laplace``), and their compiled loops
(``compiled``, C sources in ``kernels/``). numpy and mpi4py only."""
