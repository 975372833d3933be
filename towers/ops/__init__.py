"""The ops: each op's arithmetic written once, its NumPy, compiled-CPU and GPU forms beside it or derived from it.

Kernels are organized by op, not by backend.  An elementwise op is a
definition, a Python function of one element (``towers.ops.codegen.expr``), from which
``towers.ops.codegen.elementwise`` derives every form; an op whose forms must differ
(a reduction over windows or channels, an index gather) keeps them side by
side in its own module:

==================  ==============================  ==================================================
module              ops                             forms
==================  ==============================  ==================================================
``activation``      ``relu``, ``relu_backward``,    derived from one definition each
                    ``add_relu``
``bias``            ``bias_add`` (derived),         ``bias_grad``, ``col_sum``: NumPy's sum or a GEMV
                    ``bias_grad``, ``col_sum``
``l2``              ``add_scaled`` (L2's gradient)  derived
``mean2``           ``mean2`` (two towers' mean)    derived
``precision``       ``round_to`` (bf16, fp16)       NumPy integer passes or a cast, CUDA (bits)
``softmax_xent``    the loss and its gradient       NumPy passes, one CUDA kernel (rows)
``im2col``          ``im2col``, ``col2im``          NumPy views and strided adds, numba gather, CUDA
``maxpool``         ``maxpool``, backward           NumPy passes, numba loops, CUDA (windows)
``batch_norm``      batch norm's passes             NumPy passes and GEMVs, numba loops, CUDA (channels)
``gemm``            ``gemm``                        ``numpy.matmul``, one cuBLAS call
==================  ==============================  ==================================================

The optimizers' updates and the EMA are ops too, defined in their own files
(``towers.optim``) and derived the same way.  Which form runs: device arrays
take the GPU form; host arrays the compiled loops or NumPy's passes, as the
current forms say (``towers.ops.forms``: a run's, chosen once, current in its towers' scopes).
The GPU forms of the modules' ops are registered, in the order imported
here, into the one CUDA module of ``towers.devices.kernels``.
"""
from towers.ops import bias, activation, l2, softmax_xent, im2col, maxpool, batch_norm, mean2, precision  # noqa: F401  (this order)
