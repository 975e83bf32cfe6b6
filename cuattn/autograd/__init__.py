"""The handwritten reverse-mode tape (``tape``) and its differentiable operations (``ops``).

Importing this package imports ``ops``, which gives ``Tensor`` its arithmetic operators.
"""

from cuattn.autograd import ops, tape

__all__ = ["ops", "tape"]
