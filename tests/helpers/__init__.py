"""What several test files share: model and program zoos, the primitive table and its
records, the C++ kernel emulator, graph evaluation helpers."""
