"""Runtime: runs a plan: the CUDA graph executable, launchers, argument/result I/O, the XLA
FFI call path, the CPU plan interpreter, and the libraries (libs/)."""
