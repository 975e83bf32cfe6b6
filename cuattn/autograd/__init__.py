"""The handwritten reverse-mode tape (``tape``: ``Tensor`` with its arithmetic, ``Function``,
``recompute``) and block-sparse attention as a tape op (``attention``).

``ops`` is the old home of the tape's ops, kept for one release: its names warn and resolve to
their new places.
"""

from cuattn.autograd import attention, ops, tape

__all__ = ["attention", "ops", "tape"]
