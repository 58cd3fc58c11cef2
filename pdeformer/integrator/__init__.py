"""The time integrator both models share: SSP schemes (``schemes``), the march through
depth with its step controllers and the adjoint's sweep (``march``), save points (``frames``)."""
