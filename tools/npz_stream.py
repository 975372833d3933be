"""Write an ``.npz`` whose arrays are streamed from files, never held in memory.

``numpy.savez`` needs every array in memory at once.  :func:`write_npz`
instead writes each member of the zip archive as an ``.npy`` header followed
by the raw bytes of an :class:`ArraySource`, copied in blocks, so a 10 GB
output costs a few MiB of memory.  The result is an ordinary npz archive
(ZIP64 where needed) that ``numpy.load`` reads.
"""

import zipfile

import numpy as np

_BLOCK = 8 << 20


class ArraySource:
    """An array to write: a dtype, a shape and where its C-order bytes come from.

    Either ``array`` (in memory) or ``path`` (a raw file of exactly
    ``prod(shape) * itemsize`` bytes, such as a column spill file).
    """

    def __init__(self, dtype, shape, path=None, array=None):
        self.dtype, self.shape, self.path, self.array = np.dtype(dtype), tuple(shape), path, array

    @classmethod
    def of(cls, array):
        array = np.ascontiguousarray(array)
        return cls(array.dtype, array.shape, array=array)

    def blocks(self):
        if self.array is not None:
            yield memoryview(self.array.reshape(-1).view(np.uint8))
            return
        expected = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        if expected == 0:
            return
        with open(self.path, "rb") as f:
            while expected > 0:
                block = f.read(min(_BLOCK, expected))
                if not block:
                    raise OSError(f"{self.path}: spill file is shorter than its array")
                expected -= len(block)
                yield block

    def load(self):
        """The whole array in memory (for small arrays and for tests)."""
        data = b"".join(bytes(b) for b in self.blocks())
        return np.frombuffer(data, self.dtype).reshape(self.shape)


def write_npz(path, entries, compress=False):
    """Write ``entries``, an iterable of ``(key, ArraySource)``, to the npz file ``path``."""
    method = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with zipfile.ZipFile(path, "w", method, allowZip64=True) as archive:
        for key, source in entries:
            header = {"descr": np.lib.format.dtype_to_descr(source.dtype), "fortran_order": False,
                      "shape": source.shape}
            with archive.open(key + ".npy", "w", force_zip64=True) as member:
                np.lib.format.write_array_header_1_0(member, header)
                for block in source.blocks():
                    member.write(block)
