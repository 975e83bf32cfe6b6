"""The handwritten reverse-mode tape (``tape``: ``Tensor`` with its arithmetic, ``Function``,
``recompute``) and block-sparse attention as a tape op (``attention``).
"""

from cuattn.autograd import attention, tape

__all__ = ["attention", "tape"]
