"""Runtime: runs a plan: the graph build (graph.py), the runners (runner.py lists them),
launchers, argument/result I/O, the XLA FFI call path, the CPU plan interpreter, and the
libraries (libs/)."""
