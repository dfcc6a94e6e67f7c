"""Helpers the tests use (NVRTC compile check); not part of the runtime."""
