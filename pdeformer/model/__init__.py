"""The mean-field transformer's parts: the head measure (``heads``), the attention velocity
and its backends (``velocity``), prompts, objectives, closed forms (``exact``) and the
particle model, a finite transformer (``particles``); the run configuration assembled
from the keys they declare (``schema``, ``config``). numpy and mpi4py only."""
