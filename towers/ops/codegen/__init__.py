"""The kernel generator: an elementwise op's definition traced once, its three forms written from the trace.

``expr`` traces a definition (a Python function of one element) into a DAG;
``numpy_form``, ``numba_form`` and ``cuda_form`` write its NumPy passes, its
numba loop's source and its CUDA kernel's text from that DAG; ``elementwise``
is the op that holds the three and picks one per call.  The ops themselves
(the catalogue: ``towers.ops``, the optimizers' updates in ``towers.optim``)
are definitions handed to ``elementwise.Elementwise``; numba's compile and
disk cache are ``towers.ops.numba_jit``'s, shared with the hand-written loops.
"""
