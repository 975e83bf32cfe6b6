"""Where arrays cross into cuattn: DLPack in and out (``dlpack``), the route of one attention
call (``dispatch``), torch autograd (``torch_autograd``) and jax's custom VJP (``jax_vjp``).
Nothing below this layer knows torch or jax."""
