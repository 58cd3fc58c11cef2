"""Infrastructure every layer uses: errors, the config schema (``config``), MPI helpers and
metered collectives (``parallel``), memory budget, output files and folders."""
