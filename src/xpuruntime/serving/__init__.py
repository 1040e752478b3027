"""Serving and batch inference on Ray (``pip install xpuruntime[ray]``).

Import-light: Ray is imported when :func:`deployment` or :class:`Predictor` is used,
not by ``import xpuruntime.serving``. Nothing here schedules or communicates: Ray
Serve replicates the sessions and batches the requests, Ray Data spreads the batches
over actors; each replica or actor holds one :class:`~xpuruntime.InferenceSession`.
"""

from ._data import Predictor
from ._serve import SessionServer, deployment

__all__ = ["Predictor", "SessionServer", "deployment"]
