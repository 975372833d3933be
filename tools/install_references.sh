#!/bin/sh
# Installs the test-only references beside towers, into the Python environment that runs the tests:
# PyTorch and torchvision (they load the exported torch layout; torchvision's ResNet-50), TensorFlow
# (Keras loads the towers layout; one step of the TF1 multi-GPU example's graph), at the versions the
# tests were last run with.  Then every test that importorskips them runs instead of skipping:
#
#     sh tools/install_references.sh && python -m pytest -q
#
# torch's CUDA build (the one torchvision 0.29.1 is built against) runs on the CPU as well.  It brings
# triton, torch's GPU kernel compiler, which torch.optim imports lazily: triton's bundled LLVM crashes
# the process (SIGSEGV) when TensorFlow was imported first, as a test session that runs both does.
# The tests use neither torch.compile nor a GPU in torch, so triton is removed (pip check then notes
# that torch lists it).
set -e
PYTHON=${PYTHON:-python}
"$PYTHON" -m pip install "torch==2.14.1" "torchvision==0.29.1" "tensorflow-cpu==2.21.0"
"$PYTHON" -m pip uninstall -y triton
"$PYTHON" -c "import tensorflow, torch, torchvision; print('references: torch', torch.__version__, \
'torchvision', torchvision.__version__, 'tensorflow', tensorflow.__version__)"
