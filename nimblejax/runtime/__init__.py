"""Runtime: memory plan, launch plan, CUDA graph executable, CPU plan interpreter."""
