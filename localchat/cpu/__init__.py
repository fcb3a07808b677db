"""The Linux-CPU speed-ups: a fast BLAS loaded before MLX (``backend``), float32 copies of
quantized weights kept on disk (``derived``), and attention whose softmax avoids MLX's slow
CPU ``exp`` (``attention``). Off on Metal and CUDA: ``backend.cpu_path()`` is the one check.
"""
