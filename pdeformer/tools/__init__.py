"""Infrastructure every layer uses: errors, option keys and their checks (``keys``), TOML
files and ``--set`` overrides (``tomlfile``), MPI helpers and metered collectives
(``parallel``), data sets, memory budget, output files and folders."""
