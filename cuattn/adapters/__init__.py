"""Where arrays cross into cuattn: DLPack in and out (``dlpack``), the route of one attention
call (``dispatch``), torch custom ops with autograd and torch.compile support (``torch_ops``),
jax's custom VJP (``jax_vjp``) and the kernels as XLA custom calls under jax.jit on CUDA
(``jax_xla``), FlexAttention's BlockMask to and from a Layout (``flex``). Nothing below this
layer knows torch or jax."""
