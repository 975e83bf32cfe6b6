"""Where arrays cross into cuattn: DLPack in and out (``dlpack``), the route of one attention
call (``dispatch``), torch custom ops with autograd and torch.compile support (``torch_ops``)
and jax's custom VJP (``jax_vjp``). Nothing below this layer knows torch or jax."""
