"""Runtime libraries reached through ctypes: cuBLAS, cuBLASLt, cuDNN."""
