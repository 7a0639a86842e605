"""tandem_native for the dense path's small native steps, or None where it is not built: the dense
path runs without it (CUDA machines, a bare checkout), on torch's ops."""

try:
    import tandem_native
except ImportError:
    tandem_native = None
